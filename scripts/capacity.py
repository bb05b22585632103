# Snakemake adapter: one deployment's capacity search (probes run in this job, as cells).
import json

from servematrix.capacity_run import search_deployment, write_deployment
from servematrix.matrix import Cell
from servematrix.slo import Slo
from servematrix.workflow import log_to

log_to(snakemake.log[0])
cells = [Cell.from_dict(data) for data in json.loads(snakemake.params.cells)]
hint = None
if snakemake.input.simulated:  # a measured run: probe around the simulator's capacity
    with open(snakemake.input.simulated[0], encoding="utf-8") as simulated:
        hint = json.load(simulated)["capacity_rps"] or None
slo = Slo.from_config(snakemake.params.slo)
document = search_deployment(cells, slo, snakemake.params.settings, hint)
write_deployment(document, snakemake.output[0])
