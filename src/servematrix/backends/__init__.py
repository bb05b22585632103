"""The backends: who produces a cell's token timestamps. Each is one module behind one interface
(:class:`Backend`) and one line of :data:`BACKENDS`; callers ask the backend, never its name.

Adding a backend is a new module here that has every member of :class:`Backend`, and its line
in :data:`BACKENDS` (docs/architecture.md, "Adding a backend").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from servematrix.backends import emulator, external, simulator, vllm
from servematrix.spec.matrix import ConfigError

if TYPE_CHECKING:
    from servematrix.backends.run import BackendRun
    from servematrix.spec.matrix import Cell, Config


@runtime_checkable
class Backend(Protocol):
    """What the rest of servematrix asks a backend (a module is one: its constants and
    functions are the members)."""

    NAME: str
    """Its name in the config (``backend:``) and in the results' paths."""
    MEASURED: bool
    """Timestamps from the wall clock against a server (False: virtual time, a prediction)."""
    ENGINE_MODEL: bool
    """Timings from servematrix's engine model: the ``engine:`` settings apply, and a model
    that does not fit its modelled GPU is refused before any job."""
    DEPLOYS: bool
    """Starts the deployment's processes from a recipe (warm reuse, stopped at the run's end)."""
    REAL_HARDWARE: bool
    """Runs on the node's own GPUs or cores: the pinned ones must exist, are locked and asked
    from the scheduler, and the GPU is not the modelled one."""
    SETS_FLAGS: bool
    """The cell's serving flags are the server's (False: a server the user started)."""
    CONDA_ENV: str
    """The conda environment of its cell jobs (``envs/<name>.yaml``; ``{recipe}`` filled in)."""

    def preflight(self, cfg: Config) -> None:
        """Raise ConfigError, naming the key, for what this backend cannot start with (run by
        ``workflow.check_config`` before any job, after the name is `check`-ed)."""
        ...

    def run(self, cell: Cell) -> BackendRun:
        """Serve (or simulate) the cell's workload: the requests as seen, and the setup."""
        ...

    def identity(self, cell: Cell) -> dict[str, Any]:
        """The inputs of a cell's result that this backend adds to its identity."""
        ...

    def caveat(self, gpu: str, step_times: list[str], profile: str | None) -> str:
        """How far to trust its numbers (the Recommendation's last sentence): ``step_times``
        says where a virtual-time engine's step times came from, ``profile`` names the
        hardware profile an emulated engine's came from (None: its tables or the roofline)."""
        ...


BACKENDS: dict[str, Backend] = {
    "simulator": simulator,
    "emulator": emulator,
    "vllm": vllm,
    "external": external,
}
"""The registry: every backend by its name."""


def check(name: str) -> None:
    """Raise ConfigError, naming the ``backend`` key and the choices, for a name no backend
    has (the schema leaves the choices to the registry)."""
    if name not in BACKENDS:
        raise ConfigError("backend", f"{name!r} is not one of {list(BACKENDS)}")


def backend_of(name: str) -> Backend:
    """The backend called ``name`` (`check` it first where the name comes from a config)."""
    return BACKENDS[name]


def conda_env(name: str, recipe: str) -> str:
    """The conda environment (``envs/<it>.yaml``) of a cell of ``recipe`` on backend ``name``."""
    return BACKENDS[name].CONDA_ENV.format(recipe=recipe)


def names(**attributes: bool) -> list[str]:
    """The backends' names, those with the given attribute values only (``MEASURED=True``)."""
    return [
        name
        for name, backend in BACKENDS.items()
        if all(getattr(backend, key) == value for key, value in attributes.items())
    ]
