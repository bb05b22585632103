"""What the backends that talk to a server share: the load generator against it, and a
deployment locked, reused or started, measured and handed back warm (emulator, vllm)."""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from servematrix.backends import prefixstats
from servematrix.backends.run import BackendRun, CellError
from servematrix.client.progress import Progress
from servematrix.common.signals import ignore_further
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord

if TYPE_CHECKING:
    from servematrix.deploy.processes import Plan

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0
"""The schema's default of ``deploy.request_timeout_s`` and ``deploy.first_byte_timeout_s``."""
PROGRESS_INTERVAL_S = 5.0
"""How often a measured cell's progress line goes to its log and the terminal."""


def failing_as_cell_error(run: Callable[[Cell], BackendRun]) -> Callable[[Cell], BackendRun]:
    """A backend that talks to a server: its known failures become one CellError."""

    @functools.wraps(run)
    def wrapped(cell: Cell) -> BackendRun:
        from servematrix.client.loadgen import LoadgenError
        from servematrix.deploy.nodes import NodeError
        from servematrix.deploy.supervise import DeployError

        try:
            return run(cell)
        except (DeployError, LoadgenError, NodeError) as error:
            raise CellError(str(error)) from error

    return wrapped


def _requests(cell: Cell) -> list:
    from servematrix.engine.architecture import load_architecture
    from servematrix.workload import TokenCounter, build_requests
    from servematrix.workload.datasets import dataset_of

    w = cell.workload
    counter = TokenCounter.for_model(cell.model.hf_id) if dataset_of(w.dataset).TOKENIZED else None
    vocab_size = load_architecture(cell.model.architecture).vocab_size
    return build_requests(w, vocab_size, counter)


def measure(
    cell: Cell, base_url: str, refused_timeout_s: float | None = None
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Drive the cell's workload against a server; failed requests are rows, not errors.
    ``refused_timeout_s``: how long refused connections are retried (None: the load
    generator's own rule)."""
    from servematrix.client import loadgen

    w = cell.workload
    settings = loadgen.ClientSettings(
        base_url=base_url,
        model=cell.model.hf_id,
        max_concurrency=w.max_concurrency,
        ignore_eos=w.ignore_eos,
        request_timeout_s=float(cell.deploy.get("request_timeout_s", REQUEST_TIMEOUT_S)),
        first_byte_timeout_s=float(cell.deploy.get("first_byte_timeout_s", REQUEST_TIMEOUT_S)),
        ready_timeout_s=float(cell.deploy.get("startup_timeout_s", 600.0)),
        refused_timeout_s=refused_timeout_s,
    )
    progress = Progress(
        w.num_prompts, tty=False, log_interval_s=PROGRESS_INTERVAL_S, label=f"cell {cell.path}"
    )
    result = loadgen.run(settings, _requests(cell), progress)
    clock = {"origin_monotonic_s": result.origin_monotonic_s}
    return result.records, {"clock": clock, "request_id_prefix": result.request_id_prefix}


class _Interrupted(KeyboardInterrupt):
    """SIGTERM (Snakemake stopping a job) handled as Ctrl-C: stop what the cell started."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_stopped_by: list[str] = []
"""The stop signal the running cell got, if any (see `run_deployed`)."""


def _on_stop_signal(signum: int, frame: Any) -> None:
    """The first stop signal interrupts the cell; later ones (Ctrl-C reaches a job both from
    the terminal and from Snakemake) are ignored, so that they cannot cut its clean-up short."""
    ignore_further(STOP_SIGNALS)
    _stopped_by.append(f"signal {signal.Signals(signum).name}")
    raise _Interrupted(_stopped_by[-1])


@dataclass(frozen=True)
class Deployed:
    """Where the deployed backends differ around their deployment's run."""

    real_hardware: bool
    """The backend's ``REAL_HARDWARE``: its memory is measured, its locks are machine-wide."""
    check_hardware: Callable[[Cell, tuple[int, ...], str], None] | None = None
    """Before the deployment starts, with its GPUs (cores) and the node's kind."""
    layout: Callable[[Cell], dict[str, Any]] | None = None
    """The modelled memory layout, recorded with the sampled memory."""
    annotate: Callable[[Plan, dict[str, Any], list[RequestRecord]], list[RequestRecord]] | None = (
        None
    )
    """The records with what the servers report about each request (after the run)."""


def run_deployed(cell: Cell, deployed: Deployed) -> BackendRun:
    """Lock the pinned GPUs, reuse or start the deployment, measure, hand it back warm.

    The deployment is stopped instead when the cell is interrupted (Ctrl-C, SIGTERM) or fails
    in any way other than failed requests, so nothing half-measured keeps running."""
    from servematrix.deploy import gpulock, memory, nodes, recipes, warm
    from servematrix.deploy.supervise import DeployError
    from servematrix.engine.hardware import DEFAULT_GPU

    _stopped_by.clear()
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    try:
        # On a SLURM allocation, the nodes this job was given (the fingerprint stays).
        plan = nodes.on_allocation(recipes.plan(cell), cell.deploy)
        settings, state_dir, logs = warm.settings_for(cell, deployed.real_hardware)
        timeout_s = settings.lease_timeout_s
        kind = recipes.node_kind(cell)
        with gpulock.GpuLocks(plan.gpus, state_dir / "gpu-locks", timeout_s, cell.path, kind):
            if deployed.check_hardware is not None:
                deployed.check_hardware(cell, plan.gpus, kind)
            lease = warm.acquire(plan, state_dir, warm.log_dir_for(plan, logs), settings)
            keep = False
            try:
                log.info(
                    "cell %s: deployment %s %s (%.1f s start-up)",
                    cell.path,
                    plan.fingerprint,
                    "fresh" if lease.fresh else "reused",
                    lease.startup_s,
                )
                gpu = str(cell.engine.get("gpu", DEFAULT_GPU))
                util = cell.serving.gpu_memory_utilization
                layout = deployed.layout(cell) if deployed.layout is not None else None
                groups = memory.process_groups(warm.read_state(lease.run_dir))
                computing = prefixstats.computing_instances(cell, memory.instances(plan))
                caching = cell.serving.prefix_caching
                before = prefixstats.scrape(computing) if caching else None
                with (
                    lease.watched(),
                    memory.sampled(
                        plan, deployed.real_hardware, gpu, util, layout, kind, groups
                    ) as memory_use,
                ):
                    records, client = measure(cell, lease.base_url)
                reuse = prefixstats.served(
                    before, prefixstats.scrape(computing) if caching else None
                )
                problem = lease.problem()
                if problem is not None:
                    raise DeployError(problem)
                if deployed.annotate is not None:
                    records = deployed.annotate(plan, client, records)
                keep = True
            finally:
                lease.release(keep)
    except DeployError:
        # Interrupted, the run's end (Snakemake's onerror) may stop the deployment while the
        # cell still winds down: the watcher's report of that is not the cell's failure.
        if _stopped_by:
            raise _Interrupted(_stopped_by[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    resolved = plan.resolve(str(lease.run_dir))
    deployment = {
        "fingerprint": plan.fingerprint,
        "recipe": plan.recipe,
        "base_url": plan.base_url,
        "started": "fresh" if lease.fresh else "reused",
        "startup_s": lease.startup_s,
        "processes": [p.to_dict() for p in resolved.processes],
        "files": dict(resolved.files),
        "memory": memory_use,
        "prefix_cache": reuse,
        **client,
    }
    return BackendRun(records, deployment)
