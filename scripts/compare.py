# Snakemake adapter: a study's simulator summary against its measured one (ratios and figures).
from pathlib import Path

import polars as pl

from servematrix.reporting.compare import measured_cells, write_comparison
from servematrix.workflow import log_to

log_to(snakemake.log[0])
predicted = pl.read_parquet(snakemake.input.predicted)
measured = pl.read_parquet(snakemake.input.measured)
if snakemake.params.confirmed:  # only the simulator's top topologies were measured
    predicted = measured_cells(predicted, measured)
write_comparison(
    predicted,
    measured,
    snakemake.params.title,
    snakemake.params.x,
    Path(snakemake.output.parquet).parent,
)
