"""vLLM: the recipe's deployment of real vLLM on the node's GPUs (or CPU cores)."""

from __future__ import annotations

from typing import Any

from servematrix.backends import served
from servematrix.backends.run import BackendRun
from servematrix.spec.matrix import Cell, Config

NAME = "vllm"
MEASURED = True
ENGINE_MODEL = False
DEPLOYS = True
REAL_HARDWARE = True
SETS_FLAGS = True
CONDA_ENV = "vllm-{recipe}"
"""The cell (load generator, proxy, etcd) runs next to the recipe's vLLM."""


def preflight(cfg: Config) -> None:
    """A ``deploy.server_command`` that cannot start is one config line, not a failed cell."""
    from servematrix.deploy import command

    command.check(dict(cfg.raw))


def _check_hardware(cell: Cell, gpus: tuple[int, ...], kind: str) -> None:
    """The pinned GPUs exist (on a CPU node: the pinned cores are this process's)."""
    from servematrix.deploy import gpulock, recipes

    if kind == "cpu":
        gpulock.check_cores_allowed(f"models.{cell.model.name}.gpus", gpus)
        gpulock.check_cores_allowed("node.api_server_cores", recipes.api_server_cores(cell))
    else:
        gpulock.check_gpus_exist(cell.model.name, gpus)


@served.failing_as_cell_error
def run(cell: Cell) -> BackendRun:
    return served.run_deployed(cell, served.Deployed(REAL_HARDWARE, check_hardware=_check_hardware))


def identity(cell: Cell) -> dict[str, Any]:
    from servematrix.deploy.recipes import plan

    return {"deployment": plan(cell).fingerprint}


def caveat(gpu: str, step_times: list[str], profile: str | None) -> str:
    return f"Caveat: measured on the {NAME} backend (one machine, one run per seed)."
