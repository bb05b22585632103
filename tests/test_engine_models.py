"""Step-time roofline, KV memory plan and KV transfer link."""

from __future__ import annotations

import pytest

from servematrix.engine.architecture import load_architecture
from servematrix.engine.hardware import gpu_spec
from servematrix.engine.kvcache import (
    BlockPool,
    ModelDoesNotFitError,
    counted_reserve_gib,
    plan_kv_memory,
)
from servematrix.engine.roofline import RooflineStepTime, weight_bytes
from servematrix.engine.steptime import StepBatch
from servematrix.engine.transfer import TransferLink

A100 = gpu_spec("A100-SXM4-80GB")


def test_roofline_near_aiconfigurator_for_qwen7b_a100():
    """peers §2.5: aiconfigurator gives 10.4 ms decode (bs 1, ctx 1024) and 114 ms prefill
    (2048 tokens) for Qwen2.5-7B bf16 on A100 TP 1."""
    model = RooflineStepTime(load_architecture("qwen2.5-7b"), A100, 1)
    decode = model.step_ms(StepBatch(decode_contexts=(1024,)))
    prefill = model.step_ms(StepBatch(prefill_chunks=((2048, 0),)))
    assert decode == pytest.approx(10.4, rel=0.2)
    assert prefill == pytest.approx(114, rel=0.25)


def test_quantization_and_tp_make_decode_faster():
    arch = load_architecture("qwen2.5-72b")
    batch = StepBatch(decode_contexts=(1024,) * 8)
    bf16 = RooflineStepTime(arch, A100, 4).step_ms(batch)
    int4 = RooflineStepTime(arch, A100, 4, "gptq-int4").step_ms(batch)
    tp2 = RooflineStepTime(arch, A100, 2, "gptq-int4").step_ms(batch)
    assert int4 < bf16 < 2 * int4 + 20
    assert int4 < tp2
    assert (
        weight_bytes(arch, "gptq-int4")
        < weight_bytes(arch, "gptq-int8")
        < weight_bytes(arch, "bf16")
    )


def test_int4_kernels_lose_efficiency_at_large_token_counts():
    arch = load_architecture("qwen2.5-72b")
    prefill = StepBatch(prefill_chunks=((8192, 0),))
    bf16 = RooflineStepTime(arch, A100, 4).step_ms(prefill)
    int4 = RooflineStepTime(arch, A100, 4, "awq").step_ms(prefill)
    assert int4 > bf16 * 1.1


def plan(arch_name: str, quantization: str, tp: int):
    arch = load_architecture(arch_name)
    return plan_kv_memory(
        model_label=f"{arch_name} {quantization}",
        arch=arch,
        weight_bytes=weight_bytes(arch, quantization),
        gpu=A100,
        tp=tp,
        gpu_memory_utilization=0.8,
        max_model_len=10_000,
        max_num_batched_tokens=10_000,
        max_num_seqs=256,
        reserve_gib=counted_reserve_gib("v1", tp, enforce_eager=False),
    )


def test_72b_bf16_does_not_fit_on_one_a100():
    with pytest.raises(
        ModelDoesNotFitError, match=r"needs 1\d\d\.\d GiB of weights per GPU at TP 1"
    ):
        plan("qwen2.5-72b", "bf16", 1)


def test_72b_tp4_kv_pool_size():
    kv = plan("qwen2.5-72b", "bf16", 4)
    # 63.3 GiB usable - 33.9 GiB weights - ~2.5 GiB reserve/activations ≈ 27 GiB at 80 KiB/token.
    assert 300_000 < kv.capacity_tokens < 400_000
    assert kv.kv_bytes_per_token_per_gpu == 80 * 1024


def test_block_pool_accounting_and_watermark():
    pool = BlockPool(100, watermark=0.01)
    assert pool.blocks_for(17) == 2
    assert pool.can_admit(99) and not pool.can_admit(100)
    assert pool.allocate(60) and not pool.allocate(41)
    pool.free(60)
    assert pool.free_blocks == 100


def test_link_shares_bandwidth_between_concurrent_transfers():
    link = TransferLink(bandwidth_bytes_per_s=1e9, setup_s=0.001)
    link.start(0.0, "a", 1e8)  # alone: 1 ms + 100 ms
    link.start(0.0, "b", 1e8)
    # Both flow from 1 ms at half the bandwidth: done at 1 + 200 ms.
    assert link.advance(0.15) == []
    done = link.advance(1.0)
    assert [key for _, key in done] == ["a", "b"]
    assert [t for t, _ in done] == pytest.approx([0.201, 0.201])


def test_link_late_transfer_slows_the_first():
    link = TransferLink(bandwidth_bytes_per_s=1e9, setup_s=0.0)
    link.start(0.0, "a", 1e8)
    link.start(0.05, "b", 1e8)  # a has 50 MB left, then shares: a ends at 0.15, b at 0.20
    done = link.advance(1.0)
    assert done == [(pytest.approx(0.15), "a"), (pytest.approx(0.20), "b")]
    assert not link.busy()


def test_link_finishes_a_residue_below_the_clock_resolution():
    # The v1 disaggregated hang: at 512.71 s one ulp of the clock is 1.1e-13 s, and 0.0038 B
    # left on an 80 GB/s link take 5e-14 s, so the next event time rounds to "now". The link
    # must finish the residue instead of looping on it.
    link = TransferLink(bandwidth_bytes_per_s=80e9, setup_s=0.0)
    link._now = 512.71
    link._flowing["a"] = 0.0038
    assert link.next_event_s() == 512.71
    assert link.advance(513.0) == [(512.71, "a")]
    assert not link.busy()


def test_link_terminates_on_rounded_shares_at_large_clock_values():
    # Found by random search: with the old 1e-3-byte completion rule, the rounding of these
    # shares at t ≈ 1000 s left a residue whose next event was "now", forever.
    link = TransferLink(bandwidth_bytes_per_s=80e9, setup_s=0.001)
    link.start(1000.0075795440295, 0, 5262969.163501081)
    link.start(1000.0078379858903, 2, 25162799.867924456)
    link.start(1000.0096546488636, 1, 52641437.868553855)
    done = link.advance(1010.0)
    assert [key for _, key in done] == [0, 2, 1]
    # 0 and 2 share the link and have finished when 1 starts flowing, alone.
    assert done[-1][0] == pytest.approx(1000.0106546488636 + 52641437.868553855 / 80e9, abs=1e-9)
    assert not link.busy()


def test_link_random_transfers_at_large_clock_values_all_complete():
    import random

    rng = random.Random(1)
    for _ in range(300):
        link = TransferLink(bandwidth_bytes_per_s=80e9, setup_s=0.001)
        t0 = rng.choice([512.0, 1e3, 4096.0, 1e5])
        starts = sorted(t0 + rng.random() * 0.01 for _ in range(4))
        for key, start in enumerate(starts):
            link.start(start, key, rng.random() * 1.3e8)
        assert len(link.advance(t0 + 60.0)) == 4
        assert not link.busy()


def test_v0_receive_is_setup_cpu_chain_and_shared_wire():
    from servematrix.engine.transfer import kv_link

    knobs = {"nic_gb_s": 2.0, "nics": 1, "setup_ms": 2.0, "rank_cpu_gb_s": 0.5}
    knobs |= {"rank_cpu_fast_gb_s": 1.0, "rank_cpu_fast_mb": 20.0}
    link = kv_link("v0", "rdma", 4, knobs)
    # 100 MB per rank: 2 ms + 20 MB / 1 GB/s + 80 MB / 0.5 GB/s + 4 × 100 MB / 2 GB/s.
    assert link.v0_receive_s(100e6) == pytest.approx(0.002 + 0.02 + 0.16 + 0.2)
    two = kv_link("v0", "rdma", 4, knobs | {"nics": 2})
    assert two.v0_receive_s(100e6) == pytest.approx(0.002 + 0.02 + 0.16 + 0.1)
    # The producer's handler does half of the CPU chain (it waits for an idle producer).
    assert link.v0_producer_s(100e6) == pytest.approx(0.5 * (0.02 + 0.16))
    with pytest.raises(KeyError, match=r"unknown engine\.kv_link key"):
        kv_link("v0", "rdma", 1, {"bandwidth": 1.0})


def test_v0_tcp_costs_what_the_saturated_input_rows_show():
    """v0 TCP and eRDMA share the A10 nodes' VPC wire: at TP 4 the per-request TCP penalty
    over 1-NIC RDMA is the few ms Mooncake's in=1024 rows show and the ~30-40 ms their
    duration-pinned in=4096/8192 rows show (docs/engine-model.md, "Calibration")."""
    from servematrix.engine.transfer import kv_link

    rdma, tcp = kv_link("v0", "rdma", 4, None), kv_link("v0", "tcp", 4, None)
    per_token = 21504  # Qwen2.5-7B at TP 4: KV heads' share + the full hidden state, bytes
    extra_ms = {
        n: (tcp.v0_receive_s(n * per_token) - rdma.v0_receive_s(n * per_token)) * 1e3
        for n in (1010, 4092, 8180)
    }
    assert 3 < extra_ms[1010] < 12
    assert 20 < extra_ms[4092] < 40
    assert 35 < extra_ms[8180] < 60


def test_lookup_buffer_refuses_inserts_while_over_capacity():
    from servematrix.engine.transfer import LookupBuffer

    buffer = LookupBuffer(100.0)
    assert buffer.try_insert(60.0) and buffer.try_insert(60.0)  # vLLM checks before inserting
    assert not buffer.try_insert(10.0)
    buffer.release(60.0)
    assert buffer.try_insert(10.0)


def test_pcie_allreduce_latency_grows_with_tp():
    from servematrix.engine.roofline import allreduce_latency_ms

    a10 = gpu_spec("A10-24GB")
    assert (
        0
        == allreduce_latency_ms(a10, 1)
        < allreduce_latency_ms(a10, 2)
        < allreduce_latency_ms(a10, 4)
    )


def test_eager_roofline_decode_overlaps_launches_with_the_gpu_step():
    """Eager launches overlap the GPU: a large model's long decode step does not change, and no
    eager decode step is shorter than its launches or than the step with CUDA graphs."""
    from servematrix.engine.roofline import eager_launch_ms

    a100 = gpu_spec("A100-SXM4-80GB")
    decode = StepBatch((), (1024,) * 8)
    large = load_architecture("qwen2.5-72b")
    graph = RooflineStepTime(large, a100, 2).step_ms(decode)
    eager = RooflineStepTime(large, a100, 2, enforce_eager=True).step_ms(decode)
    assert eager == pytest.approx(graph) and graph > eager_launch_ms(large, 2)
    small = load_architecture("qwen2.5-0.5b")
    for tp in (1, 2):
        graph = RooflineStepTime(small, a100, tp).step_ms(StepBatch((), (16,)))
        eager = RooflineStepTime(small, a100, tp, enforce_eager=True).step_ms(StepBatch((), (16,)))
        assert eager >= max(graph, eager_launch_ms(small, tp)) - 1e-9
    # Launching with TP also issues every all-reduce from Python.
    assert eager_launch_ms(small, 1) < eager_launch_ms(small, 2) == eager_launch_ms(small, 4)


def test_eager_on_a_measured_table_takes_the_longer_of_table_step_and_launches():
    from servematrix.engine.steptime import WithDecodeOverhead

    class Fixed:
        def __init__(self, ms: float):
            self.ms = ms

        def step_ms(self, batch: StepBatch) -> float:
            return self.ms

    decode, prefill = StepBatch((), (100,)), StepBatch(((512, 0),), ())
    assert WithDecodeOverhead(Fixed(2.0), 5.0, 0.0).step_ms(decode) == 5.0  # launch-bound
    assert WithDecodeOverhead(Fixed(20.0), 5.0, 0.0).step_ms(decode) == 20.0  # GPU-bound
    assert WithDecodeOverhead(Fixed(2.0), 5.0, 1.0).step_ms(prefill) == 3.0  # not a decode


def test_stragglers_lengthen_the_tail_only_with_jitter():
    import numpy as np

    from servematrix.engine.instance import Jitter

    plain = np.array(Jitter(0.03, 1).peek(4000))
    tail = np.array(Jitter(0.03, 1, straggler_probability=0.01).peek(4000))
    assert np.percentile(tail, 99.9) > 1.5 > np.percentile(plain, 99.9)
    assert Jitter(0.0, 1, straggler_probability=0.5).peek(3) == [1.0, 1.0, 1.0]


def test_v0_link_presets_say_they_are_extrapolated_from_a10_hosts():
    from servematrix.engine.transfer import kv_link

    for protocol in ("rdma", "tcp"):
        assert "extrapolated from A10 hosts" in kv_link("v0", protocol, 2, None).provenance
        assert "not fitted" in kv_link("v1", protocol, 2, None).provenance
    overridden = kv_link("v0", "rdma", 2, {"nic_gb_s": 12.5})
    assert overridden.provenance.startswith("engine.kv_link overrides nic_gb_s; else extrapolated")


def test_v1_runs_mixed_steps_up_to_its_capture_size_under_cuda_graphs():
    """V1 graphs every step of at most min(2 x max_num_seqs, 512, budget) tokens (piecewise
    for steps with prefill tokens); V0 graphs pure decodes of at most 256 sequences only. The
    step with graphs saves the per-layer launches: (0.030 - 0.010) ms x 28 layers."""
    from servematrix.engine.roofline import v1_graph_max_tokens

    arch = load_architecture("qwen2.5-7b")
    assert v1_graph_max_tokens(256, 2048) == 512 and v1_graph_max_tokens(8, 2048) == 16
    v0 = RooflineStepTime(arch, A100, 1, tp_step_broadcast=True)
    v1 = RooflineStepTime(arch, A100, 1, graph_max_tokens=512)
    saved_ms = (0.030 - 0.010) * arch.num_layers
    mixed = StepBatch(((256, 0),), (1024,) * 32)  # 288 tokens
    assert v0.step_ms(mixed) - v1.step_ms(mixed) == pytest.approx(saved_ms)
    large = StepBatch(((1024, 0),), (1024,) * 32)  # 1,056 tokens: eager in both
    assert v0.step_ms(large) == pytest.approx(v1.step_ms(large))
    decode = StepBatch((), (1024,) * 300)
    assert v0.step_ms(decode) - v1.step_ms(decode) == pytest.approx(saved_ms)
