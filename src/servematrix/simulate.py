"""The simulator backend: the engine of ``servematrix.engine`` driven by a virtual clock.

It replays the cell's seeded arrival schedule (the one the real client uses) through the
cell's topology and writes what a client would have recorded: one streamed chunk per output
token, times in seconds from the benchmark start. Topologies by mode:

* ``single``: one instance, the client talks to it directly;
* ``nondisagg`` / ``chunked``: two instances behind vLLM's strict round-robin proxy; the
  warm-up requests take the first slots, as they do through ``round_robin_proxy.py``;
* ``mooncake-rdma`` / ``mooncake-tcp``: the disaggregated proxy sends a ``max_tokens=1`` copy
  to the prefill instance and waits for it, then sends the request to the decode instance. With
  the ``v0`` recipe the decode instance receives the KV inside its forward pass (the receive is
  part of its step and stalls everything else on it); with ``v1`` the KV moves asynchronously
  over a shared link and the request joins the decode batch when it has arrived.

Warm-up requests are sent one at a time before the clock starts and so have negative times.

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
import heapq
import math
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from math import inf
from typing import Any

import numpy as np

from servematrix.config import Cell
from servematrix.engine.admission import (
    NO_TOKEN_ERROR,
    ContextLengthError,
    granted_max_tokens,
    http_error,
    kv_capacity_message,
)
from servematrix.engine.instance import DecodeRun, EngineInstance, StepResult
from servematrix.engine.kvcache import BlockPool, KvMemoryPlan, kv_bytes_per_token_per_gpu
from servematrix.engine.scheduler import Request
from servematrix.engine.setup import (
    DEFAULT_GPU,
    DEFAULT_JITTER_CV,
    DEFAULT_STRAGGLER_PROBABILITY,
    EngineSetup,
    build_engine_setup,
)
from servematrix.engine.steptime import StepTimeModel
from servematrix.engine.transfer import (
    NO_PROXY,
    V0_KV_BUFFER_BYTES,
    LookupBuffer,
    ProxyHop,
    TransferLink,
    kv_link,
)
from servematrix.schedule import arrival_times
from servematrix.trace import RequestRecord
from servematrix.workload import RequestLengths, TokenCounter, request_lengths


@dataclass
class SimulationResult:
    """``kv`` is the modelled per-GPU memory layout every instance shares;
    ``peak_kv_blocks`` the most KV blocks each instance had in use at once (warm-ups
    included, as a server's own gauge would see them), in instance order (prefill, decode)."""

    records: list[RequestRecord]
    engine_parameters: dict[str, Any]
    kv: KvMemoryPlan
    peak_kv_blocks: list[int]


def simulate(cell: Cell, step_time: StepTimeModel | None = None) -> SimulationResult:
    """Simulate one cell in virtual time; deterministic for the cell's seed."""
    with _cyclic_gc_paused():
        return _simulate(cell, step_time)


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


def _simulate(cell: Cell, step_time: StepTimeModel | None) -> SimulationResult:
    setup = engine_setup(cell, step_time)
    workload = cell.workload
    sends = arrival_times(workload.num_prompts, workload.qps, workload.burstiness, workload.seed)
    counter = None if workload.dataset == "random" else TokenCounter.for_model(cell.model.hf_id)
    lengths = request_lengths(workload, counter)
    instances = [setup.instance(workload.seed, index) for index in range(cell.mode.instances)]
    served = serve_or_refuse(
        cell.recipe, cell.serving.max_model_len, instances[0].scheduler.pool, lengths
    )
    if cell.mode.disaggregated:
        driver: _RoundRobin | _Disaggregated = _Disaggregated(
            cell, setup, instances[0], instances[1], lengths, served
        )
        try:
            records = driver.run(sends)
        except _OrderTie:  # the pipelined run cannot order two events: run again on one queue
            instances = [setup.instance(workload.seed, index) for index in range(2)]
            driver = _Disaggregated(
                cell, setup, instances[0], instances[1], lengths, served, pipelined=False
            )
            records = driver.run(sends)
    else:
        hop = replace(
            NO_PROXY if cell.mode.instances == 1 else ProxyHop(),
            api_server_ms=setup.host.request_latency_ms,
        )
        driver = _RoundRobin(cell, instances, hop, lengths, served)
        records = driver.run(sends)
    parameters = _parameters(cell, setup, driver)
    if counter is not None:
        parameters["token_counter"] = counter.description
    if lengths.shared_prefix_tokens:
        parameters["shared_prefix_tokens"] = lengths.shared_prefix_tokens
    return SimulationResult(
        records=records,
        engine_parameters=parameters,
        kv=setup.kv,
        peak_kv_blocks=[instance.scheduler.pool.peak_used_blocks for instance in instances],
    )


def engine_setup(cell: Cell, step_time: StepTimeModel | None = None) -> EngineSetup:
    """The engine every instance of the cell runs (the emulator builds the same one from the
    vLLM flags the cell's deployment passes it)."""
    serving = cell.serving
    return build_engine_setup(
        cell.model.architecture,
        quantization=cell.model.quantization,
        tensor_parallel=cell.model.tensor_parallel,
        recipe=cell.recipe,
        chunked_prefill=cell.mode.chunked_prefill,
        max_model_len=serving.max_model_len,
        gpu_memory_utilization=serving.gpu_memory_utilization,
        gpu=cell.engine.get("gpu", DEFAULT_GPU),
        max_num_batched_tokens=serving.max_num_batched_tokens,
        max_num_seqs=serving.max_num_seqs,
        kv_offloading_gib=serving.kv_offloading_gib,
        enforce_eager=serving.enforce_eager,
        prefix_caching=serving.prefix_caching,  # as the recipes' --[no-]enable-prefix-caching
        jitter_cv=float(cell.engine.get("jitter_cv", DEFAULT_JITTER_CV)),
        straggler_probability=float(
            cell.engine.get("straggler_probability", DEFAULT_STRAGGLER_PROBABILITY)
        ),
        step_time=step_time,
        model_label=f"{cell.model.name} ({cell.model.quantization})",
    )


def _parameters(
    cell: Cell, setup: EngineSetup, driver: _RoundRobin | _Disaggregated
) -> dict[str, Any]:
    return {
        "gpu": cell.engine.get("gpu", DEFAULT_GPU),
        "tensor_parallel": cell.model.tensor_parallel,
        "quantization": cell.model.quantization,
        "step_time_model": type(setup.step_time).__name__,
        "step_time_source": setup.step_time_label,
        "step_time_fallback": setup.step_time_fallback_record,
        "enforce_eager": cell.serving.enforce_eager,
        "scheduler": asdict(setup.scheduler),
        "kv_cache": asdict(setup.kv),
        "jitter_cv": setup.jitter_cv,
        "straggler_probability": setup.straggler_probability if setup.jitter_cv else 0.0,
        **driver.parameters(),
    }


@dataclass(frozen=True)
class Served:
    """What the server makes of each request before an engine sees it, by request id: the
    ``max_tokens`` it serves (0.33 clamps to what the context leaves) and, for a request it
    does not serve, the ``error`` its client records."""

    max_tokens: list[int]
    errors: dict[int, str]


def serve_or_refuse(
    recipe: str, max_model_len: int, pool: BlockPool, lengths: RequestLengths
) -> Served:
    """Apply vLLM's refusals (`servematrix.engine.admission`) to every request.

    Only requests beyond the context or, in V0 (a pool with a watermark), with a prompt longer
    than an empty pool admits are looked at one by one: the rest pass unchanged."""
    inputs, outputs, text = lengths.input_lens, lengths.output_lens, lengths.text_prompt
    max_tokens, errors = outputs, {}
    long = []
    if max(map(operator.add, inputs, outputs)) > max_model_len:
        totals = map(operator.add, inputs, outputs)
        long = [k for k, total in enumerate(totals) if total > max_model_len]
    if long:
        max_tokens = list(outputs)
        for k in long:
            try:
                max_tokens[k] = granted_max_tokens(
                    recipe, inputs[k], outputs[k], max_model_len, bool(text and text[k])
                )
            except ContextLengthError as error:
                errors[k] = http_error(error.status, error.message)
    # V0's block manager never allocates a prompt needing more blocks than the watermark
    # leaves of the whole pool: it ignores the request, which then streams no token.
    never_tokens = (pool.num_blocks - pool.watermark_blocks) * pool.block_size
    if pool.watermark_blocks and max(inputs) > never_tokens:
        for k, prompt in enumerate(inputs):
            if prompt > never_tokens and k not in errors:
                errors[k] = f"{NO_TOKEN_ERROR}; the server logged: {kv_capacity_message(prompt)}"
    return Served(max_tokens, errors)


class _Requests:
    """Makes the engine's requests of the cell (with the shared prefix group, if any) and
    keeps them, to count each request id's preemptions at the end."""

    def __init__(self, lengths: RequestLengths, served: Served):
        self.input_lens = lengths.input_lens
        self.max_tokens = served.max_tokens
        self.refused = served.errors
        self.prefix_tokens = lengths.shared_prefix_tokens
        self.group = 0 if self.prefix_tokens else None
        self.groups = lengths.prefix_groups  # per request when there are several system prompts
        self.made: list[Request] = []

    def new(self, k: int, max_tokens: int | None = None) -> Request:
        """Request ``k`` as the client sends it (``max_tokens``: the proxy's own limit)."""
        request = Request(
            k,
            self.input_lens[k],
            self.max_tokens[k] if max_tokens is None else max_tokens,
            prefix_group=self.groups[k] if self.groups else self.group,
            prefix_tokens=self.prefix_tokens,
        )
        self.made.append(request)
        return request

    def served(self, ids: range, limit: int | None = None) -> list[Request | None]:
        """Requests ``ids`` as `new` makes them (``limit``: its ``max_tokens``), None for the
        refused ones; one comprehension, as a 100,000-request cell makes them all at once."""
        inputs, refused = self.input_lens, self.refused
        max_tokens = self.max_tokens if limit is None else [limit] * len(inputs)
        if self.group is None:  # no prefix to share: the defaults, and no keyword arguments
            made = [Request(k, inputs[k], max_tokens[k]) for k in ids]
        else:
            groups, tokens = self.groups or [self.group] * len(inputs), self.prefix_tokens
            made = [
                Request(k, inputs[k], max_tokens[k], prefix_group=groups[k], prefix_tokens=tokens)
                for k in ids
            ]
        if refused:
            made = [None if request.request_id in refused else request for request in made]
        self.made.extend(request for request in made if request is not None)
        return made

    def keep(self, request: Request) -> Request:
        self.made.append(request)
        return request

    def preemptions(self, total: int) -> list[int]:
        counts = [0] * total
        for request in self.made:
            counts[request.request_id] += request.num_preemptions
        return counts


def _records(
    workload_warmups: int,
    warmup_sends: list[float],
    sends: np.ndarray,
    sent: list[float] | None,
    chunks: list[list[float]],
    lengths: RequestLengths,
    requests: _Requests,
) -> list[RequestRecord]:
    """Client records: warm-ups first (``warmup=True``), then the measured requests.

    ``sends`` are the scheduled times of the measured requests, ``sent`` their actual send
    times when a concurrency cap delayed some (None: sent as scheduled). A refused request
    has no chunks and its error."""
    scheduled = [*warmup_sends, *sends.tolist()]
    sent_times = scheduled if sent is None else [*warmup_sends, *sent]
    errors: list[str | None] = [None] * len(scheduled)
    for k, error in requests.refused.items():
        errors[k] = error
    return [
        # Positional in field order (a third faster than keywords over 100,000 records).
        RequestRecord(
            index,  # request_id
            index < workload_warmups,  # warmup
            planned,  # scheduled_s
            actual,  # sent_s
            times[0] if times else None,  # first_token_s
            times[-1] if times else None,  # end_s
            times,  # chunk_s
            [1] * len(times),  # chunk_tokens
            input_len,  # prompt_tokens
            len(times),  # completion_tokens
            error is None,  # success
            error,
            request_input_len=input_len,
            request_output_len=output_len,
            preemptions=preempted,
        )
        for index, (planned, actual, times, input_len, output_len, error, preempted) in enumerate(
            zip(
                scheduled,
                sent_times,
                chunks,
                lengths.input_lens,
                lengths.output_lens,
                errors,
                requests.preemptions(len(scheduled)),
                strict=True,
            )
        )
    ]


def _capped(cap: int | None, num_prompts: int) -> bool:
    """Whether a concurrency cap can hold a request back (a cap of N or more never does)."""
    return cap is not None and cap < num_prompts


def round_robin_targets(num_requests: int, num_instances: int) -> list[int]:
    """Instance of each request in send order (warm-ups first): ``itertools.cycle`` over the
    instances, as ``round_robin_proxy.py`` does, so the first warm-up takes the first slot."""
    return [k % num_instances for k in range(num_requests)]


class _RoundRobin:
    """One or more independent instances; request k goes to instance k mod n."""

    def __init__(
        self,
        cell: Cell,
        instances: list[EngineInstance],
        hop: ProxyHop,
        lengths: RequestLengths,
        served: Served,
    ):
        self.cell = cell
        self.instances = instances
        self.hop = hop
        self.lengths = lengths
        self.requests = _Requests(lengths, served)

    def parameters(self) -> dict[str, Any]:
        return {
            "topology": "round-robin" if len(self.instances) > 1 else "single",
            "proxy_hop": asdict(self.hop),
        }

    def run(self, sends: np.ndarray) -> list[RequestRecord]:
        w = self.cell.workload
        n_inst = len(self.instances)
        total = w.warmup_requests + w.num_prompts
        chunks: list[list[float]] = [[] for _ in range(total)]
        hop_in = (self.hop.request_ms + self.hop.api_server_ms) * 1e-3
        hop_out = self.hop.chunk_ms * 1e-3
        # Warm-ups: one at a time, each sent when the previous one has completed.
        targets = round_robin_targets(total, n_inst)
        make, refused = self.requests.new, self.requests.refused
        clock = 0.0
        warm_sends = []
        for k in range(w.warmup_requests):
            warm_sends.append(clock)
            if k in refused:  # the error answer comes straight back
                clock += hop_in + hop_out
                continue
            _run_instance(self.instances[targets[k]], [(clock + hop_in, make(k))], chunks, hop_out)
            clock = chunks[k][-1]
        warm_sends = [t - clock for t in warm_sends]
        for k in range(w.warmup_requests):
            chunks[k] = [t - clock for t in chunks[k]]
        measured = self.requests.served(range(w.warmup_requests, total))
        if _capped(w.max_concurrency, w.num_prompts):
            requests = list(zip(targets[w.warmup_requests :], measured, strict=True))
            sent = _run_capped(
                self.instances, requests, sends.tolist(), w.max_concurrency, chunks, hop_in, hop_out
            )
            return _records(
                w.warmup_requests, warm_sends, sends, sent, chunks, self.lengths, self.requests
            )
        per_instance: list[list[tuple[float, Request]]] = [[] for _ in range(n_inst)]
        for k, sent_s, request in zip(
            range(w.warmup_requests, total), sends.tolist(), measured, strict=True
        ):
            if request is not None:
                per_instance[targets[k]].append((sent_s + hop_in, request))
        for instance, arrivals in zip(self.instances, per_instance, strict=True):
            _run_instance(instance, arrivals, chunks, hop_out)
        return _records(
            w.warmup_requests, warm_sends, sends, None, chunks, self.lengths, self.requests
        )


def _run_instance(
    instance: EngineInstance,
    arrivals: list[tuple[float, Request]],
    chunks: list[list[float]],
    hop_out_s: float,
) -> None:
    """Drive one instance through its arrivals (sorted by time) until it has no work left."""
    clock = arrivals[0][0] if arrivals else 0.0
    n = len(arrivals)
    arrival_at = [t for t, _ in arrivals] + [inf]  # sentinel: no more arrivals
    has_work = instance.has_work
    i = 0
    while True:
        if not has_work():
            if i == n:
                break
            if arrival_at[i] > clock:
                clock = arrival_at[i]
        while arrival_at[i] <= clock:
            instance.add_request(arrivals[i][1], (clock - arrival_at[i]) * 1e3)
            i += 1
        run = instance.decode_run(arrival_at[i] - clock)
        if run is not None:
            ends = [clock + hop_out_s + end for end in run.step_ends_s]
            for request in run.requests:
                chunks[request.request_id].extend(ends)
            clock += run.step_ends_s[-1]
            continue
        result = instance.step()
        clock += result.duration_s
        seen = clock + hop_out_s
        for request in result.emitted:
            chunks[request.request_id].append(seen)


_ARRIVE, _STEP_DONE, _SLOT_FREE = range(3)  # events of `_run_capped`


def _run_capped(
    instances: list[EngineInstance],
    requests: list[tuple[int, Request | None]],
    scheduled: list[float],
    cap: int,
    chunks: list[list[float]],
    hop_in_s: float,
    hop_out_s: float,
) -> list[float]:
    """Independent instances behind a client that keeps at most ``cap`` requests in flight.

    ``requests`` are (instance, request) in schedule order, request None for one the server
    refuses (its slot frees when the error answer is back). Request k is sent at
    max(``scheduled[k]``, the moment a slot frees), in order, so it can be queued as soon as
    its slot is known. Returns the send times. Events at one time are all applied before any
    idle instance starts a step, as `_run_instance` adds every arrival up to its clock."""
    n = len(requests)
    sent = [0.0] * n
    events: list[tuple[float, int, int, Any]] = []
    seq = 0
    busy = [False] * len(instances)
    busy_until = [0.0] * len(instances)  # when a busy instance's step (or run) ends
    free, k, now = cap, 0, 0.0
    # Least time from an event of each kind to an arrival at some instance: a decode run may
    # go on until the earliest of them.
    leads = {_ARRIVE: 0.0, _SLOT_FREE: hop_in_s, _STEP_DONE: hop_out_s + hop_in_s}
    while True:
        while free and k < n:  # the client sends while it holds a free slot
            sent[k] = max(scheduled[k], now)
            heapq.heappush(events, (sent[k] + hop_in_s, seq, _ARRIVE, requests[k]))
            seq += 1
            free -= 1
            k += 1
        if not events or events[0][0] > now:
            # Everything due by now is applied: idle instances with work start.
            for index, instance in enumerate(instances):
                if busy[index] or not instance.has_work():
                    continue
                horizon = min((t + leads[kind] for t, _, kind, _ in events), default=inf)
                run = instance.decode_run(horizon - now)
                if run is not None:
                    done_at, payload = now + run.step_ends_s[-1], (now, run)
                else:
                    result = instance.step()
                    done_at, payload = now + result.duration_s, (now, result)
                heapq.heappush(events, (done_at, seq, _STEP_DONE, (index, payload)))
                seq += 1
                busy[index], busy_until[index] = True, done_at
            if not events:
                return sent
            now = events[0][0]
        while events and events[0][0] <= now:
            _, _, kind, payload = heapq.heappop(events)
            if kind == _ARRIVE:
                index, request = payload
                if request is None:
                    heapq.heappush(events, (now + hop_out_s, seq, _SLOT_FREE, None))
                    seq += 1
                else:
                    waited_ms = (busy_until[index] - now) * 1e3 if busy[index] else 0.0
                    instances[index].add_request(request, waited_ms)
            elif kind == _SLOT_FREE:
                free += 1
            else:
                index, (started, result) = payload
                busy[index] = False
                if isinstance(result, DecodeRun):
                    ends = [started + hop_out_s + end for end in result.step_ends_s]
                    for request in result.requests:
                        chunks[request.request_id].extend(ends)
                else:
                    seen = now + hop_out_s
                    for request in result.emitted:
                        chunks[request.request_id].append(seen)
                for request in result.finished:
                    done = chunks[request.request_id][-1]
                    heapq.heappush(events, (done, seq, _SLOT_FREE, None))
                    seq += 1


(
    _ARRIVE_PREFILL,
    _PREFILL_DONE,
    _ARRIVE_DECODE,
    _ARRIVE_TRANSFER,
    _LINK,
    _DECODE_DONE,
    _RECEIVE_DONE,
    _SLOT_FREED,
) = range(8)


class _ReceiveStep:
    """A V0 decoder step that receives KV, in flight. Its work, in order: per received request
    the producer's share of the copy chain (*gated*: it advances only while the producer's
    engine is between steps, ``V0_PRODUCER_CHAIN_SHARE``) and the rest of that receive, then
    the step's compute. Its end moves when the producer starts or ends a step; ``version``
    tells the live completion event from superseded ones."""

    def __init__(
        self,
        started: float,
        result: StepResult,
        receives: list[tuple[float, float]],
        released_bytes: float,
    ):
        """``receives``: (receive seconds, producer's share) of each received request;
        ``released_bytes``: what their entries held in the producer's buffer."""
        self.started = started
        self.result = result
        self.released_bytes = released_bytes
        self.segments: list[list[Any]] = []  # [gated, seconds left], in order
        for receive_s, producer_s in receives:
            self.segments += [[True, producer_s], [False, receive_s - producer_s]]
        # fsum: exactly n * receive_s when the receives are equal (a fixed-length workload).
        receiving_s = math.fsum(receive_s for receive_s, _ in receives)
        self.segments.append([False, result.duration_s - receiving_s])
        self.clock = started
        self.version = 0

    def advance(self, now: float, producer_busy: bool) -> None:
        """Do the work possible from the step's clock to ``now`` (the producer's state was
        ``producer_busy`` all that time)."""
        elapsed = now - self.clock
        self.clock = now
        segments = self.segments
        while segments and elapsed > 0.0:
            gated, left = segments[0]
            if gated and producer_busy:
                return
            if left > elapsed:
                segments[0][1] = left - elapsed
                return
            elapsed -= left
            segments.pop(0)

    def end_s(self, producer_busy: bool) -> float:
        """When the step ends if the producer stays as it is (inf: it waits for the producer)."""
        if producer_busy and any(gated for gated, _ in self.segments):
            return inf
        return self.clock + sum(left for _, left in self.segments)


@dataclass
class _Upstream:
    """What `_Disaggregated._run_upstream` recorded: arrival times at the prefill instance
    (sorted, ending with inf), the prefill steps (start, end), the batches sent to the decoder
    and the link's events (time queued, time due), and the requests joining the decoder (time,
    request ids) in event order."""

    arrivals: list[float]
    steps: list[tuple[float, float]] = field(default_factory=list)
    transfers: list[tuple[float, float]] = field(default_factory=list)
    link_events: list[tuple[float, float]] = field(default_factory=list)
    joins: list[tuple[float, list[int]]] = field(default_factory=list)

    def times(self) -> set[float]:
        """Every time an upstream event happened (events are also queued at such times)."""
        return {
            *self.arrivals,
            *(end for _, end in self.steps),
            *(due for _, due in self.transfers),
            *(due for _, due in self.link_events),
        }

    def horizon(self, to_decoder_s: float, link_min_s: float) -> Callable[[float], float]:
        """``_decode_horizon`` as a function of the time (non-decreasing from call to call, and
        never an upstream event's time): the prefill instance's next step end, or its next
        arrival while it is idle, plus ``to_decoder_s``; the first batch on its way to the
        decoder's arrival plus ``link_min_s``; the link's earliest queued event."""
        arrivals, steps, transfers, link_events = (
            self.arrivals,
            self.steps,
            self.transfers,
            self.link_events,
        )
        n_steps, n_transfers, n_link = len(steps), len(transfers), len(link_events)
        queued: list[float] = []  # due times of the link events queued (and some already past)
        at = [0, 0, 0, 0]  # next step, arrival, transfer, link event to look at

        def horizon(now: float) -> float:
            p, a, q, k = at
            while p < n_steps and steps[p][1] < now:
                p += 1
            if p < n_steps and steps[p][0] < now:  # busy: its completion event is queued
                value = steps[p][1] + to_decoder_s
            else:
                while arrivals[a] < now:
                    a += 1
                value = arrivals[a] + to_decoder_s
            while q < n_transfers and transfers[q][1] < now:
                q += 1
            if q < n_transfers and transfers[q][0] < now and transfers[q][1] + link_min_s < value:
                value = transfers[q][1] + link_min_s
            while k < n_link and link_events[k][0] < now:
                heapq.heappush(queued, link_events[k][1])
                k += 1
            while queued and queued[0] < now:
                heapq.heappop(queued)
            if queued and queued[0] < value:
                value = queued[0]
            at[:] = p, a, q, k
            return value

        return horizon


class _OrderTie(Exception):
    """A pipelined run met a decoder event at the very time of an upstream event: their order
    on one queue decides what happens, so the cell is simulated again on one queue."""


class _Disaggregated:
    """Prefill instance → proxy → (KV transfer) → decode instance, on one event queue.

    ``pipelined`` (V1 without a concurrency cap): nothing flows back from the decoder, so the
    measured requests run in two passes with the same result: the prefill instance and the
    link on the event queue (`_run_upstream`), recording when requests join the decoder and
    what the queue holds; then the decoder alone (`_run_decoder`), its decode runs bounded by
    the horizon the recorded queue gives. A decoder event at the exact time of an upstream
    event raises `_OrderTie` (their order would have decided which came first)."""

    def __init__(
        self,
        cell: Cell,
        setup: EngineSetup,
        prefill: EngineInstance,
        decode: EngineInstance,
        lengths: RequestLengths,
        served: Served,
        pipelined: bool = True,
    ):
        self.cell = cell
        self.pipelined = pipelined and cell.recipe == "v1"
        self.lengths = lengths
        self.requests = _Requests(lengths, served)
        self._refused = served.errors
        self.prefill = prefill
        self.decode = decode
        self.hop = ProxyHop(api_server_ms=setup.host.request_latency_ms)
        self.generation = cell.recipe
        tp = cell.model.tensor_parallel
        self.link_config = kv_link(
            cell.recipe, cell.mode.kv_protocol or "rdma", tp, cell.engine.get("kv_link")
        )
        self.link = TransferLink(
            self.link_config.wire_bytes_per_s, self.link_config.setup_ms * 1e-3
        )
        arch = setup.arch
        # Per TP rank: its KV heads' share (replicated below one head per rank) plus the last
        # hidden state, which V0 sends from every rank.
        hidden = arch.hidden_size * 2 if cell.recipe == "v0" else 0
        self.bytes_per_token_per_rank = kv_bytes_per_token_per_gpu(arch, tp) + hidden
        self.bytes_per_prompt_token = self.bytes_per_token_per_rank * tp
        self.buffer = LookupBuffer(float(cell.engine.get("kv_buffer_size", V0_KV_BUFFER_BYTES)))
        self._inserting: list[int] = []  # prefill batch whose inserts wait for buffer room
        self._inserted = 0
        self._prefill_blocked = False
        self.prefill_stall_s = 0.0
        self._blocked_since = 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._prefill_busy = False
        self._prefill_until = 0.0  # when the prefill instance's step ends, while it is busy
        self._decode_busy = False
        self._link_event_at = inf
        # 1-token response + new request through the decode instance's API server, its serial
        # input work included (the request reaches that engine with its KV, past its queue)
        to_decoder_ms = 2 * self.hop.request_ms + self.hop.api_server_ms + setup.host.request_ms
        self._decode_hop_s = to_decoder_ms * 1e-3
        self._chunk_hop_s = self.hop.chunk_ms * 1e-3
        self._hop_in_s = (self.hop.request_ms + self.hop.api_server_ms) * 1e-3
        # Per-request sizes and V0 receive times, indexed by request id (computed once per
        # distinct prompt length).
        self._input_lens, self._output_lens = lengths.input_lens, served.max_tokens
        per_length = {
            length: self._kv_of(length) for length in {cell.workload.input_len, *self._input_lens}
        }
        kv = [per_length[length] for length in self._input_lens]
        self._transfer_bytes, self._buffer_entry_bytes, self._v0_receive_s, self._v0_producer_s = (
            [row[i] for row in kv] for i in range(4)
        )
        self._nominal_kv = per_length[cell.workload.input_len]
        self._awaiting_receive: set[int] = set()  # V0: at the decoder, KV not yet received
        self._receive: _ReceiveStep | None = None  # the decoder's V0 receive step in flight
        # V0 receives inside the decoder's step; V1 adds a transfer at least this long.
        shortest = min(self._input_lens)
        self._link_min_s = (
            0.0 if cell.recipe == "v0" else self.link.duration_alone_s(per_length[shortest][0])
        )
        # The simulated client's concurrency cap (`_run_capped` explains the semantics).
        self._free_slots = 0
        self._next_send = 0
        self._scheduled: list[float] = []
        self._sent: list[float] = []
        # Least time from an event of each kind to a request joining the decoder.
        self._event_leads = {
            _ARRIVE_PREFILL: self._decode_hop_s + self._link_min_s,
            _SLOT_FREED: self._hop_in_s + self._decode_hop_s + self._link_min_s,
            _PREFILL_DONE: self._decode_hop_s + self._link_min_s,
            _ARRIVE_DECODE: self._link_min_s,
            _ARRIVE_TRANSFER: self._link_min_s,
            _LINK: 0.0,
            _DECODE_DONE: 0.0,
            _RECEIVE_DONE: 0.0,
        }
        self._handlers = {
            _ARRIVE_PREFILL: self._on_arrive_prefill,
            _PREFILL_DONE: self._on_prefill_done,
            _ARRIVE_DECODE: self._on_arrive_decode,
            _ARRIVE_TRANSFER: self._on_arrive_transfer,
            _LINK: self._on_link,
            _DECODE_DONE: self._on_decode_done,
            _RECEIVE_DONE: self._on_receive_done,
            _SLOT_FREED: self._on_slot_freed,
        }

    def _kv_of(self, input_len: int) -> tuple[float, float, float, float]:
        """A prompt's KV: bytes moved in all, bytes per rank (a V0 buffer entry), and the V0
        receive time with the producer's share of it."""
        entry = self.bytes_per_token_per_rank * input_len
        return (
            self.bytes_per_prompt_token * input_len,
            entry,
            self.link_config.v0_receive_s(entry),
            self.link_config.v0_producer_s(entry),
        )

    def parameters(self) -> dict[str, Any]:
        params = {
            "topology": f"disaggregated-{self.generation}",
            "proxy_hop": asdict(self.hop),
            "kv_link": asdict(self.link_config),
            "kv_bytes_per_prompt_token": self.bytes_per_prompt_token,
            "kv_bytes_per_token_per_rank": self.bytes_per_token_per_rank,
        }
        if self.generation == "v0":
            params["kv_buffer_size"] = self.buffer.capacity_bytes
            # For a prompt of the workload's input_len.
            params["v0_receive_ms"] = self._nominal_kv[2] * 1e3
            params["v0_producer_share_ms"] = self._nominal_kv[3] * 1e3
            params["prefill_buffer_stall_s"] = self.prefill_stall_s
        return params

    def run(self, sends: np.ndarray) -> list[RequestRecord]:
        w = self.cell.workload
        total = w.warmup_requests + w.num_prompts
        self.chunks: list[list[float]] = [[] for _ in range(total)]
        clock = 0.0
        warm_sends = []
        for k in range(w.warmup_requests):
            warm_sends.append(clock)
            self._run([(clock, k)])
            # A refused request's error answer comes straight back.
            clock = self.chunks[k][-1] if self.chunks[k] else clock + 2 * self._hop_in_s
        warm_sends = [t - clock for t in warm_sends]
        for k in range(w.warmup_requests):
            self.chunks[k] = [t - clock for t in self.chunks[k]]
        scheduled = sends.tolist()
        if not _capped(w.max_concurrency, w.num_prompts):
            measured = [(sent, w.warmup_requests + i) for i, sent in enumerate(scheduled)]
            if self.pipelined:
                self._run_decoder(self._run_upstream(measured))
            else:
                self._run(measured)
            return _records(
                w.warmup_requests, warm_sends, sends, None, self.chunks, self.lengths, self.requests
            )
        self._scheduled, self._sent = scheduled, [0.0] * w.num_prompts
        self._free_slots, self._next_send = 0, w.max_concurrency
        self._sent[: w.max_concurrency] = scheduled[: w.max_concurrency]
        first = scheduled[: w.max_concurrency]
        self._run([(sent, w.warmup_requests + i) for i, sent in enumerate(first)])
        return _records(
            w.warmup_requests,
            warm_sends,
            sends,
            self._sent,
            self.chunks,
            self.lengths,
            self.requests,
        )

    def _push(self, time: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (time, self._seq, kind, payload))
        self._seq += 1

    def _run(self, sends: list[tuple[float, int]]) -> None:
        """Process ``sends`` (time, request index) and every event they cause.

        Arrivals are not queued: they are sorted up front and merged with the event queue. They
        win ties, as they would on one queue where they had been pushed before every other
        event (the queue is empty when a run starts)."""
        hop_in = self._hop_in_s
        arrivals = sorted((sent + hop_in, k) for sent, k in sends)
        last = len(arrivals)
        arrivals.append((inf, -1))  # sentinel: no more arrivals
        events, handlers = self._events, self._handlers
        prefill, decode = self.prefill, self.decode
        i = 0
        while True:
            arrival_at = arrivals[i][0]
            if arrival_at <= (events[0][0] if events else inf):
                if arrival_at == inf:
                    break
                now = arrival_at
                self._on_arrive_prefill(now, arrivals[i][1])
                i += 1
                if self._prefill_busy or self._prefill_blocked:
                    # Nothing else can start: take the arrivals up to the next event at once.
                    until = events[0][0] if events else inf
                    while i < last and arrivals[i][0] <= until:
                        self._on_arrive_prefill(arrivals[i][0], arrivals[i][1])
                        i += 1
            else:
                now, _, kind, payload = heapq.heappop(events)
                handlers[kind](now, payload)
            if not (self._prefill_blocked or self._prefill_busy) and prefill.has_work():
                next_event = arrivals[i][0]
                if events and events[0][0] < next_event:
                    next_event = events[0][0]
                self._prefill_until = self._start(prefill, _PREFILL_DONE, now, next_event)
                self._set_prefill_busy(now, True)
            if not self._decode_busy and decode.has_work():
                # A waiting request rules out a decode run: no horizon needed then.
                waiting = decode.scheduler.waiting
                horizon = now if waiting else self._decode_horizon(arrivals[i][0])
                self._start(decode, _DECODE_DONE, now, horizon)
                self._decode_busy = True
        if self._inserting:
            raise RuntimeError(
                f"the v0 producer's KV buffer (kv_buffer_size {self.buffer.capacity_bytes:.3g} "
                "bytes per rank) cannot hold one prefill batch: its inserts wait for a consumer "
                "that never receives the batch, and vLLM would hang the same way"
            )

    def _run_upstream(self, sends: list[tuple[float, int]]) -> _Upstream:
        """`_run` without the decoder (V1, no concurrency cap): the prefill instance and the
        link on the event queue. Returns when requests would join the decoder and what the
        queue held, for `_run_decoder`."""
        hop_in, decode_hop = self._hop_in_s, self._decode_hop_s
        arrivals = sorted((sent + hop_in, k) for sent, k in sends)
        last = len(arrivals)
        arrivals.append((inf, -1))  # sentinel: no more arrivals
        up = _Upstream([t for t, _ in arrivals])
        steps, transfers, link_events, joins = up.steps, up.transfers, up.link_events, up.joins
        events, prefill, link = self._events, self.prefill, self.link
        transfer_bytes = self._transfer_bytes
        # The proxy's max_tokens=1 copies (as _on_arrive_prefill makes them), made at once.
        first = min(k for _, k in sends) if sends else 0
        copies = self.requests.served(range(first, first + len(sends)), 1)
        add = prefill.add_request

        def on_arrive(now: float, request_id: int) -> None:
            request = copies[request_id - first]
            if request is not None:  # a refused one reaches no engine
                add(request, (self._prefill_until - now) * 1e3 if self._prefill_busy else 0.0)

        i = 0
        while True:
            arrival_at = arrivals[i][0]
            if arrival_at <= (events[0][0] if events else inf):
                if arrival_at == inf:
                    break
                now = arrival_at
                on_arrive(now, arrivals[i][1])
                i += 1
                if self._prefill_busy:
                    # Nothing else can start: take the arrivals up to the next event at once.
                    until = events[0][0] if events else inf
                    while i < last and arrivals[i][0] <= until:
                        on_arrive(arrivals[i][0], arrivals[i][1])
                        i += 1
            else:
                now, _, kind, payload = heapq.heappop(events)
                if kind == _PREFILL_DONE:  # as _on_prefill_done, recorded
                    self._prefill_busy = False
                    steps.append((payload[0], now))
                    finished = [request.request_id for request in payload[1].finished]
                    if finished:
                        self._push(now + decode_hop, _ARRIVE_TRANSFER, finished)
                        transfers.append((now, now + decode_hop))
                else:
                    if kind == _ARRIVE_TRANSFER:  # as _on_arrive_transfer
                        for request_id in payload:
                            link.start(now, request_id, transfer_bytes[request_id])
                    else:  # _LINK, as _on_link with the decoder's part recorded
                        self._link_event_at = inf
                        done = [request_id for _, request_id in link.advance(now)]
                        if done:
                            joins.append((now, done))
                    nxt = link.next_event_s()  # as _schedule_link, recorded
                    if nxt < self._link_event_at:
                        self._link_event_at = nxt
                        self._push(nxt, _LINK, None)
                        link_events.append((now, nxt))
            if not self._prefill_busy and prefill.has_work():
                # As _start: a prefill instance never has a decode run (its requests finish
                # with their first token) nor receives KV.
                result = prefill.step()
                self._push(now + result.duration_s, _PREFILL_DONE, (now, result))
                self._prefill_busy, self._prefill_until = True, now + result.duration_s
        return up

    def _run_decoder(self, up: _Upstream) -> None:
        """The decoder after `_run_upstream`: requests join at the recorded times, and a decode
        run may go on until the horizon `_decode_horizon` would give on the full queue."""
        decode, chunks, hop = self.decode, self.chunks, self._chunk_hop_s
        waiting, add, made = decode.scheduler.waiting, decode.add_request, self.requests.made
        input_lens, output_lens = self._input_lens, self._output_lens
        upstream_times = up.times()
        horizon_at = up.horizon(self._event_leads[_PREFILL_DONE], self._link_min_s)
        joins = up.joins
        joins.append((inf, []))  # sentinel
        j = 0
        done_at, started = inf, 0.0  # done_at inf: the decoder is idle
        result: StepResult | DecodeRun | None = None
        while True:
            join_at = joins[j][0]
            if join_at <= done_at:
                if join_at == inf:
                    break
                if join_at == done_at:
                    raise _OrderTie
                now = join_at
                for request_id in joins[j][1]:
                    # All prompt KV is present; the decoder recomputes the last prompt token to
                    # sample the first output token (as _on_link).
                    input_len = input_lens[request_id]
                    request = Request(request_id, input_len, output_lens[request_id], input_len - 1)
                    made.append(request)
                    add(request)
                j += 1
                if done_at < inf:
                    continue  # busy: they wait for the next step
            else:
                now = done_at
                if now in upstream_times:
                    raise _OrderTie
                if isinstance(result, DecodeRun):
                    ends = [started + hop + end for end in result.step_ends_s]
                    for request in result.requests:
                        chunks[request.request_id].extend(ends)
                else:
                    assert result is not None
                    for request in result.emitted:
                        chunks[request.request_id].append(now + hop)
                done_at = inf
                if not decode.has_work():
                    continue
            started = now
            run = None if waiting else decode.decode_run(horizon_at(now) - now)
            if run is not None:
                result, done_at = run, now + run.step_ends_s[-1]
            else:
                result = decode.step()
                done_at = now + result.duration_s

    def _start(
        self, instance: EngineInstance, done_kind: int, now: float, next_event: float
    ) -> float:
        """Start an idle instance that has work: a run of pure decodes up to the next event
        (which could change its batch) when it can, else one step; queue its completion and
        return its time (inf for a V0 receive, whose end depends on the producer)."""
        run = instance.decode_run(next_event - now)
        if run is not None:
            self._push(now + run.step_ends_s[-1], done_kind, (now, run))
            return now + run.step_ends_s[-1]
        result = instance.step()
        if result.num_received:
            awaiting = self._awaiting_receive
            received = [r.request_id for r in result.emitted if r.request_id in awaiting]
            if len(received) != result.num_received:
                raise RuntimeError(
                    f"the decoder received {result.num_received} prompts' KV in one step "
                    f"but {len(received)} of them emitted a token"
                )
            awaiting.difference_update(received)
            receive_s, producer_s = self._v0_receive_s, self._v0_producer_s
            receives = [(receive_s[k], producer_s[k]) for k in received]
            entry = self._buffer_entry_bytes
            released = math.fsum(entry[k] for k in received)
            self._receive = _ReceiveStep(now, result, receives, released)
            self._schedule_receive()
            return inf
        self._push(now + result.duration_s, done_kind, (now, result))
        return now + result.duration_s

    def _set_prefill_busy(self, now: float, busy: bool) -> None:
        """The producer starts or ends a step: a receive in flight does its work up to now
        under the old state, and its end is queued again under the new one."""
        receive = self._receive
        if receive is not None:
            receive.advance(now, self._prefill_busy)
        self._prefill_busy = busy
        if receive is not None:
            self._schedule_receive()

    def _schedule_receive(self) -> None:
        receive = self._receive
        assert receive is not None
        receive.version += 1
        end = receive.end_s(self._prefill_busy)
        if end < inf:
            self._push(end, _RECEIVE_DONE, receive.version)

    def _on_receive_done(self, now: float, version: int) -> None:
        receive = self._receive
        if receive is None or version != receive.version:
            return  # superseded: the producer started or ended a step since it was queued
        self._receive = None
        self._on_decode_done(now, (receive.started, receive.result))
        # drop_select removed the entries from the producer's buffer.
        self.buffer.release(receive.released_bytes)
        if self._prefill_blocked:
            self._insert(now)

    def _decode_horizon(self, next_arrival: float) -> float:
        """Earliest time an event could change the decode batch: a decode run may go on until
        then. Only a request joining the decoder changes its batch; prefill-side events lead
        to one no sooner than the proxy hop (and, in V1, a transfer with the link to itself)
        later, so a decode run need not stop at each of them. An arrival counts only while
        the prefill instance is idle: while it is busy, its completion event bounds them all.
        The decoder's steps are the same either way; only the runs that sum them differ."""
        to_decoder = self._decode_hop_s + self._link_min_s
        horizon = inf if self._prefill_busy else next_arrival + to_decoder
        leads = self._event_leads
        for time, _, kind, _ in self._events:
            if time + leads[kind] < horizon:
                horizon = time + leads[kind]
        return horizon

    def _insert(self, now: float) -> None:
        """V0 producer: put the finished prefill batch's KV into the lookup buffer; the batch's
        responses leave (and the instance may step again) only when every insert succeeded."""
        entries = self._buffer_entry_bytes
        while self._inserted < len(self._inserting):
            if not self.buffer.try_insert(entries[self._inserting[self._inserted]]):
                if not self._prefill_blocked:
                    self._prefill_blocked = True
                    self._blocked_since = now
                return
            self._inserted += 1
        if self._prefill_blocked:
            self.prefill_stall_s += now - self._blocked_since
            self._prefill_blocked = False
        for request_id in self._inserting:
            # The proxy drains the 1-token response, then sends the request to the decoder.
            self._push(now + self._decode_hop_s, _ARRIVE_DECODE, request_id)
        self._inserting, self._inserted = [], 0

    def _on_arrive_prefill(self, now: float, request_id: int) -> None:
        if request_id in self._refused:
            # Refused (the error text says what the client saw): nothing reaches an engine.
            if self._sent:  # a concurrency cap: the slot frees when the answer is back
                self._push(now + self._hop_in_s, _SLOT_FREED, None)
            return
        waited_ms = (self._prefill_until - now) * 1e3 if self._prefill_busy else 0.0
        self.prefill.add_request(self.requests.new(request_id, 1), waited_ms)

    def _on_prefill_done(self, now: float, payload: tuple[float, StepResult]) -> None:
        self._set_prefill_busy(now, False)
        _, result = payload
        finished = [request.request_id for request in result.finished]
        if self.generation == "v0":
            self._inserting.extend(finished)
            self._insert(now)
        elif finished:
            self._push(now + self._decode_hop_s, _ARRIVE_TRANSFER, finished)

    def _on_arrive_decode(self, now: float, request_id: int) -> None:
        """V0: the request reaches the decoder, which receives its KV in its next step."""
        self._awaiting_receive.add(request_id)
        self.decode.add_request(
            self.requests.keep(
                Request(
                    request_id,
                    self._input_lens[request_id],
                    self._output_lens[request_id],
                    receive_ms=self._v0_receive_s[request_id] * 1e3,
                )
            )
        )

    def _on_arrive_transfer(self, now: float, request_ids: list[int]) -> None:
        """V1: a prefill batch's requests reach the decoder, which starts pulling their KV.

        One event for the batch: events at one time run back to back, and starting a
        transfer changes neither instance, so nothing could happen between them."""
        transfer_bytes = self._transfer_bytes
        for request_id in request_ids:
            self.link.start(now, request_id, transfer_bytes[request_id])
        self._schedule_link()

    def _on_link(self, now: float, payload: None) -> None:
        self._link_event_at = inf
        input_lens, output_lens = self._input_lens, self._output_lens
        for _, request_id in self.link.advance(now):
            # All prompt KV is present; the decoder recomputes the last prompt token to
            # sample the first output token.
            input_len = input_lens[request_id]
            self.decode.add_request(
                self.requests.keep(
                    Request(
                        request_id, input_len, output_lens[request_id], num_computed=input_len - 1
                    )
                )
            )
        self._schedule_link()

    def _on_decode_done(self, now: float, payload: tuple[float, StepResult | DecodeRun]) -> None:
        self._decode_busy = False
        started, result = payload
        hop = self._chunk_hop_s
        chunks = self.chunks
        if isinstance(result, DecodeRun):
            ends = [started + hop + end for end in result.step_ends_s]
            for request in result.requests:
                chunks[request.request_id].extend(ends)
        else:
            for request in result.emitted:
                chunks[request.request_id].append(now + hop)
        if self._sent:  # a concurrency cap: a slot frees when the last chunk reaches the client
            for request in result.finished:
                self._push(chunks[request.request_id][-1], _SLOT_FREED, None)

    def _on_slot_freed(self, now: float, payload: None) -> None:
        """The simulated client sends the next requests its free slots allow, in order, each
        at max(its scheduled time, now)."""
        self._free_slots += 1
        first = self.cell.workload.warmup_requests
        while self._free_slots and self._next_send < len(self._scheduled):
            k = self._next_send
            self._sent[k] = sent = max(self._scheduled[k], now)
            self._push(sent + self._hop_in_s, _ARRIVE_PREFILL, first + k)
            self._free_slots -= 1
            self._next_send += 1

    def _schedule_link(self) -> None:
        nxt = self.link.next_event_s()
        if nxt < self._link_event_at:
            self._link_event_at = nxt
            self._push(nxt, _LINK, None)
