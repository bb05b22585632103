"""What V1's FlashAttention-2 path reads in a step that mixes prefill chunks with decodes.

vLLM V1's FlashAttention backend runs one ``flash_attn_varlen_func`` over the whole batch, with
``max_seqlen_q`` the longest query of the step (``vllm/v1/attention/backends/flash_attn.py``,
``FlashAttentionImpl.forward``). FlashAttention-2 (the version vLLM picks below compute
capability 9.0: ``fa_utils.get_flash_attn_version``) packs the query heads that share a KV head
into one tile, and splits long contexts across CTAs, only when ``max_seqlen_q == 1``
(``mha_varlen_fwd`` in ``vllm-project/flash-attention`` ``csrc/flash_attn/flash_api.cpp``
@ 04325b6798bcc326c86fb35af62d05a9c8c8eceb: ``seqlenq_ngroups_swapped = max_seqlen_q == 1 &&
num_heads > num_heads_k && ...``; vLLM's own comment on the FA2 CUDA-graph support names this
"special max_query_len=1 packed-GQA handling"). In a step with a prefill chunk the kernel's grid
is (query tile, sequence, query head), so every query head of a decoding sequence streams its KV
head's whole context from HBM: the decodes' KV is read ``num_attention_heads / num_kv_heads``
times, not once. aiconfigurator measures decode attention on pure decode batches (the packed
path), so the measured tables, and the roofline, count it once.

``WithMixedStepKvReads`` adds the repeated reads: ``(ratio - 1) x`` the decodes' KV bytes per
rank at the GPU's streaming bandwidth (``roofline.EFFICIENCY``'s ``mbu_max``). No constant is
fitted. The consecutive query heads of one KV head run a whole grid slice apart, and one
slice's KV (e.g. 98 decodes of 2 k tokens: 100 MB per layer) is larger than an A100's 40 MB L2,
so the rereads are taken to miss the cache. FlashAttention-3 (H100/H200) packs GQA for every
varlen call (``hopper/heuristics.h``, ``should_pack_gqa``: true when varlen), and V0 runs its
decodes in their own ``flash_attn_with_kvcache`` call, so neither pays this.
"""

from __future__ import annotations

from servematrix.engine.architecture import Architecture
from servematrix.engine.hardware import GpuSpec
from servematrix.engine.kvcache import kv_bytes_per_token_per_gpu
from servematrix.engine.roofline import DEFAULT_EFFICIENCY, EFFICIENCY
from servematrix.engine.steptime import StepBatch, StepTimeModel

FA3_MIN_COMPUTE_CAPABILITY = 9.0
"""vLLM uses FlashAttention-3 on compute capability 9.x (Hopper), FlashAttention-2 below."""


def rereads_decode_kv(gpu: GpuSpec, arch: Architecture, recipe: str) -> bool:
    """Whether a mixed step re-reads its decodes' KV per query head: V1's single varlen call
    on a FlashAttention-2 GPU, for a model with grouped (or multi-) query attention."""
    return (
        recipe == "v1"
        and gpu.compute_capability < FA3_MIN_COMPUTE_CAPABILITY
        and arch.num_attention_heads > arch.num_kv_heads
    )


class WithMixedStepKvReads:
    """A step-time model plus FlashAttention-2's repeated KV reads of the decodes in a step
    that also prefills (module docstring). A pure-decode or pure-prefill step is unchanged."""

    def __init__(self, model: StepTimeModel, arch: Architecture, gpu: GpuSpec, tp: int):
        self.model = model
        kv_heads_per_rank = max(arch.num_kv_heads / tp, 1.0)  # replicated below one per rank
        self.query_heads_per_kv_head = arch.num_attention_heads / tp / kv_heads_per_rank
        kv_bytes_per_token = kv_bytes_per_token_per_gpu(arch, tp)
        mbu = EFFICIENCY.get(gpu.name, DEFAULT_EFFICIENCY).mbu_max
        self.reread_ms_per_context_token = (
            (self.query_heads_per_kv_head - 1)
            * kv_bytes_per_token
            * 1e3
            / (gpu.hbm_bytes_per_s * mbu)
        )

    @property
    def label(self) -> str:
        return f"FA2 mixed steps read decode KV x{self.query_heads_per_kv_head:.3g}"

    def step_ms(self, batch: StepBatch) -> float:
        ms = self.model.step_ms(batch)
        if batch.decode_contexts and any(new > 1 for new, _ in batch.prefill_chunks):
            ms += self.reread_ms_per_context_token * sum(batch.decode_contexts)
        return ms
