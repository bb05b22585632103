"""V0 KV handling of the disaggregated driver (vLLM 0.6's ``SimpleConnector`` + Mooncake pipe):
the producer inserts each prefilled request's KV into its lookup buffer, stalling while the
buffer is full; the consumer receives it inside the forward pass of its next step, and the
producer's share of that copy chain advances only while the producer is between steps."""

from __future__ import annotations

import math
from math import inf
from typing import TYPE_CHECKING, Any

from servematrix.engine.instance import StepResult
from servematrix.engine.scheduler import Request
from servematrix.engine.transfer import v0_receive_segments
from servematrix.simulate.events import ARRIVE_DECODE, RECEIVE_DONE

if TYPE_CHECKING:
    from servematrix.simulate.disagg import Disaggregated


class ReceiveStep:
    """A V0 decoder step that receives KV, in flight: its work in order
    (`servematrix.engine.transfer.v0_receive_segments`). Its end moves when the producer starts
    or ends a step; ``version`` tells the live completion event from superseded ones."""

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
        self.segments = v0_receive_segments(receives, result.duration_s)
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


class V0Handoff:
    """The V0 handlers of `Disaggregated` (a mixin: the driver holds the state)."""

    def _insert(self: Disaggregated, now: float) -> None:
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
            self.events.push(now + self._decode_hop_s, ARRIVE_DECODE, request_id)
        self._inserting, self._inserted = [], 0

    def _on_arrive_decode(self: Disaggregated, now: float, request_id: int) -> None:
        """The request reaches the decoder, which receives its KV in its next step."""
        self._awaiting_receive.add(request_id)
        self.decodes[0].add_request(
            self.requests.keep(
                Request(
                    request_id,
                    self._input_lens[request_id],
                    self._output_lens[request_id],
                    receive_ms=self._v0_receive_s[request_id] * 1e3,
                )
            )
        )

    def _received(self: Disaggregated, now: float, result: StepResult) -> None:
        """The decoder started a step that receives KV: it ends when its `ReceiveStep` does."""
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
        self._receive = ReceiveStep(now, result, receives, released)
        self._schedule_receive()

    def _set_prefill_busy(self: Disaggregated, now: float, busy: bool) -> None:
        """The producer starts or ends a step: a receive in flight does its work up to now
        under the old state, and its end is queued again under the new one."""
        receive = self._receive
        if receive is not None:
            receive.advance(now, self._prefill_busy[0])
        self._prefill_busy[0] = busy
        if receive is not None:
            self._schedule_receive()

    def _schedule_receive(self: Disaggregated) -> None:
        receive = self._receive
        assert receive is not None
        receive.version += 1
        end = receive.end_s(self._prefill_busy[0])
        if end < inf:
            self.events.push(end, RECEIVE_DONE, receive.version)

    def _on_receive_done(self: Disaggregated, now: float, version: int) -> None:
        receive = self._receive
        if receive is None or version != receive.version:
            return  # superseded: the producer started or ended a step since it was queued
        self._receive = None
        self._on_decode_done(now, (0, receive.started, receive.result))
        # drop_select removed the entries from the producer's buffer.
        self.buffer.release(receive.released_bytes)
        if self._prefill_blocked:
            self._insert(now)

    def _v0_parameters(self: Disaggregated) -> dict[str, Any]:
        return {
            "kv_buffer_size": self.buffer.capacity_bytes,
            # For a prompt of the workload's input_len.
            "v0_receive_ms": self._nominal_kv[2] * 1e3,
            "v0_producer_share_ms": self._nominal_kv[3] * 1e3,
            "prefill_buffer_stall_s": self.prefill_stall_s,
        }
