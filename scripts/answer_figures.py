# Snakemake adapter: a study's capacity chart and Pareto chart (SVG and offline HTML).
from pathlib import Path

import polars as pl

from servematrix.overview import write_answer_figures
from servematrix.workflow import log_to

log_to(snakemake.log[0])
write_answer_figures(
    pl.read_parquet(snakemake.input.summary),
    pl.read_parquet(snakemake.input.capacity),
    snakemake.params.title,
    Path(snakemake.output.capacity).parent,
)
