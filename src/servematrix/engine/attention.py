"""What V1's FlashAttention-2 path costs for the decodes of a step that also prefills.

vLLM V1's FlashAttention backend runs one ``flash_attn_varlen_func`` over the whole batch, with
``max_seqlen_q`` the longest query of the step and no split of decodes from prefills
(``vllm/v1/attention/backends/flash_attn.py``, ``FlashAttentionImpl.forward``; cascade attention
only for a prefix common to every running request of >= 256 tokens). FlashAttention-2 (the
version vLLM picks below compute capability 9.0: ``fa_utils.get_flash_attn_version``) packs the
query heads that share a KV head into one tile, and splits long contexts across CTAs, only when
``max_seqlen_q == 1`` (``mha_varlen_fwd`` in ``vllm-project/flash-attention``
``csrc/flash_attn/flash_api.cpp`` @ 617264c1: ``seqlenq_ngroups_swapped = max_seqlen_q == 1 &&
num_heads > num_heads_k && ...``). In a mixed step the paged call runs the split-KV kernel with
one split (``run_mha_fwd(params, stream, paged_KV)``; ``num_splits > 1 is not supported for
varlen paged KV``), whose grid is ``(num_m_block, batch, heads)`` and whose query tile is 64
rows for every head size (``csrc/flash_attn/src/flash_fwd_launch_template.h``,
``run_mha_fwd_splitkv_dispatch`` / ``run_mha_fwd_splitkv_align``: ``kBlockM = 64``). So:

* each query head of a decode gets its own CTA, which multiplies a 64-row tile, one row of it
  real, against the whole context (``compute_attn_1rowblock_splitkv`` runs the tile's GEMMs for
  every row): ``4 x 64 x head_dim`` FLOP per context token and query head, at best FA2's 73 % of
  the dense peak (Dao, "FlashAttention-2", 2023: "50-73 % of the theoretical maximum FLOPs/s on
  A100");
* the query heads of one KV head (``bidh / h_h_k_ratio``) are consecutive in ``blockIdx.z``, the
  slowest grid index, so between two reads of a decode's KV the GPU streams one KV head's slice of
  every sequence of the step (``sum of contexts x 2 x head_dim x 2 bytes``, K and V). A reread
  hits the L2 when that slice fits in one L2 partition (`GpuSpec.l2_partition_bytes`: every SM
  reads the slice, so each partition holds its own copy) and misses it beyond, where a cyclic
  stream larger than an LRU cache finds nothing: the KV is then read from HBM once per query
  head, ``num_attention_heads / num_kv_heads`` times.

The decodes' attention takes the longer of the two; aiconfigurator measures decode attention on
pure decode batches (the packed path) and the roofline counts one read of the KV, so
``WithMixedStepKvReads`` adds the difference. No constant is fitted. FlashAttention-3
(H100/H200) packs GQA for every varlen call (``hopper/heuristics.h``, ``should_pack_gqa``), and
V0 runs its decodes in their own ``flash_attn_with_kvcache`` call, so neither pays this.
"""

from __future__ import annotations

from servematrix.engine.architecture import Architecture
from servematrix.engine.hardware import GpuSpec
from servematrix.engine.kvcache import kv_bytes_per_token_per_gpu
from servematrix.engine.roofline import DEFAULT_EFFICIENCY, EFFICIENCY
from servematrix.engine.steptime import StepBatch, StepTimeModel
from servematrix.recipes import recipe_version

FA3_MIN_COMPUTE_CAPABILITY = 9.0
"""vLLM uses FlashAttention-3 on compute capability 9.x (Hopper), FlashAttention-2 below."""
FA2_SPLITKV_BLOCK_M = 64
"""Query rows per tile of FA2's split-KV kernel, which runs every paged varlen call."""
FA2_PEAK_FRACTION = 0.73
"""FlashAttention-2's best forward throughput on an A100, as a fraction of the dense peak."""


def rereads_decode_kv(gpu: GpuSpec, arch: Architecture, recipe: str) -> bool:
    """Whether a mixed step runs its decodes unpacked: V1's single varlen call on a
    FlashAttention-2 GPU, for a model with grouped (or multi-) query attention."""
    return (
        recipe_version(recipe).mixed_step_single_varlen
        and gpu.compute_capability < FA3_MIN_COMPUTE_CAPABILITY
        and arch.num_attention_heads > arch.num_kv_heads
    )


class WithMixedStepKvReads:
    """A step-time model plus what FlashAttention-2's unpacked decodes cost in a step that also
    prefills (module docstring). A pure-decode or pure-prefill step is unchanged."""

    def __init__(self, model: StepTimeModel, arch: Architecture, gpu: GpuSpec, tp: int):
        self.model = model
        kv_heads_per_rank = max(arch.num_kv_heads / tp, 1.0)  # replicated below one per rank
        query_heads_per_rank = arch.num_attention_heads / tp
        self.query_heads_per_kv_head = query_heads_per_rank / kv_heads_per_rank
        kv_bytes_per_token = kv_bytes_per_token_per_gpu(arch, tp)
        self.slice_bytes_per_token = kv_bytes_per_token / (arch.num_layers * kv_heads_per_rank)
        self.l2_bytes = gpu.l2_partition_bytes
        mbu = EFFICIENCY.get(gpu.name, DEFAULT_EFFICIENCY).mbu_max
        self.read_ms_per_token = kv_bytes_per_token * 1e3 / (gpu.hbm_bytes_per_s * mbu)
        tile_flop_per_token = (
            4 * FA2_SPLITKV_BLOCK_M * arch.head_dim * query_heads_per_rank * arch.num_layers
        )
        self.tile_ms_per_token = (
            tile_flop_per_token * 1e3 / (gpu.bf16_flops_per_s * FA2_PEAK_FRACTION)
        )

    @property
    def label(self) -> str:
        ratio = f"{self.query_heads_per_kv_head:.3g}"
        return f"FA2 mixed steps: decode KV x{ratio} beyond L2, 64-row tiles"

    def step_ms(self, batch: StepBatch) -> float:
        ms = self.model.step_ms(batch)
        if batch.decode_contexts and any(new > 1 for new, _ in batch.prefill_chunks):
            ms += self.extra_ms(batch)
        return ms

    def extra_ms(self, batch: StepBatch) -> float:
        """The decodes' attention in the mixed step less the one read of their KV the step
        model counts: the longer of the padded tiles' compute and the HBM reads, one per query
        head when a KV head's slice of the step overflows an L2 partition, else one."""
        decode_tokens = sum(batch.decode_contexts)
        step_tokens = decode_tokens + sum(new + past for new, past in batch.prefill_chunks)
        overflows = step_tokens * self.slice_bytes_per_token > self.l2_bytes
        reads = self.query_heads_per_kv_head if overflows else 1.0
        once_ms = self.read_ms_per_token * decode_tokens
        return max(reads * once_ms, self.tile_ms_per_token * decode_tokens) - once_ms
