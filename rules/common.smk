# Validation, matrix expansion, input functions and wildcard constraints, all derived from
# one validated config (servematrix.spec.config). A bad config stops here, before any job.
import functools
import json
import shlex
import sys
from pathlib import Path

from servematrix import backends
from servematrix.capacity import confirm
from servematrix.capacity import run as capacity_run
from servematrix.spec import matrix
from servematrix.calibration.cli import calibration_arguments
from servematrix.engine.hardware import DEFAULT_GPU
from servematrix.backends.identity import cell_identity
from servematrix.workflow import (
    fail_on_config_error,
    in_process_job,
    predicted_config,
    workflow_config,
)

# Snakemake's own `config` is not used: the workflow re-reads the config file (the
# --configfile ones if given, else config/config.yaml, never both merged) with the same
# loader and checks as `servematrix check`, then applies the --config overrides. RUN_CONFIG is
# that validated config (servematrix.spec.matrix.Config), PREDICTED its simulator twin.
with fail_on_config_error():
    RUN_CONFIG = workflow_config(
        workflow.config_settings.configfiles,
        workflow.config_settings.config,
        Path(workflow.basedir) / "config" / "schema.yaml",
    )


def get_predicted_config():
    """A measured run's simulator twin (rules/compare.smk): None on the simulator, or when the
    engine cannot model the config; a measured run never fails for want of a prediction."""
    try:
        return predicted_config(RUN_CONFIG)
    except matrix.ConfigError as error:
        confirming = [name for name, study in RUN_CONFIG.studies.items() if study.confirm_top]
        if confirming:  # its candidates are the twin's picks: no twin, nothing to pick from
            with fail_on_config_error():
                raise matrix.ConfigError(
                    f"studies.{confirming[0]}.confirm_top",
                    f"picks from the simulator's search, which cannot model this config: {error}",
                )
        print(f"servematrix: no simulator prediction to compare with: {error}", file=sys.stderr)
        return None


PREDICTED = get_predicted_config()
# The cells whose step-time sources the report states: the run's own on the simulator, else
# the twin's (the emulator runs the same engine, so the same sources).
SIMULATED = PREDICTED if backends.backend_of(RUN_CONFIG.backend).MEASURED else RUN_CONFIG
# The report's Jinja templates read `config`: give them the validated one, defaults filled.
config.clear()
config.update(RUN_CONFIG.raw)

STUDIES = RUN_CONFIG.studies
FIGURES = ("ttft", "tpot", "itl", "throughput", "memory")
COMPARED_FIGURES = ("ttft", "tpot", "itl", "throughput")  # servematrix.reporting.compare.COMPARED_FIGURES
# The workload's file name is spelled by servematrix.spec.matrix.workload_token alone.
CELL_PATTERN = "{recipe}/{model}/{mode}/{workload}"


# A rule per kind of job where the kinds run differently (rules/cells.smk, capacity.smk):
# virtual time in Snakemake's process, measured cells in their own.
SIMULATED_BACKENDS = matrix.wildcard_pattern(backends.names(MEASURED=False))
MEASURED_BACKENDS = matrix.wildcard_pattern(backends.names(MEASURED=True))


wildcard_constraints:
    backend=matrix.wildcard_pattern(
        [RUN_CONFIG.backend, *([PREDICTED.backend] if PREDICTED is not None else [])]
    ),
    recipe=matrix.wildcard_pattern(matrix.RECIPES),
    model=matrix.wildcard_pattern(RUN_CONFIG.models),
    mode=matrix.wildcard_pattern(RUN_CONFIG.mode_names()),
    study=matrix.wildcard_pattern(STUDIES),
    workload=matrix.WORKLOAD_TOKEN_PATTERN,
    deployment=r"in\d+_out\d+(_[A-Za-z0-9.+-]+)*",


def study_outputs(study):
    base = f"results/{RUN_CONFIG.backend}"
    return [
        f"{base}/summary/{study}.parquet",
        f"{base}/summary/{study}.csv",
        f"{base}/summary/{study}.html",
        *expand(f"{base}/figures/{study}/{{figure}}.{{ext}}", figure=FIGURES, ext=("svg", "html")),
        f"{base}/findings/{study}.md",
        f"{base}/findings/{study}.html",
        *capacity_outputs(study),
    ]


def capacity_outputs(study):
    """The study's capacity table and charts, when the config states an SLO to search against."""
    if not RUN_CONFIG.slo.defined:
        return []
    base = f"results/{RUN_CONFIG.backend}"
    return [f"{base}/capacity/{study}.{ext}" for ext in ("parquet", "csv", "html")] + [
        f"{base}/figures/{study}/{name}.{ext}"
        for name in ("capacity", "pareto")
        for ext in ("svg", "html")
    ]


def get_overview_inputs(kind, ext):
    """One file per study for the front page (an input function factory: kind and ext); no
    capacity tables when the config sets no SLO (the page then says how to set one)."""

    def inputs(wildcards):
        if kind == "capacity" and not config_of(wildcards.backend).slo.defined:
            return []
        return [f"results/{wildcards.backend}/{kind}/{study}.{ext}" for study in STUDIES]

    return inputs


def prediction_outputs(study):
    """Where the study's simulated step times came from and, on a measured run, the
    simulator's prediction beside the measurement (rules/compare.smk)."""
    outputs = []
    if SIMULATED is not None:
        outputs += [f"results/simulator/step_times/{study}.{ext}" for ext in ("md", "html")]
    if PREDICTED is not None:
        base = f"results/{RUN_CONFIG.backend}/compare/{study}"
        outputs += [f"{base}/ratios.{ext}" for ext in ("parquet", "csv", "html")]
        outputs += expand(
            f"{base}/{{figure}}.{{ext}}", figure=COMPARED_FIGURES, ext=("svg", "html")
        )
    return outputs


def get_final_output():
    """Every study's outputs, and every trace: a deleted trace is rebuilt, with its aggregates.
    A confirming study's traces are its summary's inputs alone: which ones, the simulator's
    ranking decides (`confirmed_cells`)."""
    unconfirmed = [study for study in STUDIES.values() if not study.confirm_top]
    traces = list(dict.fromkeys(cell.path for study in unconfirmed for cell in study.cells))
    return (
        traces
        + [path for study in STUDIES for path in study_outputs(study) + prediction_outputs(study)]
        + [f"results/{RUN_CONFIG.backend}/overview.html"]
    )


def config_of(backend):
    """The run's config, or its simulator twin for the twin's paths."""
    return PREDICTED if PREDICTED is not None and backend == PREDICTED.backend else RUN_CONFIG


def cell_path_of(wildcards):
    """The trace a cell job writes, from its wildcards."""
    cell = CELL_PATTERN.format(**dict(wildcards.items()))
    return f"results/{wildcards.backend}/cells/{cell}.parquet"


def get_cell(wildcards, output):
    """The resolved cell behind a trace path, as JSON: what the job runs. Derived from the
    output path, so Snakemake does not compare it; `get_cell_identity` is what it compares."""
    with fail_on_config_error():
        return json.dumps(
            config_of(wildcards.backend).cell_at(output[0]).to_dict(), sort_keys=True
        )


def get_cell_identity(wildcards):
    """Every input of the cell's result (servematrix.backends.identity), compared by Snakemake with the
    last run's: a changed setting reruns exactly the cells it changes."""
    with fail_on_config_error():
        return cell_identity(config_of(wildcards.backend).cell_at(cell_path_of(wildcards)))


def get_cell_dataset(wildcards):
    """The dataset file a cell reads (sonnet, jsonl), as an input: none for random prompts."""
    path = config_of(wildcards.backend).cell_at(cell_path_of(wildcards)).workload.dataset_path
    return [path] if path else []


# `engine.profile` (the step times of every simulated or emulated cell), and `calibration:`
# (rules/calibrate.smk): the server to probe to write it.
ENGINE_PROFILE = RUN_CONFIG.raw.get("engine", {}).get("profile")
CALIBRATION = RUN_CONFIG.raw.get("calibration")


def get_engine_profile(wildcards):
    """The hardware profile as an input of the jobs that run the engine model (cells and
    capacity searches on the simulator and emulator): rule calibrate writes it when the config
    calibrates; a hand-written one reruns them when edited."""
    engine_model = backends.backend_of(wildcards.backend).ENGINE_MODEL
    return [ENGINE_PROFILE] if ENGINE_PROFILE and engine_model else []


def get_calibrate_args(wildcards):
    engine_gpu = RUN_CONFIG.raw.get("engine", {}).get("gpu", DEFAULT_GPU)
    return shlex.join(calibration_arguments(CALIBRATION, engine_gpu))


def confirming(wildcards):
    """Whether the study's cells on this backend are the simulator's picks (`confirm_top`)."""
    return wildcards.backend == RUN_CONFIG.backend and bool(
        STUDIES[wildcards.study].confirm_top
    )


def get_confirm_candidates(wildcards):
    """The simulator's picks (rules/capacity.smk's checkpoint), when the study confirms."""
    if not confirming(wildcards):
        return []
    return [f"results/{wildcards.backend}/confirm/{wildcards.study}.json"]


def get_confirm_top(wildcards):
    return STUDIES[wildcards.study].confirm_top


def get_study_confirms(wildcards):
    """Whether the measured run confirms only the simulator's top topologies of the study."""
    return bool(STUDIES[wildcards.study].confirm_top)


def study_cells(wildcards):
    """The study's cells on the backend: on a confirming study only the picked topologies',
    read once the simulator's ranking exists (Snakemake re-plans after the checkpoint)."""
    cells = config_of(wildcards.backend).studies[wildcards.study].cells
    if not confirming(wildcards):
        return cells
    picks = checkpoints.confirm_candidates.get(
        backend=wildcards.backend, study=wildcards.study
    ).output[0]
    return confirm.confirmed(cells, confirm.read_candidates(picks))


def get_study_traces(wildcards):
    return [cell.path for cell in study_cells(wildcards)]


def get_simulated_traces(wildcards):
    return [cell.path for cell in SIMULATED.studies[wildcards.study].cells]


def get_study_title(wildcards):
    return STUDIES[wildcards.study].title


def get_study_x(wildcards):
    return STUDIES[wildcards.study].x


def get_study_question(wildcards):
    """The question the config names for the study; None: the findings derive it."""
    return STUDIES[wildcards.study].question


def _deployment_path(wildcards):
    return "results/{backend}/capacity/{recipe}/{model}/{mode}/{deployment}.json".format(
        **dict(wildcards.items())
    )


@functools.cache
def deployments_of(backend):
    """Deployment path -> (template cells, the study cells behind it), built once per backend:
    a lookup per job, not a scan of every cell (planning stays linear in the matrix)."""
    cells = config_of(backend).all_cells()
    traces = {}
    for cell in cells:
        traces.setdefault(capacity_run.deployment_path(cell), []).append(cell.path)
    return {
        path: (templates, traces[path])
        for path, templates in capacity_run.deployments(cells).items()
    }


def deployment_cells(wildcards):
    """The deployment's template cells (one per seed) behind a capacity document's path."""
    path = _deployment_path(wildcards)
    cells = deployments_of(wildcards.backend).get(path, ([], []))[0]
    if not cells:
        with fail_on_config_error():
            raise matrix.ConfigError("studies", f"no study in the config has deployment {path}")
    return cells


def get_deployment_traces(wildcards):
    """The study cells of a measured deployment, run before its search (one deployment on the
    GPUs at a time)."""
    return deployments_of(wildcards.backend).get(_deployment_path(wildcards), ([], []))[1]


def get_simulated_capacity(wildcards):
    """A measured run's search starts from its simulator twin's answer (rules/compare.smk)."""
    if PREDICTED is None or wildcards.backend == PREDICTED.backend:
        return []
    return ["results/{}/capacity/{recipe}/{model}/{mode}/{deployment}.json".format(
        PREDICTED.backend, **dict(wildcards.items())
    )]


def get_deployment_cells(wildcards):
    """The template cells as JSON, so a changed setting reruns the search (and a changed
    rate or num_prompts of a study does not)."""
    return json.dumps([cell.to_dict() for cell in deployment_cells(wildcards)], sort_keys=True)


def get_study_deployments(wildcards):
    return list(capacity_run.deployments(study_cells(wildcards)))


def get_findings_capacity(wildcards):
    """The study's capacity table, when there is an SLO to search against."""
    if not config_of(wildcards.backend).slo.defined:
        return []
    return [f"results/{wildcards.backend}/capacity/{wildcards.study}.parquet"]


def get_slo_description(wildcards):
    return RUN_CONFIG.slo.describe()


def get_engine_gpu(wildcards):
    return str(RUN_CONFIG.raw["engine"]["gpu"])


def get_engine_profile_name(wildcards):
    """The hardware profile the engine model takes its step times from ("" for none)."""
    return ENGINE_PROFILE or ""


def get_backend(wildcards):
    return wildcards.backend


def get_slo(wildcards):
    return dict(RUN_CONFIG.raw["slo"])


def get_capacity_settings(wildcards):
    return dict(RUN_CONFIG.raw["capacity"])


def get_slo_ms(wildcards):
    """Per-request goodput bounds (servematrix.spec.slo)."""
    return RUN_CONFIG.slo.per_request_ms()
