# Snakemake adapter: one summary row per cell of a study.
from servematrix.aggregate import summarize, write_summary
from servematrix.workflow import log_to

log_to(snakemake.log[0])
summary = summarize(list(snakemake.input), slo_ms=snakemake.params.slo_ms)
write_summary(
    summary,
    snakemake.output.parquet,
    snakemake.output.csv,
    snakemake.output.html,
    title=snakemake.params.title,
)
