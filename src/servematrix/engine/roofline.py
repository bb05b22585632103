"""Analytic step-time model: a roofline with measured efficiency factors (peers §2.9).

For one step on TP ``t``, with prefill chunks (c new tokens, p cached tokens) and decodes of
context ``ctx``, per GPU::

    T       = Σc + n_dec                                   tokens through the linear layers
    flops   = (2·N_linear·T + 2·V·H·n_seqs + 4·L·Hq·d·(Σ c·(p + c/2) + Σ ctx)) / t
    bytes   = W/t + kv_tok/t · (Σ p + Σ ctx + T)           weights once, KV read and written
    t_step  = max(flops / (peak·mfu(T)), bytes / (bw·mbu)) + t_allreduce + overheads

Everything that does not depend on the batch is precomputed in the constructor, so a step
costs a few dozen float operations. Quantization changes the weight bytes and, for
weight-only integer kernels, the compute efficiency (dequantization is not free at large T).
"""

from __future__ import annotations

from dataclasses import dataclass

from servematrix.engine.architecture import Architecture
from servematrix.engine.hardware import GpuSpec
from servematrix.engine.steptime import StepBatch


@dataclass(frozen=True)
class QuantizationSpec:
    """How a checkpoint stores its linear-layer weights and what its kernels cost.

    ``weight_bytes_per_param`` includes group scales and zero points (group size 128, fp16
    scales + packed zeros: (2 + bits/8) / 128 B per parameter). Embedding and LM head stay in
    16 bit in every format vLLM loads. ``compute_efficiency`` multiplies the GEMM MFU.
    """

    name: str
    weight_bytes_per_param: float
    compute_efficiency: float
    native_fp8: bool = False


QUANTIZATIONS: dict[str, QuantizationSpec] = {
    "bf16": QuantizationSpec("bf16", 2.0, 1.0),
    # AWQ / GPTQ int4 run on Marlin kernels in vLLM >= 0.5.4 (awq_marlin, gptq_marlin): near
    # 4x faster than fp16 while memory-bound, but at large batch the in-register dequantization
    # makes them ~15-20 % slower than cuBLAS fp16 (Marlin paper, Frantar et al. 2024, Fig. 1;
    # vLLM issue threads on AWQ prefill throughput). 0.82 is the midpoint; approximate.
    "awq": QuantizationSpec("awq", 0.5 + 2.5 / 128, 0.82),
    "gptq-int4": QuantizationSpec("gptq-int4", 0.5 + 2.5 / 128, 0.82),
    # 8-bit weight-only Marlin: half the dequant work of int4 per byte moved; approximate.
    "gptq-int8": QuantizationSpec("gptq-int8", 1.0 + 3.0 / 128, 0.88),
    # FP8: W8A8 on the FP8 tensor cores where the GPU has them (H100/H200/L40S), otherwise
    # vLLM falls back to weight-only FP8 Marlin (A100/A10).
    "fp8": QuantizationSpec("fp8", 1.0, 0.88, native_fp8=True),
}


@dataclass(frozen=True)
class GpuEfficiency:
    """Achieved fractions of the datasheet peaks.

    ``mfu_max``: GEMM plateau at ≥ 2048 tokens; ``mfu_half_tokens``: tokens at which half the
    plateau is reached (``mfu(T) = mfu_max·T/(T + half)``, fitted to the 512-token point);
    ``mbu_max``: weight-streaming bandwidth of large shards.
    """

    mfu_max: float
    mfu_half_tokens: float
    mbu_max: float


A100_EFFICIENCY = GpuEfficiency(0.76, 28.0, 0.78)
"""vidur A100 profiles (Llama-2-70B): 74-77 % MFU at 2048-4096 tokens, 72 % at 512; 75-79 % of
HBM peak for 1-32 tokens (peers §2.8)."""

EFFICIENCY: dict[str, GpuEfficiency] = {
    "A100-SXM4-80GB": A100_EFFICIENCY,
    # The 40 GB A100 has the same die and an HBM2 of the same generation: assumed alike. (Its
    # step runs on the 80 GB card's tables plus the two rooflines' difference: aic_table.)
    "A100-SXM4-40GB": A100_EFFICIENCY,
    # vidur H100 profiles: 70-75 % MFU plateau, 76 % at 512; 86-89 % of HBM peak.
    "H100-SXM5-80GB": GpuEfficiency(0.73, 20.0, 0.87),
    # Same die as H100; HBM3e efficiency assumed like HBM3 (approximate).
    "H200-SXM-141GB": GpuEfficiency(0.73, 20.0, 0.87),
}
DEFAULT_EFFICIENCY = GpuEfficiency(0.70, 30.0, 0.80)
"""A10 / L40S: no vendor-neutral profiles; BLIS uses 0.32 prefill MFU on L40S, we keep the
A100-like GEMM plateau with a lower ceiling (approximate, see docs/engine-model.md)."""

SMALL_SHARD_HALF_BYTES = 34e6
"""Per-layer shard size at which streaming reaches half of ``mbu_max``: Llama-2-7B at TP 8
(51 MB per layer per GPU) reaches 0.97 of 2.039 TB/s on A100 (vidur), i.e. mbu 0.48."""

NON_GEMM_FACTOR = 1.10
"""Norms, RoPE, activation, residual adds: +8-12 % of compute time at large T (vidur)."""

STEP_OVERHEAD_MS = 0.13
"""Per step: scheduling, input preparation, sampling launch (BLIS β per-step 126 µs)."""

PER_SEQ_OVERHEAD_MS = 0.0044
"""Per scheduled sequence: metadata and sampling (BLIS β per-request 4.4 µs)."""

LAYER_OVERHEAD_EAGER_MS = 0.030
"""Kernel launches per layer when the step runs eagerly (BLIS per-layer 32 µs)."""

LAYER_OVERHEAD_GRAPH_MS = 0.010
"""Per layer under CUDA graphs (decode-only steps): launch cost mostly removed (peers §2.9)."""

CUDA_GRAPH_MAX_BATCH = 256
"""V0 captures decode graphs for batch sizes up to 256 (``_BATCH_SIZES_TO_CAPTURE``); larger
decode batches and every step with a prefill run eagerly."""

V1_CUDA_GRAPH_MAX_TOKENS = 512
"""V1 (``VllmConfig._set_cudagraph_sizes``): graphs up to ``min(2 × max_num_seqs, 512,
max_num_batched_tokens)`` tokens, full graphs for pure decodes and piecewise ones (all but
attention) for steps with prefill tokens too (``cudagraph_mode`` FULL_AND_PIECEWISE); a step of
more tokens runs eagerly."""


def v1_graph_max_tokens(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The largest step (in tokens) V1 runs under CUDA graphs."""
    return min(2 * max_num_seqs, V1_CUDA_GRAPH_MAX_TOKENS, max_num_batched_tokens)


ALLREDUCE_LATENCY_NVLINK_MS = 0.020
"""Small-message all-reduce on NVLink (vLLM custom all-reduce); fitted to aiconfigurator's
Qwen2.5-7B A100 decode at TP 2/4 (6.5/3.9 ms vs 10.4 ms at TP 1, peers §2.5)."""

ALLREDUCE_LATENCY_PCIE_BASE_MS = 0.020
ALLREDUCE_LATENCY_PCIE_HOP_MS = 0.015
"""NCCL ring all-reduce of a small message on PCIe-only GPUs (A10, L40S): vLLM's custom
all-reduce is off there ("not supported on more than two PCIe-only GPUs", or no P2P on cloud
VMs), so NCCL's ring runs 2·(t−1) steps, each a PCIe round trip through the host bridge. Base
plus 15 µs per step gives 50 µs at TP 2 (vidur's NVLink-era 30-60 µs floor) and 110 µs at TP 4
(nccl-tests small-message latency on PCIe Gen4 hosts is ~50-150 µs); approximate."""

EAGER_ALLREDUCE_LAUNCH_MS = 0.020
"""Host cost of issuing one NCCL all-reduce from Python when the step runs eagerly (under CUDA
graphs it is captured); part of the per-layer eager overhead measured by BLIS, approximate."""

V0_TP_STEP_BROADCAST_MS = 1.0
"""V0 with TP > 1: the driver worker broadcasts the step's inputs and metadata to the other
ranks before every step (``broadcast_tensor_dict`` over a CPU group plus NCCL), which V1
removed; ~1 ms per step on a PCIe host (an order-of-magnitude estimate, not fitted; its
sensitivity on Mooncake's A10 tables is in docs/engine-model.md "Calibration")."""

ALLREDUCE_BANDWIDTH_FRACTION = 0.55
"""Bus bandwidth achieved by large all-reduces: vidur A100 DGX 64 MB at TP 2/8 gives
149-166 GB/s of 300 GB/s per direction."""


def allreduce_latency_ms(gpu: GpuSpec, tp: int) -> float:
    """Latency floor of one small all-reduce on TP ``tp`` (NVLink custom all-reduce or the NCCL
    ring over PCIe)."""
    if tp <= 1:
        return 0.0
    if gpu.nvlink:
        return ALLREDUCE_LATENCY_NVLINK_MS
    return ALLREDUCE_LATENCY_PCIE_BASE_MS + ALLREDUCE_LATENCY_PCIE_HOP_MS * 2 * (tp - 1)


def eager_launch_ms(arch: Architecture, tp: int) -> float:
    """Host time to launch one decode step's kernels without CUDA graphs: the per-step fixed cost,
    per-layer launches and, with TP, issuing every all-reduce from Python. Launches overlap the
    GPU's execution, so an eager decode step lasts the longer of this and the GPU's work
    (docs/engine-model.md, "enforce_eager")."""
    launch = STEP_OVERHEAD_MS + arch.num_layers * LAYER_OVERHEAD_EAGER_MS
    if tp > 1:
        launch += 2 * arch.num_layers * EAGER_ALLREDUCE_LAUNCH_MS
    return launch


def weight_bytes(arch: Architecture, quantization: str) -> float:
    """Bytes of all weights (every TP shard together) as vLLM loads them."""
    spec = quantization_spec(quantization)
    linear = arch.num_layers * arch.linear_params_per_layer
    return linear * spec.weight_bytes_per_param + arch.embedding_params * 2.0


def quantization_spec(name: str) -> QuantizationSpec:
    try:
        return QUANTIZATIONS[name]
    except KeyError:
        known = ", ".join(QUANTIZATIONS)
        raise KeyError(f"unknown quantization {name!r} (known: {known})") from None


class RooflineStepTime:
    """``StepTimeModel`` from first principles; see the module docstring for the formula."""

    def __init__(
        self,
        arch: Architecture,
        gpu: GpuSpec,
        tp: int,
        quantization: str = "bf16",
        enforce_eager: bool = False,
        tp_step_broadcast: bool = False,
        graph_max_tokens: int | None = None,
    ):
        """``graph_max_tokens``: V1's largest graphed step (`v1_graph_max_tokens`, pure decodes
        and mixed steps alike); None: V0's rule (pure decodes up to `CUDA_GRAPH_MAX_BATCH`)."""
        if tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
        quant = quantization_spec(quantization)
        eff = EFFICIENCY.get(gpu.name, DEFAULT_EFFICIENCY)
        self.arch, self.gpu, self.tp, self.quantization = arch, gpu, tp, quantization
        layers = arch.num_layers
        lm_head_params = arch.vocab_size * arch.hidden_size
        linear_params = layers * arch.linear_params_per_layer

        if quant.native_fp8 and gpu.fp8_dense_tflops:
            peak_flops, kernel_eff = gpu.fp8_dense_tflops * 1e12, 1.0
        else:
            peak_flops, kernel_eff = gpu.bf16_flops_per_s, quant.compute_efficiency
        # ms per FLOP at the plateau, including non-GEMM work.
        self._ms_per_flop = NON_GEMM_FACTOR * 1e3 / (peak_flops * eff.mfu_max * kernel_eff)
        self._mfu_half = eff.mfu_half_tokens
        self._linear_flops_per_token = 2.0 * linear_params / tp
        self._lm_head_flops_per_seq = 2.0 * lm_head_params / tp
        self._attn_flops_coef = 4.0 * layers * arch.num_attention_heads * arch.head_dim / tp

        weights_per_gpu = (linear_params * quant.weight_bytes_per_param + lm_head_params * 2.0) / tp
        layer_shard = arch.linear_params_per_layer * quant.weight_bytes_per_param / tp
        mbu = eff.mbu_max * layer_shard / (layer_shard + SMALL_SHARD_HALF_BYTES)
        ms_per_byte = 1e3 / (gpu.hbm_bytes_per_s * mbu)
        heads_per_gpu = max(arch.num_kv_heads / tp, 1.0)
        kv_bytes_per_token = 2 * layers * heads_per_gpu * arch.head_dim * 2
        self._weights_ms = weights_per_gpu * ms_per_byte
        self._kv_ms_per_token = kv_bytes_per_token * ms_per_byte

        self.enforce_eager = enforce_eager
        self._graph_max_tokens = graph_max_tokens
        if tp > 1:
            latency = allreduce_latency_ms(gpu, tp)
            # On PCIe cards interconnect_gb_s is already an effective all-reduce bandwidth.
            fraction = ALLREDUCE_BANDWIDTH_FRACTION if gpu.nvlink else 1.0
            bus = gpu.interconnect_gb_s * 1e9 * fraction
            ring_bytes_per_token = arch.hidden_size * 2 * 2 * (tp - 1) / tp
            self._allreduce_fixed_ms = 2 * layers * latency
            self._allreduce_ms_per_token = 2 * layers * ring_bytes_per_token / bus * 1e3
        else:
            self._allreduce_fixed_ms = 0.0
            self._allreduce_ms_per_token = 0.0
        broadcast_ms = V0_TP_STEP_BROADCAST_MS if tp_step_broadcast and tp > 1 else 0.0
        step_fixed = STEP_OVERHEAD_MS + broadcast_ms
        self._eager_fixed_ms = (
            step_fixed
            + layers * LAYER_OVERHEAD_EAGER_MS
            + (2 * layers * EAGER_ALLREDUCE_LAUNCH_MS if tp > 1 else 0.0)
        )
        self._graph_step_fixed_ms = step_fixed + layers * LAYER_OVERHEAD_GRAPH_MS
        self._graph_fixed_ms = self._eager_fixed_ms if enforce_eager else self._graph_step_fixed_ms

    def step_ms(self, batch: StepBatch) -> float:
        prefill_tokens = 0
        cached = 0
        attn_work = 0.0
        for new, past in batch.prefill_chunks:
            prefill_tokens += new
            cached += past
            attn_work += new * (past + new * 0.5)
        contexts = batch.decode_contexts
        return self.time_ms(
            prefill_tokens,
            len(batch.prefill_chunks),
            cached,
            attn_work,
            len(contexts),
            sum(contexts),
        )

    def time_ms(
        self,
        prefill_tokens: int,
        num_prefills: int,
        prefill_cached_tokens: int,
        prefill_attention_work: float,
        num_decodes: int,
        decode_context_sum: int,
    ) -> float:
        """The step time from batch totals: ``prefill_attention_work`` is Σ c·(p + c/2)."""
        tokens = prefill_tokens + num_decodes
        if tokens == 0:
            return 0.0
        seqs = num_prefills + num_decodes
        flops = (
            self._linear_flops_per_token * tokens
            + self._lm_head_flops_per_seq * seqs
            + self._attn_flops_coef * (prefill_attention_work + decode_context_sum)
        )
        compute_ms = flops * self._ms_per_flop * (tokens + self._mfu_half) / tokens
        memory_ms = self._weights_ms + self._kv_ms_per_token * (
            prefill_cached_tokens + decode_context_sum + tokens
        )
        decode_graph = num_prefills == 0 and num_decodes <= CUDA_GRAPH_MAX_BATCH
        if self._graph_max_tokens is not None:
            decode_graph = num_prefills == 0 and num_decodes <= self._graph_max_tokens
            graphed = tokens <= self._graph_max_tokens
        else:
            graphed = decode_graph
        fixed = self._graph_fixed_ms if graphed else self._eager_fixed_ms
        ms = (
            (compute_ms if compute_ms > memory_ms else memory_ms)
            + self._allreduce_fixed_ms
            + self._allreduce_ms_per_token * tokens
            + fixed
            + PER_SEQ_OVERHEAD_MS * seqs
        )
        if decode_graph and self.enforce_eager:
            # Eager decode: the launches overlap the GPU's work (see eager_launch_ms).
            gpu_ms = ms - self._eager_fixed_ms
            ms = max(gpu_ms + self._graph_step_fixed_ms, self._eager_fixed_ms)
        return ms
