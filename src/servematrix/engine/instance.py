"""One engine instance: scheduler + KV pool + step-time model + jitter, with no clock.

The caller owns time. It adds requests when they arrive, calls :meth:`EngineInstance.step`
when the instance is idle and has work, and treats the returned tokens as produced
``duration_s`` later. The simulator advances a virtual clock by that duration; the emulator
sleeps for it. Both therefore run the very same engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from servematrix.engine.scheduler import Request, Scheduler
from servematrix.engine.steptime import StepBatch, StepTimeModel

JITTER_BLOCK = 4096
STEP_CACHE_ENTRIES = 1 << 16
"""Step times are memoised per batch shape (fixed-length workloads repeat shapes); the cache
is dropped when it grows past this many shapes so long runs stay bounded in memory."""


STRAGGLER_MEAN_EXTRA = 1.0
"""A straggling step takes (1 + Exp(mean 1)) times its duration: on average twice as long."""


class Jitter:
    """Seeded multiplicative step-time noise: lognormal with mean 1 and the given CV, times a
    rare straggler factor (a step hit by a host hiccup: Python garbage collection in the engine
    process, which vLLM V1 works around with ``gc.freeze``, OS scheduling, a slow sampler
    synchronisation) with probability ``straggler_probability``.

    Draws are made in blocks so a step costs one list index; ``cv == 0`` gives exactly 1 and
    no stragglers (the deterministic mode of the tests).
    """

    def __init__(
        self, cv: float, seed: int | np.random.SeedSequence, straggler_probability: float = 0.0
    ):
        if cv < 0:
            raise ValueError(f"jitter_cv must be >= 0, got {cv}")
        if not 0 <= straggler_probability < 1:
            raise ValueError(
                f"straggler_probability must be in [0, 1), got {straggler_probability}"
            )
        self.cv = cv
        self.straggler_probability = straggler_probability if cv else 0.0
        sigma2 = float(np.log1p(cv * cv))
        self._sigma = sigma2**0.5
        self._mu = -sigma2 / 2
        self._rng = np.random.default_rng(seed)
        self._block: list[float] = []
        self._next = 0

    def factor(self) -> float:
        if self.cv == 0:
            return 1.0
        if self._next >= len(self._block):
            self._refill()
        value = self._block[self._next]
        self._next += 1
        return value

    def peek(self, count: int) -> list[float]:
        """The next ``count`` factors without consuming them (see :meth:`skip`)."""
        if self.cv == 0:
            return [1.0] * count
        while len(self._block) - self._next < count:
            self._block = self._block[self._next :] + self._draw()
            self._next = 0
        return self._block[self._next : self._next + count]

    def skip(self, count: int) -> None:
        """Consume ``count`` factors, as ``count`` calls of :meth:`factor` would."""
        if self.cv:
            self._next += count

    def _refill(self) -> None:
        self._block = self._draw()
        self._next = 0

    def _draw(self) -> list[float]:
        rng = self._rng
        factors = rng.lognormal(self._mu, self._sigma, JITTER_BLOCK)
        if self.straggler_probability:
            hit = rng.random(JITTER_BLOCK) < self.straggler_probability
            factors[hit] *= 1.0 + rng.exponential(STRAGGLER_MEAN_EXTRA, int(hit.sum()))
        return factors.tolist()


@dataclass(slots=True)
class StepResult:
    """What one step did. Its tokens exist ``duration_s`` after the step started."""

    duration_s: float
    emitted: list[Request]
    finished: list[Request]
    num_preempted: int
    num_received: int = 0


@dataclass(slots=True)
class DecodeRun:
    """Several consecutive pure-decode steps: every request in ``requests`` emitted one token
    at each offset of ``step_ends_s`` (seconds after the run started)."""

    step_ends_s: list[float]
    requests: list[Request]
    finished: list[Request]


class EngineInstance:
    """A vLLM instance as a state machine: ``add_request`` any time, ``step`` when idle.

    With ``api_request_ms`` > 0 the instance has an API server in front of its engine, one
    process doing each request's input work (parse, validate, tokenise) in arrival order, so a
    request reaches the scheduler only after its turn. The API server works while the engine
    steps, in the time the step leaves it after taking in the step's output (``api_step_ms``)
    and streaming its tokens (``api_token_ms`` per request in the step): the part of the
    step-time model's host cost that runs beside the engine. A request it finishes during a
    step joins the next one. A request that reaches an
    API server with nothing left to do starts at once: ``add_request``'s ``waited_ms`` (how
    long before the next step it arrived) counts, up to the time the API server was idle at the
    end of the last step, so it joins the next step when that covers its input work, as in
    vLLM, not the one after. With nothing running, a step starts with the API server handing
    over the next request."""

    def __init__(
        self,
        scheduler: Scheduler,
        step_time: StepTimeModel,
        jitter: Jitter,
        api_request_ms: float = 0.0,
        api_token_ms: float = 0.0,
        api_step_ms: float = 0.0,
    ):
        if min(api_request_ms, api_token_ms, api_step_ms) < 0:
            raise ValueError("API server costs must be >= 0")
        self.scheduler = scheduler
        self.step_time = step_time
        self.jitter = jitter
        self.api_request_ms = api_request_ms
        self.api_token_ms = api_token_ms
        self.api_step_ms = api_step_ms
        self._inbox: deque[Request] = deque()  # requests the API server has not handed over
        self._inbox_done_ms = 0.0  # API work already spent on the inbox's first request
        self._api_idle_ms = 0.0  # the API server's idle time at the end of the last step
        self._cache: dict[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], float] = {}
        # Pure-decode runs: base step times of the successive steps from a batch of contexts (a
        # fixed-length workload starts its runs from few distinct batches).
        self._decode_cache: dict[tuple[int, ...], list[float]] = {}
        self.steps = 0

    def _api_beside_ms(self, requests: int) -> float:
        """The API server's work beside a step of ``requests`` requests: taking in its output
        and streaming its tokens."""
        return self.api_step_ms + self.api_token_ms * requests

    def add_request(self, request: Request, waited_ms: float = 0.0) -> None:
        """Queue a request: through the API server when there is one, except a request that
        arrives with its prompt's KV (a disaggregated decode instance's), which passed the API
        server before its KV was pulled (the simulator counts that on its request path).
        ``waited_ms``: how long before the next step starts the request reached the API server
        (the driver adds arrivals between steps)."""
        if request.num_computed or not self.api_request_ms:
            self.scheduler.add(request)
            return
        self.scheduler.check(request)
        if not self._inbox:  # the API server is free: it started on the request on arrival
            done_ms = min(waited_ms, self._api_idle_ms)
            if done_ms >= self.api_request_ms:
                self._api_idle_ms -= self.api_request_ms
                self.scheduler.add(request)
                return
            self._api_idle_ms = 0.0
            self._inbox_done_ms = done_ms
        self._inbox.append(request)

    def abort(self, request: Request) -> None:
        """Drop a request whose client went away: from the API server's inbox if it is still
        there (work spent on it is lost), else from the scheduler, freeing its blocks."""
        if request in self._inbox:
            if self._inbox[0] is request:
                self._inbox_done_ms = 0.0
            self._inbox.remove(request)
        else:
            self.scheduler.abort(request)

    def has_work(self) -> bool:
        scheduler = self.scheduler
        return bool(scheduler.running or scheduler.waiting or self._inbox)

    def decode_run(self, horizon_s: float) -> DecodeRun | None:
        """Run consecutive pure-decode steps while each starts before ``horizon_s`` (the time
        to the caller's next event, which could change the batch); None when the next step is
        not a pure decode of every running request. Same result as calling :meth:`step` that
        many times, at a fraction of the cost."""
        if horizon_s <= 0:  # not even one step starts before the horizon
            return None
        scheduler = self.scheduler
        max_steps = scheduler.decode_run_length()
        if max_steps < 2:
            return None
        requests = list(scheduler.running)
        start = tuple([r.num_computed + 1 for r in requests])
        cache = self._decode_cache
        bases = cache.get(start)
        if bases is None:
            if len(cache) >= STEP_CACHE_ENTRIES:
                cache.clear()
            bases = cache[start] = []
        model = self.step_time
        ends: list[float] = []
        elapsed_ms = 0.0
        horizon_ms = horizon_s * 1e3
        # With requests in the API server, the run ends with the step during which it hands
        # the next one over (that request joins the step after), as single steps would.
        inbox = bool(self._inbox)
        streaming_ms = self._api_beside_ms(len(requests))
        api_left_ms = self.api_request_ms - self._inbox_done_ms
        spare_ms = 0.0
        for offset, factor in enumerate(self.jitter.peek(max_steps)):
            if elapsed_ms >= horizon_ms:
                break
            if offset == len(bases):
                decodes = tuple([c + offset for c in start])
                bases.append(model.step_ms(StepBatch((), decodes)))
            step_ms = bases[offset] * factor
            elapsed_ms += step_ms
            ends.append(elapsed_ms * 1e-3)
            if inbox and step_ms > streaming_ms:
                spare_ms += step_ms - streaming_ms
                if spare_ms >= api_left_ms:
                    break
        self.jitter.skip(len(ends))
        finished = scheduler.advance_decodes(len(ends))
        self.steps += len(ends)
        if inbox:
            self._hand_over(spare_ms)
        else:
            self._api_idle_ms = max(step_ms - streaming_ms, 0.0)
        return DecodeRun(ends, requests, finished)

    def step(self) -> StepResult:
        """Schedule and run one step; the caller must only call it when :meth:`has_work`."""
        scheduler = self.scheduler
        handover_ms = 0.0
        if self._inbox and not (scheduler.running or scheduler.waiting):
            # The engine has nothing until the API server hands over the next request: the step
            # starts with the hand-over. (Requests arriving meanwhile are handed over during
            # the engine's part: a little later than the API server's idle time would allow.)
            handover_ms = self.api_request_ms - self._inbox_done_ms
            self._inbox_done_ms = 0.0
            scheduler.add(self._inbox.popleft())
        scheduled = scheduler.schedule()
        if not scheduled.requests:
            raise RuntimeError(
                "the scheduler could not schedule any request although some are waiting "
                "(a prompt larger than the KV pool above its watermark?)"
            )
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        receive_ms = 0.0
        received = 0
        new_tokens = scheduled.new_tokens  # parallel lists (zip's strict=True costs here)
        for index, request in enumerate(scheduled.requests):
            new = new_tokens[index]
            if request.load_ms:  # its prefix came back from the CPU KV tier before this step
                receive_ms += request.load_ms
                request.load_ms = 0.0
            if request.receive_ms:
                # V0 KV consumer: the prompt's KV arrives inside the forward pass instead of
                # being computed; only the last position's logits are left to compute.
                receive_ms += request.receive_ms
                request.receive_ms = 0.0
                received += 1
                decodes.append(request.num_computed + new)
            elif new == 1 and request.num_generated:
                decodes.append(request.num_computed + 1)
            else:
                prefills.append((new, request.num_computed))
        key = (tuple(prefills), tuple(decodes))  # _base_ms, inlined (once per step)
        base_ms = self._cache.get(key)
        if base_ms is None:
            base_ms = self._base_ms(*key)
        emitted, finished = scheduler.complete(scheduled)
        self.steps += 1
        duration_ms = base_ms * self.jitter.factor() + receive_ms
        spare_ms = duration_ms - self._api_beside_ms(len(scheduled.requests))
        if self._inbox:
            self._hand_over(spare_ms)
        else:
            self._api_idle_ms = max(spare_ms, 0.0)
        duration_s = (handover_ms + duration_ms) * 1e-3
        return StepResult(duration_s, emitted, finished, len(scheduled.preempted), received)

    def _hand_over(self, spare_ms: float) -> None:
        """The API server spends ``spare_ms`` on its inbox, first come first served; the
        requests it finishes wait in the scheduler for the next step."""
        self._api_idle_ms = 0.0
        if spare_ms <= 0:
            return
        done_ms = self._inbox_done_ms + spare_ms
        inbox, cost_ms = self._inbox, self.api_request_ms
        while inbox and done_ms >= cost_ms:
            done_ms -= cost_ms
            self.scheduler.add(inbox.popleft())
        if inbox:
            self._inbox_done_ms = done_ms
        else:
            self._inbox_done_ms, self._api_idle_ms = 0.0, done_ms

    def _base_ms(self, prefills: tuple[tuple[int, int], ...], decodes: tuple[int, ...]) -> float:
        """The model's step time for the batch, memoised by its shape (a plain tuple key: the
        ``StepBatch`` is only built when the model has to be asked)."""
        key = (prefills, decodes)
        base_ms = self._cache.get(key)
        if base_ms is None:
            base_ms = self.step_time.step_ms(StepBatch(prefills, decodes))
            if len(self._cache) >= STEP_CACHE_ENTRIES:
                self._cache.clear()
            self._cache[key] = base_ms
        return base_ms
