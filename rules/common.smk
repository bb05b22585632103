# Validation, matrix expansion, input functions and wildcard constraints, all derived from
# one validated config (servematrix.config). A bad config stops here, before any job.
import json
from pathlib import Path

from servematrix import config as sb_config
from servematrix.workflow import fail_on_config_error, workflow_config

# Snakemake's own `config` is not used: the workflow re-reads the config file (the
# --configfile ones if given, else config/config.yaml, never both merged) with the same
# loader and checks as `servematrix check`, then applies the --config overrides.
with fail_on_config_error():
    SB = workflow_config(
        workflow.config_settings.configfiles,
        workflow.config_settings.config,
        Path(workflow.basedir) / "config" / "schema.yaml",
    )
# The report's Jinja templates read `config`: give them the validated one, defaults filled.
config.clear()
config.update(SB.raw)

STUDIES = SB.studies
FIGURES = ("ttft", "tpot", "itl", "throughput", "memory")
# The workload's file name is spelled by servematrix.config.workload_token alone.
CELL_PATTERN = "{recipe}/{model}/{mode}/{workload}"


wildcard_constraints:
    backend=sb_config.wildcard_pattern([SB.backend]),
    recipe=sb_config.wildcard_pattern(sb_config.RECIPES),
    model=sb_config.wildcard_pattern(SB.models),
    mode=sb_config.wildcard_pattern(sb_config.MODES),
    study=sb_config.wildcard_pattern(STUDIES),
    workload=sb_config.WORKLOAD_TOKEN_PATTERN,


def study_outputs(study):
    base = f"results/{SB.backend}"
    return [
        f"{base}/summary/{study}.parquet",
        f"{base}/summary/{study}.csv",
        f"{base}/summary/{study}.html",
        *expand(f"{base}/figures/{study}/{{figure}}.{{ext}}", figure=FIGURES, ext=("svg", "html")),
        f"{base}/findings/{study}.md",
        f"{base}/findings/{study}.html",
    ]


def get_final_output():
    """Every study's outputs, and every trace: a deleted trace is rebuilt, with its aggregates."""
    traces = [cell.path for cell in SB.all_cells()]
    return traces + [path for study in STUDIES for path in study_outputs(study)]


def get_cell(wildcards, output):
    """The resolved cell behind a trace path (JSON, so a changed setting reruns the cell)."""
    with fail_on_config_error():
        return json.dumps(SB.cell_at(output[0]).to_dict(), sort_keys=True)


def get_study_traces(wildcards):
    return [cell.path for cell in STUDIES[wildcards.study].cells]


def get_study_title(wildcards):
    return STUDIES[wildcards.study].title


def get_study_x(wildcards):
    return STUDIES[wildcards.study].x


def get_slo_ms(wildcards):
    return dict(SB.slo_ms)
