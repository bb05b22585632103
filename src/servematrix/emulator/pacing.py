"""The wall-clock driver: one :class:`~servematrix.engine.instance.EngineInstance` paced by the
event loop's monotonic clock.

The simulator advances a virtual clock by each step's duration; this driver waits for it
instead. Every step starts at an absolute instant (the previous step's end, or the arrival that
woke an idle engine) and its tokens are released at ``start + duration``, so the engine's
timeline is the simulator's: lateness of the event loop delays a release but never shifts the
steps after it. A request joins the first step that starts at or after its arrival, as in the
simulator's driver.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from servematrix.engine.instance import EngineInstance, StepResult
from servematrix.engine.scheduler import Request

RECENT_STEPS = 4096
"""Steps kept in ``WallClockEngine.recent_steps``: seconds of history at any step rate."""


@dataclass
class TokenStream:
    """One request's output as the engine produces it: ``due_s`` holds the monotonic instant
    each token was produced (its step's end); ``released`` wakes the HTTP handler."""

    request: Request
    arrival_s: float
    due_s: list[float] = field(default_factory=list)
    finished: bool = False
    released: asyncio.Event = field(default_factory=asyncio.Event)
    scheduled_s: float | None = None
    """The start of the first step that computed any of it (vLLM's ``scheduled_ts``)."""

    async def wait(self, consumed: int) -> None:
        """Wait until more than ``consumed`` tokens are out, or the request has finished."""
        while len(self.due_s) <= consumed and not self.finished:
            self.released.clear()
            await self.released.wait()


@dataclass
class EngineCounters:
    """Totals for ``/metrics`` (vLLM counts prompt tokens when a request's prefill completes)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    prefill_time_s: float = 0.0
    """Over finished requests: first token - first scheduled (vLLM's ``request_prefill_time``)."""
    prefills: int = 0
    decode_time_s: float = 0.0
    """Over finished requests: last token - first token (``request_decode_time``)."""
    finished_generation_tokens: int = 0
    finished: int = 0


class WallClockEngine:
    """Runs one instance in real time; ``submit`` from request handlers, ``run`` as a task."""

    def __init__(self, instance: EngineInstance):
        self.instance = instance
        self.counters = EngineCounters()
        self._ids = itertools.count()
        self._arrivals: list[TokenStream] = []
        self._streams: dict[int, TokenStream] = {}
        self._unscheduled: list[TokenStream] = []
        self._aborted: list[TokenStream] = []
        self._wake = asyncio.Event()
        # Disaggregated roles (emulator.disagg): a v0 KV producer's copy chain advances only
        # between its steps, so it reads the recent steps, and its step's outputs leave when
        # the release hook says (a full lookup buffer holds them and the next step back); a v0
        # consumer's step that receives KV ends when the receive hook says (its receive waits
        # for the producer's share).
        self.recent_steps: deque[tuple[float, float]] = deque(maxlen=RECENT_STEPS)
        self.receive_hook: Callable[[float, StepResult], Awaitable[float]] | None = None
        self.release_hook: Callable[[StepResult, float], Awaitable[float]] | None = None

    @property
    def num_running(self) -> int:
        return len(self.instance.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.instance.scheduler.waiting) + len(self._arrivals)

    @property
    def kv_usage(self) -> float:
        """``kv_cache_usage_perc``: as in vLLM, cached prefix blocks that no running request
        uses count as free (they are evicted on demand)."""
        pool = self.instance.scheduler.pool
        idle = sum(n for group, n in pool.cached_blocks.items() if not pool.prefix_users.get(group))
        return (pool.used_blocks - idle) / pool.num_blocks

    def kv_cache(self) -> dict[str, int]:
        """The KV pool now and at its peak since start or :meth:`reset_kv_peak` (blocks): the
        exact peak a sampler of ``/metrics`` can miss between two samples."""
        pool = self.instance.scheduler.pool
        return {
            "num_blocks": pool.num_blocks,
            "block_size_tokens": pool.block_size,
            "used_blocks": pool.used_blocks,
            "peak_used_blocks": pool.peak_used_blocks,
        }

    def reset_kv_peak(self) -> None:
        """Start a new peak from the blocks in use now (a cell on a warm deployment measures
        its own). The pool keeps its fewest free blocks; the peak is counted from them."""
        pool = self.instance.scheduler.pool
        pool.min_free_blocks = pool.free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.instance.scheduler.pool.reset_prefix_cache()

    def can_ever_admit(self, prompt_tokens: int) -> bool:
        """Whether the prompt's blocks fit in the pool above its admission watermark at all.

        vLLM 0.6's block manager answers ``AllocStatus.NEVER`` to a prompt needing more blocks
        than ``num_gpu_blocks - watermark_blocks``, and its scheduler then drops the request
        (``FINISHED_IGNORED``: a warning, no token). Start-up ensures ``max_model_len`` fits
        the whole pool, so only V0's 1 % watermark leaves such prompts; V1 has none."""
        pool = self.instance.scheduler.pool
        return pool.blocks_for(prompt_tokens) <= pool.num_blocks - pool.watermark_blocks

    def ignored(self, prompt_tokens: int, max_tokens: int) -> TokenStream:
        """The stream of a request the engine will never run: finished, without a token."""
        request = Request(next(self._ids), prompt_tokens, max_tokens)
        return TokenStream(request, time.monotonic(), finished=True)

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        arrival_s: float | None = None,
        **request_fields: Any,
    ) -> TokenStream:
        """Queue a request that arrived at ``arrival_s`` (monotonic; default now). It joins the
        first step that starts at or after then, unless that step was already formed when the
        request was submitted (then the next one). ``request_fields`` go to the engine's
        ``Request`` (a KV consumer's ``num_computed`` or ``receive_ms``, ``emulator.disagg``)."""
        request = Request(next(self._ids), prompt_tokens, max_tokens, **request_fields)
        stream = TokenStream(request, time.monotonic() if arrival_s is None else arrival_s)
        self._arrivals.append(stream)
        self._wake.set()
        return stream

    def abort(self, stream: TokenStream) -> None:
        """The client went away: free the request's blocks before the next step."""
        if not stream.finished:
            self._aborted.append(stream)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        instance = self.instance
        start_s: float | None = None  # None: idle
        last_end_s = -math.inf
        while True:
            if start_s is None:
                while not self._arrivals:
                    self._wake.clear()
                    await self._wake.wait()
                start_s = max(min(s.arrival_s for s in self._arrivals), last_end_s)
            self._admit(start_s)
            self._apply_aborts()
            if not instance.has_work():
                start_s = None
                continue
            result = instance.step()
            self._mark_scheduled(start_s)
            end_s = start_s + result.duration_s
            if result.num_received and self.receive_hook is not None:
                end_s = await self.receive_hook(start_s, result)
            self.recent_steps.append((start_s, end_s))
            delay = end_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.release_hook is not None:
                end_s = await self.release_hook(result, end_s)
            self._release(result.emitted, result.finished, end_s, result.num_preempted)
            start_s = last_end_s = end_s

    def _admit(self, start_s: float) -> None:
        """Add the requests that arrived by ``start_s``, first come first served (submission
        order can differ from arrival order: a long body takes longer to read)."""
        arrived = [s for s in self._arrivals if s.arrival_s <= start_s]
        if not arrived:
            return
        self._arrivals = [s for s in self._arrivals if s.arrival_s > start_s]
        for stream in sorted(arrived, key=lambda s: s.arrival_s):
            self._streams[stream.request.request_id] = stream
            self._unscheduled.append(stream)
            self.instance.add_request(stream.request, (start_s - stream.arrival_s) * 1e3)

    def _mark_scheduled(self, start_s: float) -> None:
        """The requests this step began computing were scheduled at its start."""
        if not self._unscheduled:
            return
        waiting = []
        for stream in self._unscheduled:
            request = stream.request
            if request.num_computed or request.num_generated:
                stream.scheduled_s = start_s
            elif not stream.finished:
                waiting.append(stream)
        self._unscheduled = waiting

    def _release(
        self, emitted: list[Request], finished: list[Request], end_s: float, preempted: int
    ) -> None:
        counters = self.counters
        counters.steps += 1
        counters.preemptions += preempted
        counters.generation_tokens += len(emitted)
        streams = self._streams
        for request in emitted:
            if request.num_generated == 1:
                counters.prompt_tokens += request.prompt_tokens
            stream = streams.get(request.request_id)
            if stream is not None:
                stream.due_s.append(end_s)
                stream.released.set()
        for request in finished:
            stream = streams.pop(request.request_id, None)
            if stream is not None:
                stream.finished = True
                stream.released.set()
                if stream.due_s:  # vLLM observes a request's histograms when it finishes
                    self._observe(stream)

    def _observe(self, stream: TokenStream) -> None:
        counters = self.counters
        counters.decode_time_s += stream.due_s[-1] - stream.due_s[0]
        counters.finished_generation_tokens += len(stream.due_s)
        counters.finished += 1
        if stream.scheduled_s is not None:
            counters.prefill_time_s += stream.due_s[0] - stream.scheduled_s
            counters.prefills += 1

    def _apply_aborts(self) -> None:
        for stream in self._aborted:
            if stream.finished:
                continue
            if self._streams.pop(stream.request.request_id, None) is not None:
                self.instance.abort(stream.request)
            else:  # still queued for admission
                self._arrivals.remove(stream)
            stream.finished = True
        self._aborted.clear()
