# One job per cell: deploy (or simulate), drive the workload, write one Parquet trace. A measured
# cell is a script job (its own process, next to its deployment); a simulated one runs inside
# Snakemake (servematrix.workflow.in_process_job), where it takes milliseconds, not the ~1 s a
# new interpreter and its imports cost.
import atexit
import json

from servematrix.backends import backend_of, conda_env
from servematrix.backends.cell import run_cell
from servematrix.deploy.order import (
    deployment_group,
    deployment_groups,
    deployment_priority,
    pinned_gpu_count,
)
from servematrix.deploy.nodes import slurm_node_count
from servematrix.spec.matrix import Cell
from servematrix.workflow import stop_deployments, stop_jobs_on_interrupt


def cell_conda_env(wildcards):
    """The backend's environment for its cells (vllm: next to the recipe's vLLM)."""
    return f"../envs/{conda_env(wildcards.backend, wildcards.recipe)}.yaml"


def cell_group(wildcards):
    """On a cluster every cell of one deployment goes into one job (one group, all of its
    components merged), so the deployment starts once per job and warm reuse holds there too
    (not when it spreads over several nodes of the job: see below).
    Locally cells stay separate jobs: priorities and the deployment registry keep them
    together. (Evaluated while the DAG is built, when the executor is known.)"""
    if workflow.local_exec or wildcards.backend != RUN_CONFIG.backend:
        return None  # locally, or a measured run's simulator twin (rules/compare.smk)
    if cell_nodes(wildcards) is not None:
        # Spread over N nodes, a cell is a job of its own: Snakemake sums the resources of a
        # group's parallel jobs, so a group job would ask for N nodes per cell.
        return None
    settings = workflow.group_settings
    names = deployment_groups(RUN_CONFIG)
    merged = dict(settings.group_components or {})
    if names[0] not in merged:
        merged.update({name: len(RUN_CONFIG.all_cells()) for name in names})
        settings.group_components = merged
    return deployment_group(RUN_CONFIG, CELL_PATTERN.format(**dict(wildcards.items())))


def cell_gpus(wildcards):
    """GPUs to request from the scheduler (SLURM --gpus): the deployment's pins, on the
    backends that run on the node's own GPUs."""
    if not backend_of(wildcards.backend).REAL_HARDWARE:
        return 0
    return pinned_gpu_count(RUN_CONFIG, CELL_PATTERN.format(**dict(wildcards.items())))


def cell_nodes(wildcards):
    """Nodes (and tasks, one per node) to request from the scheduler (SLURM --nodes,
    --ntasks): ``deploy.nodes`` when it is a count of the job's nodes (None: the default)."""
    return slurm_node_count(RUN_CONFIG.raw.get("deploy", {}))


def cell_priority(wildcards):
    """Cells of one deployment run back to back (each deployment starts once per run)."""
    return deployment_priority(RUN_CONFIG, CELL_PATTERN.format(**dict(wildcards.items())))


rule simulate_cell:
    input:
        get_cell_dataset,
        get_engine_profile,
    output:
        f"results/{{backend}}/cells/{CELL_PATTERN}.parquet",
    log:
        f"results/{{backend}}/logs/{CELL_PATTERN}.log",
    params:
        cell=get_cell,
        identity=get_cell_identity,
    wildcard_constraints:
        backend=SIMULATED_BACKENDS,
    group: cell_group
    run:
        with in_process_job(log[0]):
            run_cell(Cell.from_dict(json.loads(params.cell)), output[0])


rule cell:
    input:
        get_cell_dataset,
        get_engine_profile,
    output:
        f"results/{{backend}}/cells/{CELL_PATTERN}.parquet",
    log:
        f"results/{{backend}}/logs/{CELL_PATTERN}.log",
    params:
        cell=get_cell,
        identity=get_cell_identity,
    wildcard_constraints:
        backend=MEASURED_BACKENDS,
    priority: cell_priority
    group: cell_group
    resources:
        gpu=cell_gpus,
        nodes=cell_nodes,
        tasks=cell_nodes,
    conda:
        cell_conda_env
    script:
        "../scripts/run_cell.py"


# SIGINT to Snakemake alone stops the running cells too (servematrix.workflow).
stop_jobs_on_interrupt()


# Warm deployments outlive their cells: the run's end stops them (and their idle watchdog
# would, a little later, if Snakemake itself is killed). A cluster job (a group of cells on a
# compute node) runs without these hooks, so it stops its own deployments when it exits.
if workflow.remote_exec:
    atexit.register(stop_deployments, RUN_CONFIG)


onsuccess:
    stop_deployments(RUN_CONFIG)


onerror:
    stop_deployments(RUN_CONFIG)
