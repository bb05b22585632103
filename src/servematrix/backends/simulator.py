"""The simulator: the engine model in virtual time, inside the workflow's own process."""

from __future__ import annotations

from typing import Any

from servematrix.backends.run import BackendRun
from servematrix.spec.matrix import Cell, Config

NAME = "simulator"
MEASURED = False
ENGINE_MODEL = True
DEPLOYS = False
REAL_HARDWARE = False
SETS_FLAGS = True
CONDA_ENV = "servematrix"


def preflight(cfg: Config) -> None:
    """Nothing beyond the engine checks every backend of the engine model gets (`preflight`)."""


def run(cell: Cell) -> BackendRun:
    from servematrix.deploy.memory import simulated
    from servematrix.engine.hardware import DEFAULT_GPU
    from servematrix.simulate import simulate

    result = simulate(cell)
    gpu = str(cell.engine.get("gpu", DEFAULT_GPU))
    util = cell.serving.gpu_memory_utilization
    memory_use = simulated(gpu, util, result.kv, result.peak_kv_blocks)
    engine = result.engine_parameters
    reuse = {}
    if cell.serving.prefix_caching:
        reuse = {
            "queries_tokens": engine["prefix_cache_queries_tokens"],
            "hits_tokens": engine["prefix_cache_hits_tokens"],
        }
    deployment = {"engine": engine, "memory": memory_use, "prefix_cache": reuse}
    return BackendRun(result.records, deployment)


def identity(cell: Cell) -> dict[str, Any]:
    return {"engine": dict(cell.engine)}


def caveat(gpu: str, step_times: list[str], profile: str | None) -> str:
    sources = f" {step_times[0]}" if step_times else ""
    return (
        f"Caveat: simulated, not measured — servematrix's engine model of {gpu} in virtual "
        f"time.{sources} Confirm the winner with a few measured probes around its capacity."
    )
