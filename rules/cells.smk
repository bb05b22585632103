# One job per cell: deploy (or simulate), drive the workload, write one Parquet trace.
from servematrix.deploy.order import deployment_priority, stop_deployments


def cell_conda_env(wildcards):
    """Backend vllm runs the cell (load generator, proxy, etcd) next to the recipe's vLLM."""
    if wildcards.backend == "vllm":
        return f"../envs/vllm-{wildcards.recipe}.yaml"
    return "../envs/servematrix.yaml"


def cell_priority(wildcards):
    """Cells of one deployment run back to back (each deployment starts once per run)."""
    return deployment_priority(SB, CELL_PATTERN.format(**dict(wildcards.items())))


rule cell:
    output:
        f"results/{{backend}}/cells/{CELL_PATTERN}.parquet",
    log:
        f"results/{{backend}}/logs/{CELL_PATTERN}.log",
    params:
        cell=get_cell,
    priority: cell_priority
    conda:
        cell_conda_env
    script:
        "../scripts/run_cell.py"


# Warm deployments outlive their cells: the run's end stops them (and their idle watchdog
# would, a little later, if Snakemake itself is killed).
onsuccess:
    stop_deployments(SB)


onerror:
    stop_deployments(SB)
