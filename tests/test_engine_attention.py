"""V1's FlashAttention-2 rereads of the decodes' KV in a step that also prefills."""

from __future__ import annotations

import dataclasses

import pytest

from servematrix.engine.architecture import load_architecture
from servematrix.engine.attention import WithMixedStepKvReads, rereads_decode_kv
from servematrix.engine.hardware import gpu_spec
from servematrix.engine.roofline import RooflineStepTime
from servematrix.engine.setup import build_engine_setup
from servematrix.engine.steptime import StepBatch

A100 = gpu_spec("A100-SXM4-80GB")
H100 = gpu_spec("H100-SXM5-80GB")
QWEN3_14B = load_architecture("qwen3-14b")  # 40 query heads, 8 KV heads, 40 layers, head 128

MIXED = StepBatch(prefill_chunks=((1950, 0),), decode_contexts=(2048,) * 98)


def test_mixed_step_reads_each_decodes_kv_once_per_query_head_beyond_the_l2():
    """98 decodes of 2,048 tokens beside a prefill chunk: one KV head's slice of the step
    (202,654 tokens x 512 bytes, 104 MB) overflows a 20 MiB L2 partition, so the KV (160 KiB
    per token) is read 5 times instead of once, 4 x 32.9 GB more at 78 % of 2.039 TB/s:
    82.8 ms, longer than the padded tiles' compute."""
    base = RooflineStepTime(QWEN3_14B, A100, 1)
    model = WithMixedStepKvReads(base, QWEN3_14B, A100, 1)
    kv_bytes = 98 * 2048 * 2 * 40 * 8 * 128 * 2
    expected_ms = 4 * kv_bytes / (2.039e12 * 0.78) * 1e3
    assert model.step_ms(MIXED) - base.step_ms(MIXED) == pytest.approx(expected_ms)
    assert expected_ms == pytest.approx(82.8, abs=0.1)
    assert model.label == "FA2 mixed steps: decode KV x5 beyond L2, 64-row tiles"


def test_a_slice_that_fits_one_l2_partition_is_reread_from_the_l2():
    """30 decodes of 600 tokens and a 512-token chunk: 18,512 tokens x 512 bytes (9.5 MB) fit
    in 20 MiB, so the KV comes from HBM once; the decodes then cost the 64-row tiles' compute,
    4 x 64 x 128 FLOP per token and query head (40 heads, 40 layers) at 73 % of 312 TF/s."""
    base = RooflineStepTime(QWEN3_14B, A100, 1)
    model = WithMixedStepKvReads(base, QWEN3_14B, A100, 1)
    batch = StepBatch(prefill_chunks=((512, 0),), decode_contexts=(600,) * 30)
    tokens = 30 * 600
    tile_ms = tokens * 4 * 64 * 128 * 40 * 40 / (312e12 * 0.73) * 1e3
    once_ms = tokens * 2 * 40 * 8 * 128 * 2 / (2.039e12 * 0.78) * 1e3
    assert model.step_ms(batch) - base.step_ms(batch) == pytest.approx(tile_ms - once_ms)
    assert tile_ms - once_ms == pytest.approx(2.29, abs=0.01)


def test_the_l2_threshold_is_one_partition_of_the_slice_of_every_sequence():
    """A100: 40 MiB in two partitions, 512 bytes per token and KV head: 40,960 tokens."""
    assert A100.l2_partition_bytes == 20 * 2**20
    model = WithMixedStepKvReads(RooflineStepTime(QWEN3_14B, A100, 1), QWEN3_14B, A100, 1)
    fits = StepBatch(prefill_chunks=((960, 0),), decode_contexts=(1000,) * 40)
    overflows = StepBatch(prefill_chunks=((961, 0),), decode_contexts=(1000,) * 40)
    once_ms = 40_000 * model.read_ms_per_token
    assert model.extra_ms(overflows) == pytest.approx(4 * once_ms)
    assert model.extra_ms(fits) < 2 * once_ms


@pytest.mark.parametrize(
    "batch",
    [
        StepBatch(decode_contexts=(2048,) * 98),  # pure decode: max_seqlen_q == 1, packed
        StepBatch(prefill_chunks=((2048, 0), (512, 1024))),  # prefill only: nothing to reread
        StepBatch(prefill_chunks=((1, 4000),), decode_contexts=(2048,) * 8),  # all queries 1 long
    ],
)
def test_other_steps_are_unchanged(batch):
    base = RooflineStepTime(QWEN3_14B, A100, 1)
    assert WithMixedStepKvReads(base, QWEN3_14B, A100, 1).step_ms(batch) == base.step_ms(batch)


def test_tensor_parallel_ratio_per_rank():
    """Qwen2.5-72B (64 query, 8 KV heads) at TP 4: 16 query heads over 2 KV heads per rank;
    a KV head replicated across ranks (8 KV heads at TP 16) leaves every query head of the
    rank on the one KV head."""
    arch = load_architecture("qwen2.5-72b")
    base = RooflineStepTime(arch, A100, 4)
    assert WithMixedStepKvReads(base, arch, A100, 4).query_heads_per_kv_head == 8
    assert WithMixedStepKvReads(base, arch, A100, 16).query_heads_per_kv_head == 4


def test_which_engines_reread():
    mha = dataclasses.replace(QWEN3_14B, num_kv_heads=QWEN3_14B.num_attention_heads)
    assert rereads_decode_kv(A100, QWEN3_14B, "v1")
    assert rereads_decode_kv(gpu_spec("L40S-48GB"), QWEN3_14B, "v1")  # sm89: FA2 too
    assert not rereads_decode_kv(H100, QWEN3_14B, "v1")  # FA3 packs GQA for every varlen call
    assert not rereads_decode_kv(A100, QWEN3_14B, "v0")  # V0 runs decodes in their own call
    assert not rereads_decode_kv(A100, mha, "v1")  # one query head per KV head


def _setup(gpu: str, recipe: str):
    return build_engine_setup(
        "qwen3-14b",
        quantization="bf16",
        tensor_parallel=1,
        recipe=recipe,
        chunked_prefill=None,
        max_model_len=8192,
        gpu_memory_utilization=0.9,
        gpu=gpu,
    )


def test_engine_setup_applies_it_to_v1_on_a100_only():
    v1_a100 = _setup("A100-SXM4-80GB", "v1")
    assert "FA2 mixed steps: decode KV x5" in v1_a100.step_time_label
    assert (
        v1_a100.step_time.step_ms(MIXED)
        > v1_a100.step_time.step_ms(StepBatch(prefill_chunks=((1950, 0),))) + 80
    )
    assert "FA2" not in _setup("H100-SXM5-80GB", "v1").step_time_label
    assert "FA2" not in _setup("A100-SXM4-80GB", "v0").step_time_label
