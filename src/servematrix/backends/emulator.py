"""The emulator: real processes and HTTP (the recipe's deployment, ``servematrix-emulator``
in place of vLLM) around the engine model, paced by the wall clock."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from servematrix.backends import served
from servematrix.backends.run import BackendRun
from servematrix.spec.matrix import Cell, Config
from servematrix.spec.trace import RequestRecord

if TYPE_CHECKING:
    from servematrix.deploy.processes import Plan

NAME = "emulator"
MEASURED = True
ENGINE_MODEL = True
DEPLOYS = True
REAL_HARDWARE = False
SETS_FLAGS = True
CONDA_ENV = "servematrix"


def modelled_layout(cell: Cell) -> dict[str, Any]:
    """The emulator's modelled weights and KV pool: it builds the simulator's engine from the
    vLLM flags the cell's deployment passes it."""
    from servematrix.deploy.memory import modelled_layout as layout
    from servematrix.engine.setup import EngineFlags, plan_engine

    return layout(plan_engine(cell.model.architecture, EngineFlags.of_cell(cell)).kv)


def _with_preemptions(
    plan: Plan, client: dict[str, Any], records: list[RequestRecord]
) -> list[RequestRecord]:
    """Each request's preemptions, as the emulated engines counted them."""
    from servematrix.deploy import emulated

    counts = emulated.preemptions(plan, client["request_id_prefix"])
    return [replace(r, preemptions=counts.get(r.request_id)) for r in records]


@served.failing_as_cell_error
def preflight(cfg: Config) -> None:
    """Nothing beyond the engine checks every backend of the engine model gets (`preflight`)."""


def run(cell: Cell) -> BackendRun:
    return served.run_deployed(
        cell, served.Deployed(REAL_HARDWARE, layout=modelled_layout, annotate=_with_preemptions)
    )


def identity(cell: Cell) -> dict[str, Any]:
    from servematrix.deploy.recipes import plan

    return {"engine": dict(cell.engine), "deployment": plan(cell).fingerprint}


def caveat(gpu: str, step_times: list[str], profile: str | None) -> str:
    steps = f", step times from the hardware profile {profile}" if profile else ""
    return (
        f"Caveat: real processes and HTTP around the simulated engine ({gpu}{steps}): the "
        "serving path is measured, the GPU is still the model's."
    )
