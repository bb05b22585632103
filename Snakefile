# servematrix: config in, report out. See README.md and shared design.
import sys

from snakemake.utils import min_version

from servematrix.workflow import missing_results, requested_report, stop_report_on_interrupt

min_version("9.0")

REPORT = requested_report(sys.argv)
if REPORT is not None:
    stop_report_on_interrupt(REPORT)


# No `configfile:` here: rules/common.smk reads config/config.yaml (or the --configfile given
# instead of it) with servematrix's loader, so `snakemake` and `servematrix check` agree.


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/cells.smk"
include: "rules/aggregate.smk"
include: "rules/figures.smk"
include: "rules/report.smk"
include: "rules/compare.smk"
include: "rules/capacity.smk"
include: "rules/calibrate.smk"


if REPORT is not None:
    with fail_on_config_error():
        message = missing_results(get_final_output())
    if message:
        print(message, file=sys.stderr)
        sys.exit(1)


rule all:
    default_target: True
    input:
        get_final_output(),
