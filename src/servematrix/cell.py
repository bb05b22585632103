"""Run one cell: the only place where the backends differ (who produces token timestamps).

Whatever serves the requests, the cell ends as one trace in the design's schema, written
atomically with a metadata document that makes the numbers traceable.
"""

from __future__ import annotations

import logging
import platform
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from servematrix import __version__, trace
from servematrix.config import Cell, ConfigError
from servematrix.trace import CellIdentity, RequestRecord

log = logging.getLogger(__name__)

AVAILABLE_BACKENDS = ("simulator",)


@dataclass
class BackendRun:
    """What a backend hands back: the requests as seen, and how it was set up."""

    records: list[RequestRecord]
    deployment: dict[str, Any]


def check_backend(backend: str) -> None:
    if backend not in AVAILABLE_BACKENDS:
        raise ConfigError(
            "backend",
            f"{backend!r} is not available in servematrix {__version__} "
            f"(available: {', '.join(AVAILABLE_BACKENDS)})",
        )


def _run_simulator(cell: Cell) -> BackendRun:
    from servematrix.simulate import simulate

    result = simulate(cell)
    return BackendRun(result.records, {"engine": result.engine_parameters})


_BACKENDS: dict[str, Callable[[Cell], BackendRun]] = {"simulator": _run_simulator}


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


def _version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def run_metadata(cell: Cell, started: datetime, run: BackendRun) -> dict[str, Any]:
    return {
        "cell": cell.to_dict(),
        "deployment": run.deployment,
        "versions": {
            "servematrix": __version__,
            "python": sys.version.split()[0],
            "snakemake": _version("snakemake"),
            "vllm": _version("vllm"),
        },
        "host": {"hostname": socket.gethostname(), "platform": platform.platform()},
        "gpu": cell.engine.get("gpu") if cell.backend != "vllm" else None,
        "started_utc": started.isoformat(timespec="seconds"),
    }


def run_cell(cell: Cell, output: str | Path) -> None:
    """Serve (or simulate) the cell's workload and write its trace to ``output``."""
    check_backend(cell.backend)
    started = datetime.now(UTC)
    log.info("cell %s: backend %s, %d requests", cell.path, cell.backend, cell.workload.num_prompts)
    run = _BACKENDS[cell.backend](cell)
    failed = sum(not r.success for r in run.records)
    log.info("cell %s: %d rows, %d failed", cell.path, len(run.records), failed)
    trace.write(output, identity(cell), run.records, run_metadata(cell, started, run))
