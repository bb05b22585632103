"""The paged KV cache of one instance: how many blocks fit, and a pool that hands them out.

vLLM sizes its cache at start-up: of ``gpu_memory_utilization × total memory`` per GPU it
subtracts the weights of that GPU's tensor-parallel shard and the peak activation memory of a
profiling forward pass, and divides the rest into blocks of ``block_size`` tokens
(``vllm/worker/worker.py:determine_num_available_blocks`` in V0, ``gpu_worker.py`` in V1). The
pool is a counter, not a list of block objects: the scheduler only needs to know whether a
request's next tokens fit.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from servematrix.engine.architecture import Architecture
from servematrix.engine.hardware import GIB, GpuSpec
from servematrix.recipes import recipe_version

BLOCK_SIZE_TOKENS = 16
"""vLLM's default ``--block-size`` on CUDA (V0 and V1)."""

RUNTIME_RESERVE_GIB = 0.5
"""cuBLAS workspaces, attention-backend buffers and allocator fragmentation per GPU
(approximate; published V1 logs show 0.02-0.61 GiB of such non-torch growth). The recipes'
vLLM versions measure from a snapshot taken after the CUDA context exists, so the context
itself is not counted (V1 0.8.2/0.8.3 did count it: docs/engine-model.md, "KV memory and
quantization")."""

TP_RESERVE_GIB = 0.5
"""NCCL and custom all-reduce buffers per GPU when TP > 1 (approximate). V0 counts them (its
snapshot is taken before the distributed init); V1 takes it after NCCL is initialized."""

CUDA_GRAPH_RESERVE_GIB = 0.5
"""CUDA graphs captured for decode batch sizes 1..512 (vLLM logs 0.3-1 GiB; approximate). V1
subtracts its estimate of them from 0.21 on (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``,
default 1; none under ``--enforce-eager``); V0 captures them after sizing the cache."""


def counted_reserve_gib(recipe: str, tp: int, enforce_eager: bool) -> float:
    """What the recipe's vLLM subtracts from its budget beyond weights and activations: the
    ``v0`` pin (0.6.6.post1) counts the TP buffers, not the graphs; the ``v1`` pin (0.33) the
    graphs, not the TP buffers."""
    version = recipe_version(recipe)
    reserve = RUNTIME_RESERVE_GIB
    if version.budget_counts_tp_buffers and tp > 1:
        reserve += TP_RESERVE_GIB
    if version.budget_counts_cuda_graphs and not enforce_eager:
        reserve += CUDA_GRAPH_RESERVE_GIB
    return reserve


ACTIVATION_COPIES = 4
"""Hidden-sized activation buffers live at the peak of a forward pass (residual, normed input,
attention output, MLP output); the MLP's gate/up output is counted separately."""


class ModelDoesNotFitError(RuntimeError):
    """The configuration cannot serve the model (vLLM fails at start-up the same way)."""


@dataclass(frozen=True)
class KvMemoryPlan:
    """Per-GPU memory budget of one instance (GiB) and the block count that results."""

    total_gib: float
    usable_gib: float
    weights_gib: float
    activation_gib: float
    kv_cache_gib: float
    kv_bytes_per_token_per_gpu: float
    block_size_tokens: int
    num_blocks: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size_tokens


def kv_bytes_per_token_per_gpu(arch: Architecture, tp: int, dtype_bytes: int = 2) -> float:
    """K and V of one token on one GPU: KV heads are split across TP ranks, or replicated when
    there are fewer KV heads than ranks (vLLM replicates them)."""
    heads_per_gpu = max(arch.num_kv_heads / tp, 1.0)
    return 2 * arch.num_layers * heads_per_gpu * arch.head_dim * dtype_bytes


def activation_bytes_per_gpu(
    arch: Architecture, tp: int, max_num_batched_tokens: int, max_num_seqs: int
) -> float:
    """Peak activation memory of vLLM's profiling run: a forward pass of
    ``max_num_batched_tokens`` tokens over ``max_num_seqs`` sequences, fp32 logits for each."""
    per_token = 2 * (
        ACTIVATION_COPIES * arch.hidden_size + 3 * arch.intermediate_size / tp
    )  # bf16: hidden buffers + gate/up output (2I/tp) + activation output (I/tp)
    logits = max_num_seqs * arch.vocab_size * 4
    return max_num_batched_tokens * per_token + logits


def plan_kv_memory(
    *,
    model_label: str,
    arch: Architecture,
    weight_bytes: float,
    gpu: GpuSpec,
    tp: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    reserve_gib: float,
) -> KvMemoryPlan:
    """Size the KV pool of one instance (``reserve_gib``: `counted_reserve_gib`); raise
    :class:`ModelDoesNotFitError` like vLLM would."""
    usable = gpu.memory_bytes * gpu_memory_utilization
    weights = weight_bytes / tp
    reserve = reserve_gib * GIB
    activation = activation_bytes_per_gpu(arch, tp, max_num_batched_tokens, max_num_seqs)
    if weights + reserve > usable:
        raise ModelDoesNotFitError(
            f"{model_label} needs {weights / GIB:.1f} GiB of weights per GPU at TP {tp} but only "
            f"{(usable - reserve) / GIB:.1f} GiB are available on {gpu.name} at "
            f"gpu_memory_utilization {gpu_memory_utilization} "
            f"({usable / GIB:.1f} GiB usable, {reserve / GIB:.1f} GiB runtime reserve); "
            "use more tensor parallelism, a quantized variant or a larger GPU"
        )
    kv_bytes = usable - weights - reserve - activation
    per_token = kv_bytes_per_token_per_gpu(arch, tp)
    num_blocks = math.floor(max(kv_bytes, 0.0) / (per_token * BLOCK_SIZE_TOKENS))
    if num_blocks <= 0:
        # vLLM V0: "No available memory for the cache blocks. Try increasing
        # `gpu_memory_utilization` when initializing the engine."
        raise ModelDoesNotFitError(
            f"{model_label} on {gpu.name} at TP {tp}: no available memory for the cache blocks "
            f"({weights / GIB:.1f} GiB weights + {activation / GIB:.1f} GiB activations + "
            f"{reserve / GIB:.1f} GiB reserve of {usable / GIB:.1f} GiB usable). "
            "Try increasing gpu_memory_utilization when initializing the engine."
        )
    capacity = num_blocks * BLOCK_SIZE_TOKENS
    if capacity < max_model_len:
        raise ModelDoesNotFitError(
            f"{model_label} on {gpu.name} at TP {tp}: the model's max seq len ({max_model_len}) "
            "is larger than the maximum number of tokens that can be stored in KV cache "
            f"({capacity}). Try increasing gpu_memory_utilization or decreasing max_model_len "
            "when initializing the engine."
        )
    return KvMemoryPlan(
        total_gib=gpu.memory_gib,
        usable_gib=usable / GIB,
        weights_gib=weights / GIB,
        activation_gib=activation / GIB,
        kv_cache_gib=kv_bytes / GIB,
        kv_bytes_per_token_per_gpu=per_token,
        block_size_tokens=BLOCK_SIZE_TOKENS,
        num_blocks=num_blocks,
    )


HOST_COPY_EFFICIENCY = 0.8
"""Share of the PCIe link's datasheet rate a pinned host-to-device copy reaches (approximate,
not measured here; pinned-memory copies typically reach 75-85 %)."""


@dataclass(frozen=True)
class KvOffload:
    """vLLM's native CPU KV offloading (``--kv-offloading-size``): ``capacity_blocks`` GPU-block
    equivalents in host memory, and the time to load one block back to the GPU."""

    capacity_blocks: int
    load_ms_per_block: float


def kv_offload(plan: KvMemoryPlan, gpu: GpuSpec, tp: int, size_gib: float) -> KvOffload:
    """The host tier of ``size_gib`` GiB in all (vLLM: "the total buffer size summed across all
    TP ranks"), loaded over each GPU's own PCIe link in parallel."""
    if size_gib <= 0:
        raise ValueError(f"--kv-offloading-size must be > 0 GiB, got {size_gib:g}")
    block_bytes = plan.kv_bytes_per_token_per_gpu * plan.block_size_tokens
    capacity = math.floor(size_gib * GIB / tp / block_bytes)
    load_ms = block_bytes / (gpu.host_link_gb_s * 1e9 * HOST_COPY_EFFICIENCY) * 1e3
    return KvOffload(capacity, load_ms)


class CpuKvTier:
    """The prefix blocks vLLM's native offloading keeps in host memory, per segment key of the
    prefix cache (`BlockPool`), least recently used evicted first. Every prefix block the GPU
    cache receives is stored here too (the connector stores each computed full block; the copy
    runs beside the steps, so it costs no step time), so a prefix the GPU evicts can be loaded
    back instead of recomputed."""

    __slots__ = ("blocks", "capacity_blocks", "held_blocks", "load_ms_per_block")

    def __init__(self, offload: KvOffload):
        self.capacity_blocks = offload.capacity_blocks
        self.load_ms_per_block = offload.load_ms_per_block
        self.blocks: OrderedDict[int, int] = OrderedDict()  # segment key -> blocks held
        self.held_blocks = 0  # sum of ``blocks``

    def store(self, key: int, blocks: int) -> None:
        held = self.blocks.pop(key, 0)
        kept = min(max(held, blocks), self.capacity_blocks)
        self.blocks[key] = kept
        self.held_blocks += kept - held
        while self.held_blocks > self.capacity_blocks:
            self.held_blocks -= self.blocks.popitem(last=False)[1]

    def hit_blocks(self, key: int) -> int:
        held = self.blocks.get(key, 0)
        if held:
            self.blocks.move_to_end(key)
        return held

    def clear(self) -> None:
        self.blocks.clear()
        self.held_blocks = 0


class BlockPool:
    """Free-block accounting of one instance; requests hold whole blocks.

    ``watermark_blocks`` is kept free when admitting a new prompt (V0's
    ``BlockSpaceManager`` watermark, 1 % of the pool; V1 has none).

    Automatic prefix caching (V1's default): the full blocks of a shared prompt prefix (a chain
    of segment keys: the sonnet dataset's common preamble is one segment, a Mooncake trace's
    512-token blocks one each, the emulator's prompts one per block) stay in the pool after
    the request that computed them, owned by the cache; later requests with the same keys use
    them instead of computing and allocating them. Cached blocks that no running request uses
    are evicted when an allocation would otherwise fail, as V1 evicts free cached blocks.
    Prompts without a chain (random token ids) never hit, as in vLLM.

    A request preempted with prefix caching on keeps its computed full blocks as free but
    cached (``retain``): V1 frees them into its free queue with their hashes, so when the
    request is admitted again they are hits unless allocations took them meanwhile. The pool
    hands out the other free blocks first and then the retained ones, oldest preemption first
    and each from its tail, as V1 frees a request's blocks tail first (`take_retained`). A
    preempted request keeps beyond its shared prefix only these own blocks; retained blocks are
    taken before cached prefix segments are evicted, where V1 takes the least recently freed.

    ``min_free_blocks`` is the fewest free blocks there have been, so ``peak_used_blocks``
    is the most in use at once; it is updated where blocks are taken, one comparison per
    allocation, which keeps the simulator's hot path as fast as without it.
    """

    __slots__ = (
        "block_size",
        "cached_blocks",
        "cpu",
        "free_blocks",
        "min_free_blocks",
        "num_blocks",
        "prefix_users",
        "retained",
        "retained_blocks",
        "watermark_blocks",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE_TOKENS,
        watermark: float = 0.0,
        offload: KvOffload | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.min_free_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.cached_blocks: dict[int, int] = {}  # segment key -> blocks the cache holds
        self.prefix_users: dict[int, int] = {}  # segment key -> requests using its blocks
        self.retained: dict[int, int] = {}  # preempted request id -> its free cached blocks
        self.retained_blocks = 0  # sum of ``retained``, all of them inside ``free_blocks``
        self.cpu = CpuKvTier(offload) if offload else None

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_admit(self, blocks: int) -> bool:
        """Whether a new prompt needing ``blocks`` may be admitted (respects the watermark)."""
        need = blocks + self.watermark_blocks
        return self.free_blocks >= need or self._evict(need)

    def allocate(self, blocks: int) -> bool:
        """Take ``blocks`` if they are free; False (and nothing taken) otherwise."""
        if blocks > self.free_blocks and not self._evict(blocks):
            return False
        self.free_blocks -= blocks
        if self.free_blocks < self.min_free_blocks:
            self.min_free_blocks = self.free_blocks
        if self.free_blocks < self.retained_blocks:
            self.trim_retained()
        return True

    def free(self, blocks: int) -> None:
        self.free_blocks += blocks

    def retain(self, request_id: int, blocks: int) -> None:
        """A preempted request's ``blocks`` computed full blocks, already freed, stay cached."""
        self.retained[request_id] = blocks
        self.retained_blocks += blocks

    def take_retained(self, request_id: int) -> None:
        """The request is admitted again (holding what it hit) or gone: drop its record."""
        self.retained_blocks -= self.retained.pop(request_id)

    def trim_retained(self) -> None:
        """Allocations have taken free blocks the retained ones counted on: shorten the
        records, oldest first, each from its tail, until they fit in the free blocks."""
        excess = self.retained_blocks - self.free_blocks
        self.retained_blocks -= excess
        retained = self.retained
        for request_id in list(retained):
            blocks = retained[request_id]
            if blocks > excess:
                retained[request_id] = blocks - excess
                return
            del retained[request_id]
            excess -= blocks

    @property
    def used_blocks(self) -> int:
        """Blocks not free: held by requests or by the prefix cache (the emulator's
        ``kv_cache_usage_perc`` is ``used_blocks / num_blocks``)."""
        return self.num_blocks - self.free_blocks

    @property
    def peak_used_blocks(self) -> int:
        """The most blocks that were in use at once (``used_blocks`` at its peak)."""
        return self.num_blocks - self.min_free_blocks

    # --- prefix cache ---------------------------------------------------------------------
    # A request's prefix is a chain of segments (`Request.prefix_chain`): segment i is its
    # blocks [i·S, (i+1)·S) of S = ``segment_blocks``, keyed so that equal keys mean equal tokens
    # up to the segment's end, as vLLM chains each block's hash to the blocks before it. The
    # cache holds the leading blocks of each segment it has seen; keys are kept in the order
    # they were last used, so eviction takes the least recently used first, as V1's free queue.

    def prefix_hit_blocks(
        self, chain: tuple[int, ...], segment_blocks: int, prefix_blocks: int
    ) -> int:
        """Leading blocks of the first ``prefix_blocks`` of ``chain`` the cache holds."""
        cached = self.cached_blocks
        hit = 0
        for key in chain:
            want = min(segment_blocks, prefix_blocks - hit)
            have = cached.get(key, 0)
            if have < want:
                return hit + have
            hit += want
            if hit >= prefix_blocks:
                break
        return hit

    def use_prefix(self, chain: tuple[int, ...], segment_blocks: int, blocks: int) -> None:
        """A request takes the first ``blocks`` cached blocks of ``chain`` (most recently used)."""
        cached, users = self.cached_blocks, self.prefix_users
        for key in chain[: -(-blocks // segment_blocks)]:
            users[key] = users.get(key, 0) + 1
            cached[key] = cached.pop(key)

    def release_prefix(self, chain: tuple[int, ...], segment_blocks: int, blocks: int) -> None:
        users = self.prefix_users
        for key in chain[: -(-blocks // segment_blocks)]:
            users[key] -= 1

    def cache_prefix(
        self, chain: tuple[int, ...], segment_blocks: int, shared: int, full: int
    ) -> int:
        """A request that shares its first ``shared`` blocks with the cache and has computed
        ``full`` prefix blocks hands the new ones to the cache where they extend what it holds
        (where another request cached further meanwhile they stay the request's own copies);
        returns how many of the request's blocks the cache now holds."""
        cached, users = self.cached_blocks, self.prefix_users
        while shared < full:
            index = shared // segment_blocks
            start = index * segment_blocks
            key = chain[index]
            have = cached.get(key, 0)
            if have != shared - start:
                break
            if shared == start:
                users[key] = users.get(key, 0) + 1
            add = min(full, start + segment_blocks) - shared
            cached[key] = have + add
            if self.cpu is not None:
                self.cpu.store(key, have + add)
            shared += add
        return shared

    def load_offloaded(
        self, chain: tuple[int, ...], segment_blocks: int, want_blocks: int
    ) -> float:
        """Bring the leading blocks of ``chain`` the host tier holds beyond what the GPU cache
        holds back into the GPU cache, up to ``want_blocks`` in all; the load's time in ms (0:
        nothing to load, or no free blocks for it)."""
        cpu, cached, users = self.cpu, self.cached_blocks, self.prefix_users
        if cpu is None:
            return 0.0
        walked, loads, hit, load = [], [], 0, 0
        for key in chain:
            want = min(segment_blocks, want_blocks - hit)
            if want <= 0:
                break
            have = cached.get(key, 0)
            got = max(have, min(cpu.hit_blocks(key), want))
            walked.append(key)
            if got > have:
                loads.append((key, got))
                load += got - have
            hit += got
            if got < want:
                break
        if not load:
            return 0.0
        pinned = [key for key in walked if key in cached]
        for key in pinned:  # its GPU blocks stay while others are evicted for the load
            users[key] = users.get(key, 0) + 1
        taken = self.allocate(load)
        for key in pinned:
            users[key] -= 1
        if not taken:
            return 0.0
        cached.update(loads)
        return load * cpu.load_ms_per_block

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix, as vLLM's ``/reset_prefix_cache``: False, dropping nothing,
        while a running request still uses one."""
        if any(self.prefix_users.get(key) for key in self.cached_blocks):
            return False
        self.free_blocks += sum(self.cached_blocks.values())
        self.cached_blocks.clear()
        self.retained.clear()
        self.retained_blocks = 0
        if self.cpu is not None:
            self.cpu.clear()
        return True

    def _evict(self, need_free: int) -> bool:
        """Free cached segments no running request uses, least recently used first, until
        ``need_free`` blocks are free."""
        users, free, victims = self.prefix_users, self.free_blocks, []
        for key, blocks in self.cached_blocks.items():
            if free >= need_free:
                break
            if not users.get(key):
                victims.append(key)
                free += blocks
        for key in victims:
            del self.cached_blocks[key]
        self.free_blocks = free
        return free >= need_free
