"""vLLM-style continuous batching for one instance, in the V0 and V1 flavours; no clock.

Token accounting follows V1 (and is equivalent for V0): a request has ``num_tokens`` = prompt +
generated tokens and ``num_computed`` tokens whose KV is in the cache. A step gives it
``n ≤ num_tokens − num_computed`` new tokens; when its computed tokens reach ``num_tokens`` the
step samples one output token. A prefill is ``num_computed < num_tokens − 1`` or no token
generated yet; a decode computes exactly the last generated token. Recompute preemption frees
the blocks and sets ``num_computed`` to 0, so the request is prefilled again over prompt and
generated tokens, as vLLM does.

Policies (selected by the recipe, see :func:`scheduler_config`):

* ``prefill_first`` (V0 without chunked prefill, ``Scheduler._schedule_default``): waiting
  prompts are admitted whole, FCFS, within the token budget, ``max_num_seqs`` (running requests
  count) and the KV blocks above a 1 % watermark; a step that admits any prompt runs prefills
  only. Otherwise every running request decodes, preempting the most recently admitted request
  when a decode needs a block that is not free.
* ``decode_first`` (V1, and V0 with chunked prefill, ``_schedule_chunked_prefill``): one token
  budget; running requests first in admission order (decodes and unfinished prefill chunks),
  preempting from the back when blocks run out; then waiting requests FCFS while budget, seats
  and blocks last. With ``chunked_prefill`` a prompt may be split to fill the budget; without it
  a prompt that does not fit in what is left of the budget waits for the next step. V1 admits no
  new request in a step that preempted one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from servematrix.engine.hardware import CPU_HOST
from servematrix.engine.kvcache import BlockPool
from servematrix.recipes import recipe_version
from servematrix.spec.matrix import chunks_prefill

DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's ``max_num_seqs`` where the recipe sets no other (``EngineArgs``)."""

V1_MIN_BATCHED_TOKENS = 2048
"""``DEFAULT_MAX_NUM_BATCHED_TOKENS`` in vLLM (``vllm/utils``, "a balance between ITL and TTFT")."""


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str  # "prefill_first" | "decode_first"
    chunked_prefill: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    watermark: float
    preempt_blocks_admission: bool  # V1: no admission in a step that preempted
    prefix_caching: bool = False  # V1: automatic prefix caching (on by default)

    def __post_init__(self) -> None:
        if self.policy not in ("prefill_first", "decode_first"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
        if self.policy == "prefill_first" and self.chunked_prefill:
            raise ValueError("prefill_first is V0 without chunked prefill")


def scheduler_config(
    recipe: str,
    chunked_prefill: bool | None,
    max_model_len: int,
    gpu_name: str,
    max_num_batched_tokens: int | None = None,
) -> SchedulerConfig:
    """vLLM's defaults for an OpenAI API server of the recipe's generation.

    * ``v0`` (vLLM 0.6.x ``SchedulerConfig``): chunked prefill off unless asked for (auto-on only
      above max_model_len 32768); ``max_num_batched_tokens`` 2048 with chunked prefill, else
      ``max(max_model_len, 2048)``; ``max_num_seqs`` 256; prefix caching off.
    * ``v1`` (``EngineArgs._set_default_args_v1`` / ``get_batch_defaults``): chunked prefill on;
      for the API server 8192 tokens and 1024 sequences on GPUs with ≥ 70 GiB that are not A100
      (H100, H200), else 2048 and 256 (PR #17885 excludes A100). With chunked prefill off,
      ``SchedulerConfig`` raises the budget to ``max(max_model_len, 2048)``; automatic prefix
      caching on (``--enable-prefix-caching`` is V1's default, off in V0 0.6.x).

    ``max_num_batched_tokens`` overrides the budget (``--max-num-batched-tokens``); as in vLLM's
    ``SchedulerConfig._verify_args``, without chunked prefill it may not be below
    ``max_model_len``.
    """
    config = _default_scheduler_config(recipe, chunked_prefill, max_model_len, gpu_name)
    if max_num_batched_tokens is None:
        return config
    if not config.chunked_prefill and max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
            f"({max_model_len}). This effectively limits the maximum sequence length to "
            "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
            "max_num_batched_tokens or decrease max_model_len."
        )
    return replace(config, max_num_batched_tokens=max_num_batched_tokens)


def _default_scheduler_config(
    recipe: str, chunked_prefill: bool | None, max_model_len: int, gpu_name: str
) -> SchedulerConfig:
    """vLLM's API-server defaults (``EngineArgs._set_default_args`` in V1) for the recipe."""
    chunked = chunks_prefill(recipe, chunked_prefill, max_model_len)
    defaults = recipe_version(recipe).scheduler
    large = defaults.large_gpu_budget_and_seqs
    if large is not None and gpu_name.startswith(("H100", "H200")):
        budget, seqs = large
    else:
        seqs = defaults.max_num_seqs_on_cpu if gpu_name == CPU_HOST else DEFAULT_MAX_NUM_SEQS
        budget = V1_MIN_BATCHED_TOKENS
    if not chunked:
        budget = max(max_model_len, budget)
    return SchedulerConfig(
        policy="decode_first" if chunked else defaults.unchunked_policy,
        chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        watermark=defaults.watermark,
        preempt_blocks_admission=defaults.preempt_blocks_admission,
        prefix_caching=defaults.prefix_caching,
    )


_ONE_SEGMENT = 1 << 40
"""``prefix_segment_blocks`` 0: a single segment longer than any prefix."""


@dataclass(slots=True, eq=False)
class Request:
    """One request inside an instance. ``receive_ms`` > 0 marks a V0 KV consumer request whose
    prompt KV is received inside the forward pass instead of computed, taking that long.

    ``prefix_chain`` keys the segments of the prompt's first ``prefix_tokens`` tokens that
    other prompts may share (`BlockPool`'s prefix cache): ``prefix_segment_blocks`` blocks each
    (0: one segment for all of them, as the sonnet dataset's preamble); empty for a prompt that
    shares nothing (random token ids). With prefix caching, ``shared_blocks`` of the request's
    ``num_blocks`` belong to the cache, not to it; ``load_ms`` is the time to load the part of
    its prefix that came back from the CPU KV tier (``kvcache.CpuKvTier``), paid by the step
    that runs its prefill. A request preempted with prefix caching on left its own computed
    blocks, from block ``retained_from_block`` on, cached in the pool (`BlockPool.retain`)."""

    request_id: int
    prompt_tokens: int
    max_tokens: int
    num_computed: int = 0
    num_generated: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    receive_ms: float = 0.0
    prefix_chain: tuple[int, ...] = ()
    prefix_tokens: int = 0
    prefix_segment_blocks: int = 0
    shared_blocks: int = 0
    load_ms: float = 0.0
    retained_from_block: int = 0

    @property
    def segment_blocks(self) -> int:
        return self.prefix_segment_blocks or _ONE_SEGMENT

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_generated


@dataclass(slots=True)
class ScheduledStep:
    """The requests of one step and how many new tokens each computes (parallel lists)."""

    requests: list[Request] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Waiting and running queues of one instance over a :class:`BlockPool`."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self._prefill_first = config.policy == "prefill_first"
        self.pool = pool
        self._prefix_caching = config.prefix_caching
        self.prefix_queries_tokens = 0  # vLLM's prefix_cache_queries: prompt tokens looked up
        self.prefix_hits_tokens = 0  # prefix_cache_hits: of them, found in the cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        pool = self.pool
        if request.prompt_tokens + request.max_tokens > pool.num_blocks * pool.block_size:
            self.check(request)  # raises; the test is inlined for the others
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """Refuse a request that needs more KV blocks than the whole pool has."""
        pool = self.pool
        tokens = request.prompt_tokens + request.max_tokens
        if tokens > pool.num_blocks * pool.block_size:
            raise ValueError(
                f"request {request.request_id} needs {pool.blocks_for(tokens)} KV blocks but "
                f"the pool has {pool.num_blocks}"
            )

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def abort(self, request: Request) -> None:
        """Drop a request that has not finished (its client went away) and free its blocks."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
        self._release(request)
        self._take_retained(request)

    def schedule(self) -> ScheduledStep:
        config = self.config
        step = ScheduledStep([], [], [])
        if self._prefill_first:
            self._admit_whole_prompts(step)
            if not step.requests:
                self._schedule_running(step, config.max_num_batched_tokens)
            return step
        budget = self._schedule_running(step, config.max_num_batched_tokens)
        if self.waiting and not (step.preempted and config.preempt_blocks_admission):
            self._admit_waiting(step, budget)
        return step

    def complete(self, step: ScheduledStep) -> tuple[list[Request], list[Request]]:
        """Apply a finished step: advance computed tokens, sample, free finished requests.

        Returns (requests that emitted a token, requests that finished)."""
        emitted: list[Request] = []
        finished: list[Request] = []
        caching = self._prefix_caching
        new_tokens = step.new_tokens  # parallel lists (zip's strict=True costs here)
        for index, request in enumerate(step.requests):
            request.num_computed += new_tokens[index]
            if caching and request.prefix_chain:
                self._cache_computed_prefix(request)
            if request.num_computed == request.prompt_tokens + request.num_generated:
                request.num_generated += 1
                emitted.append(request)
                if request.num_generated >= request.max_tokens:
                    finished.append(request)
        if finished:
            self._finish(finished)
        return emitted, finished

    def decode_run_length(self) -> int:
        """How many steps may run as pure decodes of every running request with nothing else to
        decide: 0 unless nothing waits, all running requests are decoding and the KV blocks
        they grow into are free; otherwise steps until the first of them finishes."""
        if self.waiting or not self.running:
            return 0
        steps = 1 << 30
        for request in self.running:
            left = request.max_tokens - request.num_generated
            if (
                request.num_computed != request.prompt_tokens + request.num_generated - 1
                or request.num_generated == 0
            ):
                return 0
            if left < steps:
                steps = left
        pool = self.pool
        block_size = pool.block_size
        extra = 0
        for request in self.running:  # blocks each request grows into (ceiling division)
            extra += -(-(request.num_computed + steps) // block_size) - request.num_blocks
        return steps if extra <= pool.free_blocks else 0

    def advance_decodes(self, steps: int) -> list[Request]:
        """Apply ``steps`` decode steps of every running request (after
        :meth:`decode_run_length` allowed them); returns the requests that finished."""
        pool = self.pool
        block_size = pool.block_size
        finished = []
        for request in self.running:
            request.num_computed += steps
            request.num_generated += steps
            extra = -(-request.num_computed // block_size) - request.num_blocks
            if extra > 0:
                pool.allocate(extra)
                request.num_blocks += extra
            if request.num_generated >= request.max_tokens:
                finished.append(request)
        if finished:
            self._finish(finished)
        return finished

    def _finish(self, finished: list[Request]) -> None:
        """Free the requests that have just generated their last token and drop them from the
        running list (only they have all their tokens)."""
        pool = self.pool
        for request in finished:
            if request.shared_blocks:
                self._release(request)
            else:  # _release, inlined
                pool.free_blocks += request.num_blocks
                request.num_blocks = 0
        running = self.running
        if len(finished) == len(running):  # all of them (the finished are running requests)
            self.running = []
        else:
            self.running = [r for r in running if r.num_generated < r.max_tokens]

    def _release(self, request: Request) -> None:
        """Give a request's own blocks back to the pool; its cached prefix blocks stay cached."""
        self.pool.free_blocks += request.num_blocks - request.shared_blocks  # pool.free, inlined
        if request.shared_blocks:
            self.pool.release_prefix(
                request.prefix_chain, request.segment_blocks, request.shared_blocks
            )
            request.shared_blocks = 0
        request.num_blocks = 0

    def _use_cached_prefix(self, request: Request) -> None:
        """At admission of a request with nothing computed: take the cached blocks of its prefix
        chain as computed (V1 recomputes at least the prompt's last token), after loading what
        the CPU KV tier holds of it beyond the GPU cache (with ``--kv-offloading-size``). Counts
        the lookup as V1's exported counters do: every lookup of a request never preempted (a
        preempted one's are counted apart and not exported, as it would hit its own blocks
        again), its hits in the GPU cache only (the offloading connector's are its own)."""
        pool = self.pool
        num_tokens = request.prompt_tokens + request.num_generated
        counted = not request.num_preemptions
        if counted:
            self.prefix_queries_tokens += num_tokens
        chain = request.prefix_chain
        if not chain:
            return
        segment_blocks = request.segment_blocks
        prefix_blocks = request.prefix_tokens // pool.block_size
        last = (num_tokens - 1) // pool.block_size
        hit = local = min(pool.prefix_hit_blocks(chain, segment_blocks, prefix_blocks), last)
        if pool.cpu is not None:
            load_ms = pool.load_offloaded(chain, segment_blocks, min(prefix_blocks, last))
            if load_ms:
                request.load_ms += load_ms
                hit = min(pool.prefix_hit_blocks(chain, segment_blocks, prefix_blocks), last)
        if hit > 0:
            pool.use_prefix(chain, segment_blocks, hit)
            request.num_computed = hit * pool.block_size
            request.num_blocks = request.shared_blocks = hit
        if counted:
            self.prefix_hits_tokens += local * pool.block_size

    def _use_retained(self, request: Request) -> None:
        """At an admission attempt of a preempted request: count the own blocks it left cached
        (`BlockPool.retain`) as computed when its prefix hit reaches where they start (V1
        recomputes at least the last token). They are still free blocks: the admission
        allocates them with the rest and then drops the record (`_take_retained`); a failed
        attempt undoes the count (`_undo_retained`)."""
        pool = self.pool
        if request.num_blocks != request.retained_from_block:
            pool.take_retained(request.request_id)  # its prefix is not back: unreachable
            return
        last = (request.prompt_tokens + request.num_generated - 1) // pool.block_size
        own = min(pool.retained[request.request_id], last - request.num_blocks)
        request.num_computed = (request.num_blocks + max(own, 0)) * pool.block_size

    def _take_retained(self, request: Request) -> None:
        if request.request_id in self.pool.retained:
            self.pool.take_retained(request.request_id)

    def _undo_retained(self, request: Request) -> None:
        if request.request_id in self.pool.retained:
            request.num_computed = request.num_blocks * self.pool.block_size

    def _cache_computed_prefix(self, request: Request) -> None:
        """Hand the request's newly computed full prefix blocks to the cache where they extend
        what it holds (`BlockPool.cache_prefix`)."""
        pool = self.pool
        full = min(request.num_computed, request.prefix_tokens) // pool.block_size
        if full > request.shared_blocks:
            request.shared_blocks = pool.cache_prefix(
                request.prefix_chain, request.segment_blocks, request.shared_blocks, full
            )

    def _grow(self, request: Request, new_tokens: int) -> bool:
        """Allocate the blocks ``request`` needs to hold ``new_tokens`` more tokens."""
        pool = self.pool
        extra = -(-(request.num_computed + new_tokens) // pool.block_size) - request.num_blocks
        if extra <= 0:
            return True
        if pool.allocate(extra):
            request.num_blocks += extra
            return True
        return False

    def _preempt_last(self, step: ScheduledStep) -> Request:
        victim = self.running.pop()
        shared = victim.shared_blocks
        own = victim.num_computed // self.pool.block_size - shared
        self._release(victim)
        if self._prefix_caching and own > 0:
            victim.retained_from_block = shared
            self.pool.retain(victim.request_id, own)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        step.preempted.append(victim)
        return victim

    def _schedule_running(self, step: ScheduledStep, budget: int) -> int:
        """Schedule the running requests in admission order; returns the budget left."""
        chunked = self.config.chunked_prefill
        block_size = self.pool.block_size
        requests, new_tokens = step.requests, step.new_tokens
        # Preemption pops from the back of the running list: its iterator sees that, as it
        # checks the list's length at each step.
        for request in self.running:
            if budget <= 0:
                break
            need = request.prompt_tokens + request.num_generated - request.num_computed
            new = need if need <= budget else (budget if chunked else 0)
            if new == 0:
                break
            # Most steps fit in the blocks a request holds; only growth needs the pool.
            if -(-(request.num_computed + new) // block_size) > request.num_blocks:
                while not self._grow(request, new):
                    if self._preempt_last(step) is request:
                        return budget
            requests.append(request)
            new_tokens.append(new)
            budget -= new
        return budget

    def _admit_whole_prompts(self, step: ScheduledStep) -> None:
        """V0 prefill admission: whole prompts, FCFS, budget, seats and the watermark."""
        config, pool, waiting = self.config, self.pool, self.waiting
        budget = config.max_num_batched_tokens
        seats = config.max_num_seqs - len(self.running)
        while waiting and seats > 0:
            request = waiting[0]
            if self._prefix_caching:
                if not request.num_blocks:
                    self._use_cached_prefix(request)
                if request.request_id in pool.retained:
                    self._use_retained(request)
            num_tokens = request.prompt_tokens + request.num_generated
            need = num_tokens - request.num_computed
            blocks = pool.blocks_for(num_tokens) - request.num_blocks
            if need > budget or not pool.can_admit(blocks):
                self._undo_retained(request)
                break
            self._take_retained(request)
            self._admit(step, need, blocks)
            budget -= need
            seats -= 1

    def _admit(self, step: ScheduledStep, need: int, blocks: int) -> None:
        """Move the head of the waiting queue into the running batch with ``need`` new tokens."""
        request = self.waiting.popleft()
        self.pool.allocate(blocks)
        request.num_blocks += blocks
        self.running.append(request)
        step.requests.append(request)
        step.new_tokens.append(need)

    def _admit_waiting(self, step: ScheduledStep, budget: int) -> None:
        """Admit waiting requests FCFS into what is left of the token ``budget``.

        `_admit` and the pool's ``can_admit`` / ``allocate`` inlined for the common case of
        enough free blocks above the watermark (the simulator's hot path); the pool's methods
        decide the rest (eviction of cached prefixes, refusal)."""
        config, pool, waiting = self.config, self.pool, self.waiting
        seats = config.max_num_seqs - len(self.running)
        chunked, caching, block_size = config.chunked_prefill, self._prefix_caching, pool.block_size
        running, requests, new_tokens = self.running, step.requests, step.new_tokens
        while waiting and seats > 0 and budget > 0:
            request = waiting[0]
            if caching:
                if not request.num_blocks:
                    self._use_cached_prefix(request)
                if request.request_id in pool.retained:
                    self._use_retained(request)
            need = request.prompt_tokens + request.num_generated - request.num_computed
            if need > budget:
                if not chunked:
                    self._undo_retained(request)
                    break
                need = budget
            blocks = -(-(request.num_computed + need) // block_size) - request.num_blocks
            free = pool.free_blocks
            if free >= blocks + pool.watermark_blocks:
                if pool.retained:
                    self._take_retained(request)
                free -= blocks
                pool.free_blocks = free
                if free < pool.min_free_blocks:
                    pool.min_free_blocks = free
                if free < pool.retained_blocks:
                    pool.trim_retained()
            elif pool.can_admit(blocks):
                self._take_retained(request)
                pool.allocate(blocks)
            else:
                self._undo_retained(request)
                break
            waiting.popleft()
            request.num_blocks += blocks
            running.append(request)
            requests.append(request)
            new_tokens.append(need)
            budget -= need
            seats -= 1
