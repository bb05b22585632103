"""The simulator backend: the engine of ``servematrix.engine`` driven by a virtual clock.

It replays the cell's seeded arrival schedule (the one the real client uses) through the
cell's topology and writes what a client would have recorded: one streamed chunk per output
token, times in seconds from the benchmark start. Topologies by mode, each its own driver:

* ``single``: one instance, the client talks to it directly;
* ``nondisagg`` / ``chunked``: two instances behind vLLM's strict round-robin proxy; the
  warm-up requests take the first slots, as they do through ``round_robin_proxy.py``
  (`servematrix.simulate.roundrobin`);
* ``mooncake-rdma`` / ``mooncake-tcp``: the disaggregated proxy sends a ``max_tokens=1`` copy
  to the prefill instance and waits for it, then sends the request to the decode instance
  (`servematrix.simulate.disagg`, with the V0 and V1 KV handling in ``v0`` and ``v1``).

The drivers share one event queue with named event kinds (`servematrix.simulate.events`) and
the request bookkeeping, chunk emitter and warm-up (`servematrix.simulate.requests`). Warm-up
requests are sent one at a time before the clock starts and so have negative times.

The workload is the one every backend sends (``servematrix.workload``): per-request input and
output lengths (every request generates its ``max_tokens``, as with ``ignore_eos``), ``qps:
inf`` (all at t = 0) and ``max_concurrency``: the simulated client holds request k until it is
scheduled and one of the N slots is free, as ``vllm bench serve --max-concurrency`` does with an
``asyncio.Semaphore`` acquired in schedule order; a slot frees when a request's last chunk
reaches the client. Its ``sent_s`` is then later than its ``scheduled_s``.

A request the server would not serve (`servematrix.engine.admission`: beyond ``max_model_len``,
or, in V0, a prompt no free KV cache could hold) is a failed row with the error the client
would have recorded; it never reaches an engine, and the cell goes on. ``v1`` clamps a request
that fits only with fewer output tokens to what the context leaves, as 0.33 does. Each row's
``preemptions`` counts the engine's recompute preemptions of the request (both instances when
disaggregated). Sonnet prompts share their first ``RequestLengths.shared_prefix_tokens``
tokens (one prefix group), which a prefix-caching engine serves from its cache; the recipes run
vLLM without prefix caching unless the config's ``prefix_caching`` asks for it, and so does the
simulator.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from servematrix.engine.instance import EngineInstance
from servematrix.engine.kvcache import KvMemoryPlan
from servematrix.engine.setup import (
    DEFAULT_GPU,
    EngineSetup,
    cell_engine_setup,
    role_engine_setups,
)
from servematrix.engine.steptime import StepTimeModel
from servematrix.engine.transfer import NO_PROXY, ProxyHop
from servematrix.simulate.disagg import Disaggregated
from servematrix.simulate.requests import Served, serve_or_refuse
from servematrix.simulate.roundrobin import RoundRobin, round_robin_targets
from servematrix.simulate.v1 import OrderTie
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord
from servematrix.workload import TokenCounter, measured_sends, request_lengths, session_plan
from servematrix.workload.datasets import dataset_of

__all__ = [
    "Served",
    "SimulationResult",
    "engine_setup",
    "round_robin_targets",
    "serve_or_refuse",
    "simulate",
]

engine_setup = cell_engine_setup
"""The engine every instance of a cell runs (`servematrix.engine.setup.cell_engine_setup`)."""


@dataclass
class SimulationResult:
    """``kv`` is the modelled per-GPU memory layout every instance shares;
    ``peak_kv_blocks`` the most KV blocks each instance had in use at once (warm-ups
    included, as a server's own gauge would see them), in instance order (prefill, decode)."""

    records: list[RequestRecord]
    engine_parameters: dict[str, Any]
    kv: KvMemoryPlan
    peak_kv_blocks: list[int]


def simulate(
    cell: Cell,
    step_time: StepTimeModel | None = None,
    *,
    one_queue: bool = False,
    send_times_s: Sequence[float] | None = None,
) -> SimulationResult:
    """Simulate one cell in virtual time; deterministic for the cell's seed.

    ``step_time`` replaces the engine's step-time model. A V1 disaggregated cell without a
    concurrency cap runs pipelined (`servematrix.simulate.v1`) unless ``one_queue``: the same
    records either way, which is what ``one_queue`` is there to check. ``send_times_s``
    replaces the workload's seeded schedule (`servematrix.workload.measured_sends`): when
    each measured request is sent, in seconds from the benchmark start, one per request in
    order, e.g. the schedule a published benchmark run drew."""
    if send_times_s is not None:
        send_times_s = _checked_sends(cell, send_times_s)
    with _cyclic_gc_paused():
        return _simulate(cell, step_time, one_queue, send_times_s)


def _checked_sends(cell: Cell, send_times_s: Sequence[float]) -> np.ndarray:
    w = cell.workload
    if w.sessions is not None:
        raise ValueError("send_times_s cannot replace a multi-turn workload's schedule")
    sends = np.asarray(send_times_s, dtype=float)
    if sends.shape != (w.num_prompts,):
        raise ValueError(
            f"send_times_s has {sends.size} times for a workload of {w.num_prompts} requests"
        )
    if not (np.all(np.isfinite(sends)) and np.all(sends >= 0) and np.all(np.diff(sends) >= 0)):
        raise ValueError("send_times_s must be finite, non-negative and non-decreasing")
    return sends


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, restoring its previous state afterwards.

    A cell allocates about ten container objects per request (requests, chunk lists, records)
    and no reference cycles: reference counting frees everything. With the collector on, its
    passes over the ever-growing set of live objects took about a third of the wall time of
    a 100,000-request cell, for nothing.

    The objects the cell made are all in the youngest generation when the collector comes
    back, so the next allocation would scan every one of them (~3 % of a 100,000-request
    cell): unless the process has frozen objects of its own, they are moved to the oldest
    generation first (``gc.freeze`` then ``gc.unfreeze``: a move, no scan), as surviving one
    collection would have put them on the way there.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _simulate(
    cell: Cell, step_time: StepTimeModel | None, one_queue: bool, given_sends: np.ndarray | None
) -> SimulationResult:
    setup = cell_engine_setup(cell, step_time)
    workload = cell.workload
    turns = session_plan(workload) if workload.sessions is not None else None
    # a session's first turns; the rest follow their turns
    sends = measured_sends(workload) if given_sends is None else given_sends
    counter = (
        TokenCounter.for_model(cell.model.hf_id) if dataset_of(workload.dataset).TOKENIZED else None
    )
    lengths = request_lengths(workload, counter)
    setups = role_engine_setups(cell, setup, step_time)
    instances = _instances(cell, setups)
    served = serve_or_refuse(
        cell.recipe, cell.serving.max_model_len, instances[0].scheduler.pool, lengths
    )
    driver: RoundRobin | Disaggregated
    topology = cell.topology
    if topology.disaggregated:
        prefilling = topology.roles[0].count

        def disaggregated(instances: list[EngineInstance], pipelined: bool) -> Disaggregated:
            prefill, decode = instances[:prefilling], instances[prefilling:]
            return Disaggregated(
                cell, setups[-1], prefill, decode, lengths, served, pipelined=pipelined
            )

        driver = disaggregated(instances, not one_queue)
        try:
            records = driver.run(sends)
        except OrderTie:  # the pipelined run cannot order two events: run again on one queue
            instances = _instances(cell, setups)  # what the results below read
            driver = disaggregated(instances, False)
            records = driver.run(sends)
    else:
        hop = NO_PROXY if topology.instances == 1 else ProxyHop()
        latency_s = setup.host.request_latency_ms * 1e-3
        driver = RoundRobin(cell, instances, hop, lengths, served, turns, latency_s)
        records = driver.run(sends)
    parameters = _parameters(cell, setup, driver)
    if counter is not None:
        parameters["token_counter"] = counter.description
    if lengths.shared_prefix_tokens:
        parameters["shared_prefix_tokens"] = lengths.shared_prefix_tokens
    if cell.serving.prefix_caching:  # the instances that compute prompts (not a decode one)
        computing = instances[: topology.roles[0].count]
        parameters["prefix_cache_queries_tokens"] = sum(
            i.scheduler.prefix_queries_tokens for i in computing
        )
        parameters["prefix_cache_hits_tokens"] = sum(
            i.scheduler.prefix_hits_tokens for i in computing
        )
    return SimulationResult(
        records=records,
        engine_parameters=parameters,
        kv=setup.kv,
        peak_kv_blocks=[instance.scheduler.pool.peak_used_blocks for instance in instances],
    )


def _instances(cell: Cell, setups: list[EngineSetup]) -> list[EngineInstance]:
    """Fresh instances in topology order (prefill first), each seeded by its index."""
    seed, roles = cell.workload.seed, cell.topology.roles
    per_instance = [
        setup for setup, role in zip(setups, roles, strict=True) for _ in range(role.count)
    ]
    return [setup.instance(seed, index) for index, setup in enumerate(per_instance)]


def _parameters(
    cell: Cell, setup: EngineSetup, driver: RoundRobin | Disaggregated
) -> dict[str, Any]:
    return {
        "gpu": cell.engine.get("gpu", DEFAULT_GPU),
        "tensor_parallel": cell.model.tensor_parallel,
        "quantization": cell.model.quantization,
        "step_time_model": type(setup.step_time).__name__,
        "step_time_source": setup.step_time_label,
        "step_time_profile": cell.engine.get("profile"),
        "step_time_fallback": setup.step_time_fallback_record,
        "enforce_eager": cell.serving.enforce_eager,
        "scheduler": asdict(setup.scheduler),
        "kv_cache": asdict(setup.kv),
        "jitter_cv": setup.jitter_cv,
        "straggler_probability": setup.straggler_probability if setup.jitter_cv else 0.0,
        **driver.parameters(),
    }
