"""The disaggregated driver: prefill instances → proxy → KV transfer → decode instances.

The proxy picks a prefill and a decode instance per request, round-robin over each side (as
vLLM's disaggregated proxies do with their lists of prefillers and decoders). It sends a
``max_tokens=1`` copy of each request to the prefill instance and waits for it, then sends the
request to the decode instance. With the ``v0`` recipe (one of each) the decode instance
receives the KV inside its forward pass (`servematrix.simulate.v0`); with ``v1`` the KV moves
asynchronously over the decode instance's link, which its concurrent transfers share, and the
request joins its decode batch when it has arrived (`servematrix.simulate.v1`, which also runs
the pipelined passes)."""

from __future__ import annotations

import heapq
from dataclasses import asdict
from math import inf
from typing import Any

import numpy as np

from servematrix.engine.instance import DecodeRun, EngineInstance, StepResult
from servematrix.engine.setup import EngineSetup
from servematrix.engine.transfer import (
    V0_KV_BUFFER_BYTES,
    LookupBuffer,
    ProxyHop,
    TransferLink,
    kv_bytes_per_token_per_rank,
    kv_link,
)
from servematrix.recipes import recipe_version
from servematrix.simulate.events import (
    ARRIVE,
    ARRIVE_DECODE,
    ARRIVE_TRANSFER,
    DECODE_DONE,
    LINK,
    PREFILL_DONE,
    RECEIVE_DONE,
    SLOT_FREED,
    ClientSlots,
    EventQueue,
)
from servematrix.simulate.requests import (
    Requests,
    Served,
    capped,
    emit_chunks,
    records,
    warm_up,
)
from servematrix.simulate.v0 import ReceiveStep, V0Handoff
from servematrix.simulate.v1 import UpstreamRecording, V1Handoff
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord
from servematrix.workload import RequestLengths


class Disaggregated(V0Handoff, V1Handoff):
    """Prefill instances → proxy → (KV transfer) → decode instances, on one event queue.

    ``pipelined`` (V1 without a concurrency cap) runs the measured requests in the two passes
    of `servematrix.simulate.v1`, with the same result; False runs them on the one queue.
    V0 (one producer, one consumer in vLLM 0.6) takes one instance per side."""

    def __init__(
        self,
        cell: Cell,
        setup: EngineSetup,
        prefills: list[EngineInstance],
        decodes: list[EngineInstance],
        lengths: RequestLengths,
        served: Served,
        pipelined: bool = True,
    ):
        self.lookup_buffer = recipe_version(cell.recipe).kv.lookup_buffer
        """V0's handoff (`servematrix.simulate.v0`): the decoder pulls the KV inside its step
        from the producer's lookup buffer; else V1's (`servematrix.simulate.v1`)."""
        if self.lookup_buffer and (len(prefills), len(decodes)) != (1, 1):
            raise ValueError(
                f"the {cell.recipe} Mooncake integration runs one prefill and one decode instance"
            )
        self.cell = cell
        self.pipelined = pipelined and not self.lookup_buffer
        self.lengths = lengths
        self.requests = Requests(lengths, served)
        self.prefills, self.decodes = prefills, decodes
        self.events = EventQueue()
        self.recording: UpstreamRecording | None = None
        """Set while the upstream pass of a pipelined run records (no decoder then)."""
        self.slots: ClientSlots | None = None
        """The simulated client's concurrency cap, if it can hold a request back."""
        self._prefill_busy = [False] * len(prefills)
        self._decode_busy = [False] * len(decodes)
        self._prefill_until = [0.0] * len(prefills)  # when a prefill step ends, while busy
        self._link_event_at = [inf] * len(decodes)
        self._routed = 0  # requests the proxy has spread so far (round-robin on each side)
        self._decoder_of: dict[int, int] = {}
        self._set_hops(setup)
        self._set_transfer(cell, setup, served)
        self._set_event_tables()

    def _set_hops(self, setup: EngineSetup) -> None:
        self.hop = hop = ProxyHop()
        # 1-token response + new request through the decode instance's API server, its serial
        # input work included (the request reaches that engine with its KV, past its queue)
        # (plus each server's latency on the way in: HostCost.request_latency_ms)
        latency_ms = setup.host.request_latency_ms
        to_decoder_ms = 2 * hop.request_ms + setup.host.request_ms + latency_ms
        self._decode_hop_s = to_decoder_ms * 1e-3
        self._chunk_hop_s = hop.chunk_ms * 1e-3
        self._hop_in_s = (hop.request_ms + latency_ms) * 1e-3

    def _set_transfer(self, cell: Cell, setup: EngineSetup, served: Served) -> None:
        """The KV link and buffer, and per request id its sizes and V0 receive times
        (computed once per distinct prompt length)."""
        tp = cell.topology.instance_roles[-1].tp  # the decoder's ranks pull the KV
        self.link_config = kv_link(
            cell.recipe, cell.mode.kv_protocol or "rdma", tp, cell.engine.get("kv_link")
        )
        self.links = [
            TransferLink(self.link_config.wire_bytes_per_s, self.link_config.setup_ms * 1e-3)
            for _ in self.decodes
        ]
        self.bytes_per_token_per_rank = kv_bytes_per_token_per_rank(setup.arch, tp, cell.recipe)
        self.bytes_per_prompt_token = self.bytes_per_token_per_rank * tp
        self.buffer = LookupBuffer(float(cell.engine.get("kv_buffer_size", V0_KV_BUFFER_BYTES)))
        self._inserting: list[int] = []  # prefill batch whose inserts wait for buffer room
        self._inserted = 0
        self._prefill_blocked = False
        self.prefill_stall_s = 0.0
        self._blocked_since = 0.0
        self._input_lens, self._output_lens = self.lengths.input_lens, served.max_tokens
        per_length = {
            length: self._kv_of(length) for length in {cell.workload.input_len, *self._input_lens}
        }
        kv = [per_length[length] for length in self._input_lens]
        self._transfer_bytes, self._buffer_entry_bytes, self._v0_receive_s, self._v0_producer_s = (
            [row[i] for row in kv] for i in range(4)
        )
        self._nominal_kv = per_length[cell.workload.input_len]
        self._awaiting_receive: set[int] = set()  # V0: at the decoder, KV not yet received
        self._receive: ReceiveStep | None = None  # the decoder's V0 receive step in flight
        # V0 receives inside the decoder's step; V1 adds a transfer at least this long.
        shortest = min(self._input_lens)
        self._link_min_s = (
            0.0 if self.lookup_buffer else self.links[0].duration_alone_s(per_length[shortest][0])
        )

    def _set_event_tables(self) -> None:
        # Least time from an event of each kind to a request joining the decoder.
        to_decoder_s = self._decode_hop_s + self._link_min_s
        self._event_leads = {
            ARRIVE: to_decoder_s,
            SLOT_FREED: self._hop_in_s + self._decode_hop_s + self._link_min_s,
            PREFILL_DONE: to_decoder_s,
            ARRIVE_DECODE: self._link_min_s,
            ARRIVE_TRANSFER: self._link_min_s,
            LINK: 0.0,
            DECODE_DONE: inf,  # another decoder's step: it changes no batch but its own
            RECEIVE_DONE: 0.0,
        }
        self._handlers = {
            ARRIVE: self._on_arrive_prefill,
            PREFILL_DONE: self._on_prefill_done,
            ARRIVE_DECODE: self._on_arrive_decode,
            ARRIVE_TRANSFER: self._on_arrive_transfer,
            LINK: self._on_link,
            DECODE_DONE: self._on_decode_done,
            RECEIVE_DONE: self._on_receive_done,
            SLOT_FREED: self._on_slot_freed,
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
            "topology": f"disaggregated-{self.cell.recipe}",
            "proxy_hop": asdict(self.hop),
            "kv_link": asdict(self.link_config),
            "kv_bytes_per_prompt_token": self.bytes_per_prompt_token,
            "kv_bytes_per_token_per_rank": self.bytes_per_token_per_rank,
        }
        if self.lookup_buffer:
            params.update(self._v0_parameters())
        return params

    def run(self, sends: np.ndarray) -> list[RequestRecord]:
        w = self.cell.workload
        total = w.warmup_requests + w.num_prompts
        self.chunks: list[list[float]] = [[] for _ in range(total)]
        # The proxy's max_tokens=1 copies for the prefill instance, made at once.
        self._copies = self.requests.served(range(total), 1)
        warm_sends = warm_up(
            w.warmup_requests, self.chunks, lambda k, at: self._run([(at, k)]), 2 * self._hop_in_s
        )
        scheduled = sends.tolist()
        sent = None
        if not capped(w.max_concurrency, w.num_prompts):
            measured = [(at, w.warmup_requests + i) for i, at in enumerate(scheduled)]
            if self.pipelined:
                self._decode_pass(self._run(measured, recording=True))
            else:
                self._run(measured)
        else:
            self.slots = ClientSlots(scheduled, w.max_concurrency)
            first = [(at, w.warmup_requests + k) for k, at in self.slots.take(0.0)]
            self._run(first)
            sent = self.slots.sent
        return records(
            w.warmup_requests, warm_sends, sends, sent, self.chunks, self.lengths, self.requests
        )

    def _run(self, sends: list[tuple[float, int]], recording: bool = False) -> UpstreamRecording:
        """Process ``sends`` (time, request id) and every event they cause; with
        ``recording``, without the decoder: the upstream pass of a pipelined run.

        Arrivals are not queued: they are sorted up front and merged with the event queue. They
        win ties, as they would on one queue where they had been pushed before every other
        event (the queue is empty when a run starts)."""
        hop_in = self._hop_in_s
        arrivals = sorted((sent + hop_in, k) for sent, k in sends)
        last = len(arrivals)
        arrivals.append((inf, -1))  # sentinel: no more arrivals
        up = UpstreamRecording([t for t, _ in arrivals])
        self.recording = up if recording else None
        events, heap, handlers, pop = self.events, self.events.heap, self._handlers, heapq.heappop
        prefills, decodes, on_arrive = self.prefills, self.decodes, self._on_arrive_prefill
        prefill_busy, decode_busy = self._prefill_busy, self._decode_busy
        i = 0
        while True:
            arrival_at = arrivals[i][0]
            if arrival_at <= (heap[0][0] if heap else inf):
                if arrival_at == inf:
                    break
                now = arrival_at
                on_arrive(now, arrivals[i][1])
                i += 1
                if self._prefill_blocked or all(prefill_busy):
                    # Nothing else can start: take the arrivals up to the next event at once.
                    until = heap[0][0] if heap else inf
                    while i < last and arrivals[i][0] <= until:
                        on_arrive(arrivals[i][0], arrivals[i][1])
                        i += 1
            else:
                now, _, kind, payload = pop(heap)
                handlers[kind](now, payload)
            for p, prefill in enumerate(prefills):
                if not (self._prefill_blocked or prefill_busy[p]) and prefill.has_work():
                    # A prefill instance never has a decode run (its requests finish with
                    # their first token) nor receives KV: one step.
                    result = prefill.step()
                    self._prefill_until[p] = now + result.duration_s
                    events.push(self._prefill_until[p], PREFILL_DONE, (p, now, result))
                    if self._receive is None:  # no V0 receive in flight to tell
                        prefill_busy[p] = True
                    else:
                        self._set_prefill_busy(now, True)
            if recording:
                continue
            for d, decode in enumerate(decodes):
                if not decode_busy[d] and decode.has_work():
                    # A waiting request rules out a decode run: no horizon needed then.
                    waiting = decode.scheduler.waiting
                    horizon = now if waiting else self._decode_horizon(arrivals[i][0])
                    self._start_decode(d, now, horizon)
        self.recording = None
        if self._inserting:
            raise RuntimeError(
                f"the v0 producer's KV buffer (kv_buffer_size {self.buffer.capacity_bytes:.3g} "
                "bytes per rank) cannot hold one prefill batch: its inserts wait for a consumer "
                "that never receives the batch, and vLLM would hang the same way"
            )
        return up

    def _start_decode(self, d: int, now: float, next_event: float) -> None:
        """Start idle decoder ``d`` that has work: a run of pure decodes up to the next event
        (which could change its batch) when it can, else one step; queue its completion."""
        self._decode_busy[d] = True
        decode = self.decodes[d]
        run = decode.decode_run(next_event - now)
        if run is not None:
            self.events.push(now + run.step_ends_s[-1], DECODE_DONE, (d, now, run))
            return
        result = decode.step()
        if result.num_received:
            self._received(now, result)
        else:
            self.events.push(now + result.duration_s, DECODE_DONE, (d, now, result))

    def _decode_horizon(self, next_arrival: float) -> float:
        """Earliest time an event could change the decode batch: a decode run may go on until
        then. Only a request joining the decoder changes its batch; prefill-side events lead
        to one no sooner than the proxy hop (and, in V1, a transfer with the link to itself)
        later, so a decode run need not stop at each of them. An arrival counts only while
        some prefill instance is idle: while all are busy, their completion events bound them.
        The decoder's steps are the same either way; only the runs that sum them differ."""
        to_decoder = self._decode_hop_s + self._link_min_s
        horizon = inf if all(self._prefill_busy) else next_arrival + to_decoder
        leads = self._event_leads
        for time, _, kind, _ in self.events.heap:
            if time + leads[kind] < horizon:
                horizon = time + leads[kind]
        return horizon

    def _on_arrive_prefill(self, now: float, request_id: int) -> None:
        request = self._copies[request_id]
        p = self._route(request_id)  # a refused request too: the proxy forwarded it
        if request is None:
            # Refused (the error text says what the client saw): nothing reaches an engine.
            if self.slots is not None:  # the slot frees when the answer is back
                self.events.push(now + self._hop_in_s, SLOT_FREED, None)
            return
        # How long before the prefill step ends it reached the API server (0 if idle).
        waited_ms = (self._prefill_until[p] - now) * 1e3 if self._prefill_busy[p] else 0.0
        self.prefills[p].add_request(request, waited_ms)

    def _route(self, request_id: int) -> int:
        """The proxy's choice for a request: the next prefill and the next decode instance,
        round-robin on each side; returns the prefill instance."""
        k, self._routed = self._routed, self._routed + 1
        self._decoder_of[request_id] = k % len(self.decodes)
        return k % len(self.prefills)

    def _on_prefill_done(self, now: float, payload: tuple[int, float, StepResult]) -> None:
        p, started, result = payload
        if self._receive is None:  # no V0 receive in flight to tell
            self._prefill_busy[p] = False
        else:
            self._set_prefill_busy(now, False)
        recording = self.recording
        if recording is not None:
            recording.steps.append((started, now, p))
        finished = [request.request_id for request in result.finished]
        if self.lookup_buffer:
            self._inserting.extend(finished)
            self._insert(now)
        elif finished:
            self.events.push(now + self._decode_hop_s, ARRIVE_TRANSFER, finished)
            if recording is not None:
                recording.transfers.append((now, now + self._decode_hop_s))

    def _on_decode_done(
        self, now: float, payload: tuple[int, float, StepResult | DecodeRun]
    ) -> None:
        d, started, result = payload
        self._decode_busy[d] = False
        chunks = self.chunks
        emit_chunks(chunks, started, now, result, self._chunk_hop_s)
        if self.slots is not None:  # a slot frees when the last chunk reaches the client
            for request in result.finished:
                self.events.push(chunks[request.request_id][-1], SLOT_FREED, None)

    def _on_slot_freed(self, now: float, payload: None) -> None:
        """The simulated client sends the next requests its free slots allow, in order, each
        at max(its scheduled time, now)."""
        assert self.slots is not None
        self.slots.release()
        first = self.cell.workload.warmup_requests
        for k, sent in self.slots.take(now):
            self.events.push(sent + self._hop_in_s, ARRIVE, first + k)
