"""The simulator's event queue, its named event kinds, and the simulated client's
concurrency cap, shared by every topology's driver."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from enum import IntEnum
from typing import Any


class Event(IntEnum):
    """What an event on the queue is (an int, so it indexes the drivers' handler tables)."""

    ARRIVE = 0
    """A request reaches an instance (round-robin) or the prefill instance (disaggregated)."""
    STEP_DONE = 1
    """A round-robin instance's step (or decode run) ends."""
    SLOT_FREED = 2
    """A request's answer is back at a capped client: one more request may go."""
    PREFILL_DONE = 3
    ARRIVE_DECODE = 4
    """V0: the proxy sends the request to the decoder, which receives its KV in a step."""
    ARRIVE_TRANSFER = 5
    """V1: a prefill batch reaches the decoder, which starts pulling the KV."""
    LINK = 6
    """V1: the KV link's next transfer completes."""
    DECODE_DONE = 7
    RECEIVE_DONE = 8
    """V0: the decoder's step receiving KV ends (unless superseded since it was queued)."""
    NEXT_TURN = 9
    """A session's next turn is sent: its think time after the previous turn's answer ended
    (a dependent arrival: its time is known only when the request it follows finishes)."""


# The members by name, as ``re.IGNORECASE`` or ``socket.AF_INET`` are: the drivers name a kind
# per event, and an attribute of an Enum class costs ~0.2 us on Python 3.11 (a global ~0.02).
(
    ARRIVE,
    STEP_DONE,
    SLOT_FREED,
    PREFILL_DONE,
    ARRIVE_DECODE,
    ARRIVE_TRANSFER,
    LINK,
    DECODE_DONE,
    RECEIVE_DONE,
    NEXT_TURN,
) = Event


class EventQueue:
    """Events ``(time, sequence, kind, payload)`` in time order; events at one time come out
    in the order they were pushed (the sequence number breaks ties, payloads never compare)."""

    __slots__ = ("_seq", "heap")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Event, Any]] = []
        self._seq = 0

    def push(self, time: float, kind: Event, payload: Any) -> None:
        heapq.heappush(self.heap, (time, self._seq, kind, payload))
        self._seq += 1

    def pop(self) -> tuple[float, int, Event, Any]:
        return heapq.heappop(self.heap)

    def next_s(self) -> float:
        """The next event's time (inf when the queue is empty)."""
        heap = self.heap
        return heap[0][0] if heap else float("inf")

    def __bool__(self) -> bool:
        return bool(self.heap)


class ClientSlots:
    """The simulated client's concurrency cap, as ``vllm bench serve --max-concurrency``: an
    ``asyncio.Semaphore`` of ``cap`` slots acquired in schedule order, so request k is sent at
    max(its scheduled time, the moment a slot frees for it); a slot frees when a request's
    answer is back at the client (its last chunk, or the error of a refused one)."""

    def __init__(self, scheduled: list[float], cap: int):
        self.scheduled = scheduled
        self.sent = [0.0] * len(scheduled)
        """Send time of each measured request, in schedule order (filled as they go)."""
        self.free = cap
        self._next = 0

    def release(self) -> None:
        self.free += 1

    def take(self, now: float) -> Iterator[tuple[int, float]]:
        """The requests the free slots let the client send at ``now``: (index, send time)."""
        scheduled, sent = self.scheduled, self.sent
        while self.free and self._next < len(scheduled):
            k = self._next
            sent[k] = at = max(scheduled[k], now)
            self.free -= 1
            self._next += 1
            yield k, at
