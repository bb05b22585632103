# Snakemake adapter: a study's simulator summary against its measured one (ratios and figures).
from pathlib import Path

import polars as pl

from servematrix.reporting.compare import write_comparison
from servematrix.workflow import log_to

log_to(snakemake.log[0])
write_comparison(
    pl.read_parquet(snakemake.input.predicted),
    pl.read_parquet(snakemake.input.measured),
    snakemake.params.title,
    snakemake.params.x,
    Path(snakemake.output.parquet).parent,
)
