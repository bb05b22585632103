# Snakemake adapter: where a study's simulated step times came from (measured tables or roofline).
from servematrix.steptimes import write_step_times
from servematrix.workflow import log_to

log_to(snakemake.log[0])
write_step_times(
    list(snakemake.input), snakemake.params.title, snakemake.output.md, snakemake.output.html
)
