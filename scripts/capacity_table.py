# Snakemake adapter: a study's capacity per deployment, as Parquet, CSV and HTML.
from servematrix.aggregate import write_summary
from servematrix.capacity_run import TABLE_COLUMNS, study_table
from servematrix.workflow import log_to

log_to(snakemake.log[0])
write_summary(
    study_table(snakemake.input),
    snakemake.output.parquet,
    snakemake.output.csv,
    snakemake.output.html,
    title=f"Capacity at the SLO — {snakemake.params.title}",
    columns=[(name, name.replace("_", " ")) for name in TABLE_COLUMNS],
)
