"""Run one cell on its backend (`servematrix.backends`: who produces the token timestamps).

Whatever serves the requests, the cell ends as one trace in the design's schema, written
atomically with a metadata document that makes the numbers traceable.
"""

from __future__ import annotations

import functools
import logging
import platform
import socket
import sys
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servematrix import __version__, backends
from servematrix.backends import prefixstats
from servematrix.backends.run import BackendRun, CellError
from servematrix.common.files import unwritable
from servematrix.spec import trace
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import CellIdentity

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)


def identity(cell: Cell) -> CellIdentity:
    w = cell.workload
    return CellIdentity(
        backend=cell.backend,
        recipe=cell.recipe,
        model=cell.model.name,
        mode=cell.mode.name,
        dataset=w.dataset,
        qps=w.qps,
        input_len=w.input_len,
        output_len=w.output_len,
        num_prompts=w.num_prompts,
        seed=w.seed,
    )


@functools.cache
def _version(package: str) -> str | None:
    """Cached: a lookup walks the installed distributions (a capacity search writes hundreds
    of traces in one process)."""
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


_TOP_LEVEL = ("clock", "memory", "prefix_cache")
"""Deployment keys the metadata keeps at its top level (``prefix_cache``: `prefixstats`)."""


def run_metadata(cell: Cell, started: datetime, run: BackendRun) -> dict[str, Any]:
    return {
        "cell": cell.to_dict(),
        "deployment": {k: v for k, v in run.deployment.items() if k not in _TOP_LEVEL},
        **{k: run.deployment[k] for k in ("clock", "memory") if k in run.deployment},
        "prefix_cache": {
            **run.deployment.get("prefix_cache", {}),
            **prefixstats.best(cell.workload),
        },
        "versions": {
            "servematrix": __version__,
            "python": sys.version.split()[0],
            "snakemake": _version("snakemake"),
            "vllm": _version("vllm"),
        },
        "host": {"hostname": socket.gethostname(), "platform": platform.platform()},
        # The modelled GPU, where the numbers are not the node's own hardware's.
        "gpu": None if backends.backend_of(cell.backend).REAL_HARDWARE else cell.engine.get("gpu"),
        "started_utc": started.isoformat(timespec="seconds"),
    }


def run_cell(cell: Cell, output: str | Path, keep_failed: bool = False) -> pa.Table:
    """Serve (or simulate) the cell's workload and write its trace to ``output`` (returned, as
    `trace.read` would return it).

    A served cell whose measured requests all failed (or more than ``deploy.max_failed_share``
    of them) is no result: CellError, and nothing is written, so the next run measures it
    again. ``keep_failed`` writes it anyway: a capacity probe's failures are its verdict."""
    backends.check(cell.backend)
    backend = backends.backend_of(cell.backend)
    problem = unwritable(output)
    if problem is not None:
        raise CellError(f"cannot write the trace: {problem}")
    started = datetime.now(UTC)
    log.info("cell %s: backend %s, %d requests", cell.path, cell.backend, cell.workload.num_prompts)
    run = backend.run(cell)
    failed = sum(not r.success for r in run.records)
    log.info("cell %s: %d rows, %d failed", cell.path, len(run.records), failed)
    if backend.MEASURED and not keep_failed:
        _check_failures(cell, run)
    return trace.write(output, identity(cell), run.records, run_metadata(cell, started, run))


def _check_failures(cell: Cell, run: BackendRun) -> None:
    from servematrix.client import loadgen

    url = f"{loadgen.normalize_base_url(run.deployment['base_url'])}/completions"
    share = float(cell.deploy.get("max_failed_share", 1.0))
    failure = loadgen.failure(run.records, url, share)
    if failure is not None:
        raise CellError(f"{failure}; no trace written")
