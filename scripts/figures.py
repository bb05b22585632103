# Snakemake adapter: render a study's figures (SVG for the report, offline interactive HTML).
from pathlib import Path

import polars as pl

from servematrix.figures import write_study_figures
from servematrix.workflow import log_to

log_to(snakemake.log[0])
out_dir = Path(snakemake.output.ttft).parent
write_study_figures(
    pl.read_parquet(snakemake.input[0]), snakemake.params.title, snakemake.params.x, out_dir
)
