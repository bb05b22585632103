# Snakemake adapter: one deployment's capacity search (probes run in this job, as cells).
import json

from servematrix.capacity_run import search_deployment, write_deployment
from servematrix.config import Cell
from servematrix.slo import Slo
from servematrix.workflow import log_to

log_to(snakemake.log[0])
cells = [Cell.from_dict(data) for data in json.loads(snakemake.params.cells)]
document = search_deployment(
    cells, Slo.from_config(snakemake.params.slo), snakemake.params.settings
)
write_deployment(document, snakemake.output[0])
