"""V1 KV handling of the disaggregated driver (vLLM 0.33's ``MooncakeConnector``): the
decoder pulls a prefill batch's KV over a link that concurrent transfers share, and a request
joins the decode batch when its KV has arrived.

Pipelined (V1 without a concurrency cap): nothing flows back from the decoder, so the driver
runs the measured requests in two passes with the same result: the prefill instance and the
link on the event queue, with the same handlers and an `UpstreamRecording` hook recording
when requests join the decoder and what the queue holds; then the decoder alone
(`V1Handoff._decode_pass`), its decode runs bounded by the horizon the recording gives. A
decoder event at the exact time of an upstream event raises `OrderTie` (their order on one
queue would have decided which came first)."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from math import inf
from typing import TYPE_CHECKING

from servematrix.engine.instance import DecodeRun, StepResult
from servematrix.engine.scheduler import Request
from servematrix.simulate.events import LINK, PREFILL_DONE
from servematrix.simulate.requests import emit_run, emit_step

if TYPE_CHECKING:
    from servematrix.simulate.disagg import Disaggregated


class OrderTie(Exception):
    """A pipelined run met a decoder event at the very time of an upstream event: their order
    on one queue decides what happens, so the cell is simulated again on one queue."""


@dataclass
class UpstreamRecording:
    """What the upstream pass recorded: arrival times at the prefill instances (sorted, ending
    with inf), the prefill steps (start, end, prefill instance) in the order they ended, the
    batches sent to the decoders and the links' events (time queued, time due), and the
    requests joining a decoder (time, request ids) in event order."""

    arrivals: list[float]
    steps: list[tuple[float, float, int]] = field(default_factory=list)
    transfers: list[tuple[float, float]] = field(default_factory=list)
    link_events: list[tuple[float, float]] = field(default_factory=list)
    joins: list[tuple[float, list[int]]] = field(default_factory=list)

    def times(self) -> set[float]:
        """Every time an upstream event happened (events are also queued at such times)."""
        return {
            *self.arrivals,
            *(end for _, end, _ in self.steps),
            *(due for _, due in self.transfers),
            *(due for _, due in self.link_events),
        }

    def horizon(
        self, to_decoder_s: float, link_min_s: float, prefillers: int
    ) -> Callable[[float], float]:
        """`Disaggregated._decode_horizon` as a function of the time (non-decreasing from call
        to call, and never an upstream event's time): the busy prefill instances' next step
        end, or the next arrival while one of the ``prefillers`` is idle, plus
        ``to_decoder_s``; the first batch on its way to
        the decoder's arrival plus ``link_min_s``; the link's earliest queued event."""
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
            value, busy, seen, j = inf, 0, set(), p
            # Each prefill instance's first step not ended yet: busy if it has started (its
            # completion event is queued); the first busy one ends first (steps end in order).
            while j < n_steps and len(seen) < prefillers:
                start, end, who = steps[j]
                if who not in seen:
                    seen.add(who)
                    if start < now:
                        busy += 1
                        value = min(value, end + to_decoder_s)
                j += 1
            if busy < prefillers:
                while arrivals[a] < now:
                    a += 1
                value = min(value, arrivals[a] + to_decoder_s)
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


class V1Handoff:
    """The V1 handlers of `Disaggregated` (a mixin: the driver holds the state)."""

    def _on_arrive_transfer(self: Disaggregated, now: float, request_ids: list[int]) -> None:
        """A prefill batch's requests reach the decoder, which starts pulling their KV.

        One event for the batch: events at one time run back to back, and starting a
        transfer changes neither instance, so nothing could happen between them."""
        transfer_bytes, decoder_of = self._transfer_bytes, self._decoder_of
        pulling = []
        for request_id in request_ids:
            d = decoder_of[request_id]
            self.links[d].start(now, request_id, transfer_bytes[request_id])
            if d not in pulling:
                pulling.append(d)
        for d in pulling:
            self._schedule_link(now, d)

    def _on_link(self: Disaggregated, now: float, d: int) -> None:
        """Decoder ``d``'s link: transfers complete and their requests join it."""
        if now != self._link_event_at[d]:
            return  # superseded by a sooner event: acting on it would push a duplicate
        self._link_event_at[d] = inf
        done = self.links[d].advance(now)
        if done:
            request_ids = [request_id for _, request_id in done]
            if self.recording is None:
                self._join_decoder(d, request_ids)
            else:
                self.recording.joins.append((now, request_ids))
        self._schedule_link(now, d)

    def _schedule_link(self: Disaggregated, now: float, d: int) -> None:
        nxt = self.links[d].next_event_s()
        if nxt < self._link_event_at[d]:
            self._link_event_at[d] = nxt
            self.events.push(nxt, LINK, d)
            if self.recording is not None:
                self.recording.link_events.append((now, nxt))

    def _join_decoder(self: Disaggregated, d: int, request_ids: list[int]) -> None:
        """Requests whose KV has arrived join decoder ``d``: all prompt KV is present, and the
        decoder recomputes the last prompt token to sample the first output token."""
        input_lens, output_lens = self._input_lens, self._output_lens
        add, made = self.decodes[d].add_request, self.requests.made
        for request_id in request_ids:
            input_len = input_lens[request_id]
            request = Request(request_id, input_len, output_lens[request_id], input_len - 1)
            made.append(request)
            add(request)

    def _decode_pass(self: Disaggregated, up: UpstreamRecording) -> None:
        """The decoders after the upstream pass, one after the other (nothing flows between
        them): requests join at the recorded times, and a decode run may go on until the
        horizon `_decode_horizon` would give on the full queue."""
        upstream_times = up.times()
        for d in range(len(self.decodes)):
            mine = [join for join in up.joins if self._decoder_of[join[1][0]] == d]
            self._decoder_pass(d, up, mine, upstream_times)

    def _decoder_pass(
        self: Disaggregated,
        d: int,
        up: UpstreamRecording,
        joins: list[tuple[float, list[int]]],
        upstream_times: set[float],
    ) -> None:
        decode, chunks, hop = self.decodes[d], self.chunks, self._chunk_hop_s
        waiting = decode.scheduler.waiting
        horizon_at = up.horizon(
            self._event_leads[PREFILL_DONE], self._link_min_s, len(self.prefills)
        )
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
                    raise OrderTie
                now = join_at
                self._join_decoder(d, joins[j][1])
                j += 1
                if done_at < inf:
                    continue  # busy: they wait for the next step
            else:
                now = done_at
                if now in upstream_times:
                    raise OrderTie
                if isinstance(result, DecodeRun):
                    emit_run(chunks, started, result, hop)
                else:
                    assert result is not None
                    emit_step(chunks, now, result, hop)
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
