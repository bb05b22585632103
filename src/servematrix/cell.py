"""Run one cell: the only place where the backends differ (who produces token timestamps).

Whatever serves the requests, the cell ends as one trace in the design's schema, written
atomically with a metadata document that makes the numbers traceable.
"""

from __future__ import annotations

import functools
import logging
import platform
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servematrix import __version__, prefixstats, trace
from servematrix.files import unwritable
from servematrix.matrix import PREDICTING_BACKEND, Cell, ConfigError
from servematrix.progress import Progress
from servematrix.signals import ignore_further
from servematrix.trace import CellIdentity, RequestRecord

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

AVAILABLE_BACKENDS = ("simulator", "emulator", "vllm", "external")
EXTERNAL_REFUSED_TIMEOUT_S = 30.0
"""The schema's default of ``deploy.refused_timeout_s``."""
REQUEST_TIMEOUT_S = 600.0
"""The schema's default of ``deploy.request_timeout_s`` and ``deploy.first_byte_timeout_s``."""
PROGRESS_INTERVAL_S = 5.0
"""How often a measured cell's progress line goes to its log and the terminal."""


class CellError(RuntimeError):
    """A cell could not be measured (its deployment failed, its server never answered)."""


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


def _modelled_layout(cell: Cell) -> dict[str, Any]:
    """The emulator's modelled weights and KV pool: it builds the simulator's engine from the
    vLLM flags the cell's deployment passes it."""
    from servematrix.deploy.memory import modelled_layout
    from servematrix.engine.setup import EngineFlags, plan_engine

    return modelled_layout(plan_engine(cell.model.architecture, EngineFlags.of_cell(cell)).kv)


def _requests(cell: Cell) -> list:
    from servematrix.engine.architecture import load_architecture
    from servematrix.workload import TokenCounter, build_requests

    w = cell.workload
    counter = (
        None if w.dataset in ("random", "mooncake") else TokenCounter.for_model(cell.model.hf_id)
    )
    vocab_size = load_architecture(cell.model.architecture).vocab_size
    return build_requests(w, vocab_size, counter)


def _measure(cell: Cell, base_url: str) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Drive the cell's workload against a server; failed requests are rows, not errors."""
    from servematrix import loadgen

    w = cell.workload
    settings = loadgen.ClientSettings(
        base_url=base_url,
        model=cell.model.hf_id,
        max_concurrency=w.max_concurrency,
        ignore_eos=w.ignore_eos,
        request_timeout_s=float(cell.deploy.get("request_timeout_s", REQUEST_TIMEOUT_S)),
        first_byte_timeout_s=float(cell.deploy.get("first_byte_timeout_s", REQUEST_TIMEOUT_S)),
        ready_timeout_s=float(cell.deploy.get("startup_timeout_s", 600.0)),
        # A server the user runs (external) refuses connections only when it is not there.
        refused_timeout_s=(
            float(cell.deploy.get("refused_timeout_s", EXTERNAL_REFUSED_TIMEOUT_S))
            if cell.backend == "external"
            else None
        ),
    )
    progress = Progress(
        w.num_prompts, tty=False, log_interval_s=PROGRESS_INTERVAL_S, label=f"cell {cell.path}"
    )
    result = loadgen.run(settings, _requests(cell), progress)
    clock = {"origin_monotonic_s": result.origin_monotonic_s}
    return result.records, {"clock": clock, "request_id_prefix": result.request_id_prefix}


def _run_external(cell: Cell) -> BackendRun:
    base_url = cell.deploy["base_url"]
    server = [base_url.rstrip("/").removesuffix("/v1")]  # its /metrics, if it is vLLM's
    before = prefixstats.scrape(server) if cell.serving.prefix_caching else None
    records, client = _measure(cell, base_url)
    after = prefixstats.scrape(server) if before is not None else None
    reuse = prefixstats.served(before, after)
    deployment = {"base_url": base_url, "started": "external", "prefix_cache": reuse, **client}
    return BackendRun(records, deployment)


class _Interrupted(KeyboardInterrupt):
    """SIGTERM (Snakemake stopping a job) handled as Ctrl-C: stop what the cell started."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_stopped_by: list[str] = []
"""The stop signal the running cell got, if any (see ``_run_deployed``)."""


def _on_stop_signal(signum: int, frame: Any) -> None:
    """The first stop signal interrupts the cell; later ones (Ctrl-C reaches a job both from
    the terminal and from Snakemake) are ignored, so that they cannot cut its clean-up short."""
    ignore_further(STOP_SIGNALS)
    _stopped_by.append(f"signal {signal.Signals(signum).name}")
    raise _Interrupted(_stopped_by[-1])


def _run_deployed(cell: Cell) -> BackendRun:
    """Lock the pinned GPUs, reuse or start the deployment, measure, hand it back warm.

    The deployment is stopped instead when the cell is interrupted (Ctrl-C, SIGTERM) or fails
    in any way other than failed requests, so nothing half-measured keeps running."""
    from servematrix.deploy import emulated, gpulock, memory, recipes, warm
    from servematrix.deploy.supervise import DeployError
    from servematrix.engine.hardware import DEFAULT_GPU

    _stopped_by.clear()
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in STOP_SIGNALS}
    try:
        plan = recipes.plan(cell)
        settings, state_dir, logs = warm.settings_for(cell)
        timeout_s = settings.lease_timeout_s
        kind = recipes.node_kind(cell)
        with gpulock.GpuLocks(plan.gpus, state_dir / "gpu-locks", timeout_s, cell.path, kind):
            if cell.backend == "vllm" and kind == "cpu":
                gpulock.check_cores_allowed(cell.model.name, plan.gpus)
            elif cell.backend == "vllm":
                gpulock.check_gpus_exist(cell.model.name, plan.gpus)
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
                layout = _modelled_layout(cell) if cell.backend == "emulator" else None
                groups = memory.process_groups(warm.read_state(lease.run_dir))
                computing = prefixstats.computing_instances(cell, memory.instances(plan))
                caching = cell.serving.prefix_caching
                before = prefixstats.scrape(computing) if caching else None
                with (
                    lease.watched(),
                    memory.sampled(
                        plan, cell.backend, gpu, util, layout, kind, groups
                    ) as memory_use,
                ):
                    records, client = _measure(cell, lease.base_url)
                reuse = prefixstats.served(
                    before, prefixstats.scrape(computing) if caching else None
                )
                problem = lease.problem()
                if problem is not None:
                    raise DeployError(problem)
                if cell.backend == "emulator":
                    counts = emulated.preemptions(plan, client["request_id_prefix"])
                    records = [replace(r, preemptions=counts.get(r.request_id)) for r in records]
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


def _served(run: Callable[[Cell], BackendRun]) -> Callable[[Cell], BackendRun]:
    """A backend that talks to a server: its known failures become one CellError."""

    def wrapped(cell: Cell) -> BackendRun:
        from servematrix.deploy.supervise import DeployError
        from servematrix.loadgen import LoadgenError

        try:
            return run(cell)
        except (DeployError, LoadgenError) as error:
            raise CellError(str(error)) from error

    return wrapped


_BACKENDS: dict[str, Callable[[Cell], BackendRun]] = {
    "simulator": _run_simulator,
    "emulator": _served(_run_deployed),
    "vllm": _served(_run_deployed),
    "external": _served(_run_external),
}


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
        "gpu": cell.engine.get("gpu") if cell.backend != "vllm" else None,
        "started_utc": started.isoformat(timespec="seconds"),
    }


def run_cell(cell: Cell, output: str | Path, keep_failed: bool = False) -> pa.Table:
    """Serve (or simulate) the cell's workload and write its trace to ``output`` (returned, as
    `trace.read` would return it).

    A served cell whose measured requests all failed (or more than ``deploy.max_failed_share``
    of them) is no result: CellError, and nothing is written, so the next run measures it
    again. ``keep_failed`` writes it anyway: a capacity probe's failures are its verdict."""
    check_backend(cell.backend)
    problem = unwritable(output)
    if problem is not None:
        raise CellError(f"cannot write the trace: {problem}")
    started = datetime.now(UTC)
    log.info("cell %s: backend %s, %d requests", cell.path, cell.backend, cell.workload.num_prompts)
    run = _BACKENDS[cell.backend](cell)
    failed = sum(not r.success for r in run.records)
    log.info("cell %s: %d rows, %d failed", cell.path, len(run.records), failed)
    if cell.backend != PREDICTING_BACKEND and not keep_failed:
        _check_failures(cell, run)
    return trace.write(output, identity(cell), run.records, run_metadata(cell, started, run))


def _check_failures(cell: Cell, run: BackendRun) -> None:
    from servematrix import loadgen

    url = f"{loadgen.normalize_base_url(run.deployment['base_url'])}/completions"
    share = float(cell.deploy.get("max_failed_share", 1.0))
    failure = loadgen.failure(run.records, url, share)
    if failure is not None:
        raise CellError(f"{failure}; no trace written")
