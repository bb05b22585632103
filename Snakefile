# servematrix: config in, report out. See README.md and shared design.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/cells.smk"
include: "rules/aggregate.smk"
include: "rules/figures.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        get_final_output(),
