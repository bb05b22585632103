"""The round-robin driver: one instance (``single``) or several behind vLLM's strict
round-robin proxy (``nondisagg``, ``chunked``); request k goes to instance k mod n."""

from __future__ import annotations

from dataclasses import asdict
from math import inf
from typing import Any

import numpy as np

from servematrix.engine.instance import EngineInstance
from servematrix.engine.scheduler import Request
from servematrix.engine.transfer import ProxyHop
from servematrix.simulate.events import (
    ARRIVE,
    NEXT_TURN,
    SLOT_FREED,
    STEP_DONE,
    ClientSlots,
    EventQueue,
)
from servematrix.simulate.requests import (
    Requests,
    Served,
    capped,
    emit_chunks,
    emit_run,
    emit_step,
    records,
    warm_up,
)
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord
from servematrix.workload import RequestLengths
from servematrix.workload.sessions import Turn


def round_robin_targets(num_requests: int, num_instances: int) -> list[int]:
    """Instance of each request in send order (warm-ups first): ``itertools.cycle`` over the
    instances, as ``round_robin_proxy.py`` does, so the first warm-up takes the first slot."""
    return [k % num_instances for k in range(num_requests)]


class RoundRobin:
    """One or more independent instances; request k goes to instance k mod n."""

    def __init__(
        self,
        cell: Cell,
        instances: list[EngineInstance],
        hop: ProxyHop,
        lengths: RequestLengths,
        served: Served,
        turns: list[Turn] | None = None,
        request_latency_s: float = 0.0,
    ):
        self.cell = cell
        self.instances = instances
        self.hop = hop
        self.request_latency_s = request_latency_s
        """The instances' own latency on a request's way in (``HostCost.request_latency_ms``)."""
        self.lengths = lengths
        self.requests = Requests(lengths, served)
        self.turns = turns
        """A sessions workload's measured turns (`servematrix.workload.sessions`): each user's turns
        share one prefix group (a turn's prompt is the next one's prefix)."""

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
        hop_in = self.hop.request_ms * 1e-3 + self.request_latency_s
        hop_out = self.hop.chunk_ms * 1e-3
        targets = round_robin_targets(total, n_inst)
        make, refused = self.requests.new, self.requests.refused

        def send_warmup(k: int, at: float) -> None:
            if k not in refused:  # a refused one's error answer comes straight back
                run_instance(self.instances[targets[k]], [(at + hop_in, make(k))], chunks, hop_out)

        warm_sends = warm_up(w.warmup_requests, chunks, send_warmup, hop_in + hop_out)
        measured = self.requests.served(range(w.warmup_requests, total))
        sent = None
        if self.turns is not None:
            for request, turn in zip(measured, self.turns, strict=True):
                if request is not None:
                    request.prefix_chain, request.prefix_tokens = (
                        (turn.user,),
                        request.prompt_tokens,
                    )
            requests = list(zip(targets[w.warmup_requests :], measured, strict=True))
            firsts = sends.tolist()  # the users' first turns, in user order
            run = _SessionRun(self.instances, requests, firsts, self.turns, chunks, hop_in, hop_out)
            run.run()
            sent = run.sent
            sends = np.array(sent)
        elif capped(w.max_concurrency, w.num_prompts):
            requests = list(zip(targets[w.warmup_requests :], measured, strict=True))
            slots = ClientSlots(sends.tolist(), w.max_concurrency)
            _CappedRun(self.instances, requests, slots, chunks, hop_in, hop_out).run()
            sent = slots.sent
        else:
            per_instance: list[list[tuple[float, Request]]] = [[] for _ in range(n_inst)]
            for k, sent_s, request in zip(
                range(w.warmup_requests, total), sends.tolist(), measured, strict=True
            ):
                if request is not None:
                    per_instance[targets[k]].append((sent_s + hop_in, request))
            for instance, arrivals in zip(self.instances, per_instance, strict=True):
                run_instance(instance, arrivals, chunks, hop_out)
        return records(
            w.warmup_requests, warm_sends, sends, sent, chunks, self.lengths, self.requests
        )


def run_instance(
    instance: EngineInstance,
    arrivals: list[tuple[float, Request]],
    chunks: list[list[float]],
    hop_out_s: float,
) -> None:
    """Drive one instance through its arrivals (sorted by time) until it has no work left:
    with no client cap, nothing couples the instances, and each needs no event queue."""
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
            emit_run(chunks, clock, run, hop_out_s)
            clock += run.step_ends_s[-1]
            continue
        result = instance.step()
        clock += result.duration_s
        emit_step(chunks, clock, result, hop_out_s)


class _CappedRun:
    """Independent instances behind a client that keeps at most its cap of requests in flight
    (`ClientSlots`), on one event queue.

    ``requests`` are (instance, request) in schedule order, request None for one the server
    refuses (its slot frees when the error answer is back). A request is queued as soon as its
    slot is known. Events at one time are all applied before any idle instance starts a step,
    as `run_instance` adds every arrival up to its clock."""

    def __init__(
        self,
        instances: list[EngineInstance],
        requests: list[tuple[int, Request | None]],
        slots: ClientSlots,
        chunks: list[list[float]],
        hop_in_s: float,
        hop_out_s: float,
    ):
        self.instances, self.requests, self.slots, self.chunks = instances, requests, slots, chunks
        self.hop_in_s, self.hop_out_s = hop_in_s, hop_out_s
        self.events = EventQueue()
        self.busy = [False] * len(instances)
        self.busy_until = [0.0] * len(instances)  # when a busy instance's step (or run) ends
        # Least time from an event of each kind to an arrival at some instance: a decode run
        # may go on until the earliest of them.
        self.leads = {
            ARRIVE: 0.0,
            SLOT_FREED: hop_in_s,
            STEP_DONE: hop_out_s + hop_in_s,
        }
        self.handlers = {
            ARRIVE: self._on_arrive,
            SLOT_FREED: self._on_slot_freed,
            STEP_DONE: self._on_step_done,
        }

    def run(self) -> None:
        events, handlers, now = self.events, self.handlers, 0.0
        while True:
            self._send(now)
            if events.next_s() > now:
                # Everything due by now is applied: idle instances with work start.
                self._start_idle(now)
                if not events:
                    return
                now = events.next_s()
            while events.next_s() <= now:
                _, _, kind, payload = events.pop()
                handlers[kind](now, payload)

    def _send(self, now: float) -> None:
        """The client sends while it holds a free slot."""
        for k, sent in self.slots.take(now):
            self.events.push(sent + self.hop_in_s, ARRIVE, self.requests[k])

    def _start_idle(self, now: float) -> None:
        events, leads = self.events, self.leads
        for index, instance in enumerate(self.instances):
            if self.busy[index] or not instance.has_work():
                continue
            horizon = min((t + leads[kind] for t, _, kind, _ in events.heap), default=inf)
            run = instance.decode_run(horizon - now)
            if run is not None:
                done_at, payload = now + run.step_ends_s[-1], (now, run)
            else:
                result = instance.step()
                done_at, payload = now + result.duration_s, (now, result)
            events.push(done_at, STEP_DONE, (index, payload))
            self.busy[index], self.busy_until[index] = True, done_at

    def _on_arrive(self, now: float, payload: tuple[int, Request | None]) -> None:
        index, request = payload
        if request is None:
            self.events.push(now + self.hop_out_s, SLOT_FREED, None)
        else:
            waited_ms = (self.busy_until[index] - now) * 1e3 if self.busy[index] else 0.0
            self.instances[index].add_request(request, waited_ms)

    def _on_slot_freed(self, now: float, payload: None) -> None:
        self.slots.release()  # the client sends when every event of this time is applied

    def _on_step_done(self, now: float, payload: tuple[int, Any]) -> None:
        index, (started, result) = payload
        self.busy[index] = False
        chunks = self.chunks
        emit_chunks(chunks, started, now, result, self.hop_out_s)
        for request in result.finished:
            self.events.push(chunks[request.request_id][-1], SLOT_FREED, None)


class _SessionRun(_CappedRun):
    """Multi-turn sessions on one event queue: the users' first turns go at their scheduled
    times, and a turn's end (its last chunk at the client, or its error) queues the user's
    next turn as a `NEXT_TURN` event its think time later: a dependent arrival."""

    def __init__(
        self,
        instances: list[EngineInstance],
        requests: list[tuple[int, Request | None]],
        firsts_s: list[float],
        turns: list[Turn],
        chunks: list[list[float]],
        hop_in_s: float,
        hop_out_s: float,
    ):
        slots = ClientSlots(firsts_s, len(firsts_s))  # first turns: indices 0..users-1
        super().__init__(instances, requests, slots, chunks, hop_in_s, hop_out_s)
        self.turns = turns
        self.warmups = len(chunks) - len(turns)
        self.next_turn = {turn.after: k for k, turn in enumerate(turns) if turn.after is not None}
        self.sent = [0.0] * len(turns)
        self.leads[NEXT_TURN] = hop_in_s
        self.handlers[NEXT_TURN] = self._on_next_turn

    def run(self) -> None:
        super().run()
        self.sent[: len(self.slots.sent)] = self.slots.sent

    def _ended(self, k: int, at: float) -> None:
        """Measured turn ``k``'s answer is back at ``at``: its user's next turn is due."""
        following = self.next_turn.get(k)
        if following is not None:
            self.events.push(at + self.turns[following].think_s, NEXT_TURN, following)

    def _send(self, now: float) -> None:
        for k, at in self.slots.take(now):
            self._go(k, at)

    def _on_next_turn(self, now: float, k: int) -> None:
        self.sent[k] = now
        self._go(k, now)

    def _go(self, k: int, at: float) -> None:
        """Send measured turn ``k`` at ``at`` (a refused one's error is back a round trip
        later, and its user goes on)."""
        index, request = self.requests[k]
        if request is None:
            self._ended(k, at + self.hop_in_s + self.hop_out_s)
        else:
            self.events.push(at + self.hop_in_s, ARRIVE, (index, request))

    def _on_step_done(self, now: float, payload: tuple[int, Any]) -> None:
        super()._on_step_done(now, payload)
        _, (_, result) = payload
        for request in result.finished:
            self._ended(request.request_id - self.warmups, self.chunks[request.request_id][-1])
