# Snakemake adapter: one deployment's capacity search on a measured backend (probes run in this
# job, as cells); the simulator's searches run inside Snakemake (rules/capacity.smk).
from servematrix.capacity.run import capacity_job
from servematrix.workflow import log_to

log_to(snakemake.log[0])
capacity_job(
    snakemake.params.cells,
    snakemake.params.slo,
    snakemake.params.settings,
    snakemake.input.simulated,
    snakemake.output[0],
)
