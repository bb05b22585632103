# Snakemake adapter: run one cell and write its trace.
import json

from servematrix.cell import run_cell
from servematrix.config import Cell
from servematrix.workflow import log_to

log_to(snakemake.log[0])
run_cell(Cell.from_dict(json.loads(snakemake.params.cell)), snakemake.output[0])
