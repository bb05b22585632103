# Snakemake adapter: run one cell and write its trace.
import json
import os
import sys
from pathlib import Path

# Under `--sdm conda` servematrix is not installed in the job's environment: import it from
# the workflow's own src/ (and let the deployment's processes do the same).
_SRC = Path(snakemake.scriptdir).parent / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_SRC), os.environ.get("PYTHONPATH")) if p
    )

from servematrix.backends.cell import CellError, run_cell  # noqa: E402
from servematrix.spec.matrix import Cell  # noqa: E402
from servematrix.workflow import interruption, log_to  # noqa: E402

logger = log_to(snakemake.log[0])
cell = Cell.from_dict(json.loads(snakemake.params.cell))
try:
    run_cell(cell, snakemake.output[0])
except CellError as error:
    # One clear message (with the failing process's log tail), not a traceback; the job's
    # log and the terminal both get it (servematrix.workflow.log_to).
    logger.error("cell %s: %s", cell.path, error)
    sys.exit(1)
except KeyboardInterrupt as stop:
    logger.error("cell %s interrupted (%s); nothing was written", cell.path, interruption(stop))
    sys.exit(130)
