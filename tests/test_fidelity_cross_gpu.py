"""The fidelity benchmark's cross-GPU check and the table-version check: pure arithmetic on the
published validation rows, no simulation (``benchmarks/fidelity.py`` and
``benchmarks/aic_versions.py`` print the real tables)."""

from __future__ import annotations

from importlib.resources import files

import polars as pl
import pytest

from servematrix.engine.setup import EngineFlags, plan_engine
from tests.benchmark_modules import load

aic_versions, fidelity_cross_gpu, fidelity_points, fidelity_validation = load(
    "aic_versions", "fidelity_cross_gpu", "fidelity_points", "fidelity_validation"
)
RUNS = fidelity_validation.load_validation()


def _points(factor_for_gpu: dict[str, float]) -> list[fidelity_points.Point]:
    """Every published value with a "simulated" value of ``factor`` x published, per GPU."""
    return [
        fidelity_points.Point(
            "validation",
            run.source,
            run.regime,
            run.gpu,
            run.label,
            metric,
            value,
            (value * factor_for_gpu.get(run.gpu, 1.0),),
        )
        for run in RUNS
        for metric, value in run.published.items()
    ]


def test_pairs_are_the_same_workload_on_two_gpus_slower_card_first() -> None:
    ratios = fidelity_cross_gpu.cross_gpu_ratios(RUNS, _points({}))
    pairs = {(r.source, r.gpu_a, r.gpu_b) for r in ratios}
    assert pairs == {
        ("gpustack-lab", "A100-SXM4-80GB", "H100-SXM5-80GB"),
        ("vllm-spotcheck", "H100-SXM5-80GB", "H200-SXM-141GB"),
    }
    # GPUStack's 14B runs on both cards (4 workloads) and the 32B ones, whose H100 rows are not
    # simulated in the benchmark but are published; the spot check's 4 workloads; 2 metrics each
    assert len(ratios) == (4 + 4 + 4) * 2
    for ratio in ratios:
        assert ratio.simulated == pytest.approx(ratio.published)
        assert ratio.in_band_a and ratio.in_band_b


def test_a_pair_needs_both_runs_simulated() -> None:
    simulated = [p for p in _points({}) if "gpustack-lab 32B H100" not in p.label]
    ratios = fidelity_cross_gpu.cross_gpu_ratios(RUNS, simulated)
    assert not any("Qwen3-32B" in r.workload for r in ratios)
    assert len(ratios) == (4 + 4) * 2


def test_speed_up_reads_faster_as_above_one_for_throughput_and_tpot() -> None:
    # the second GPU simulated at twice its published throughput and twice its published TPOT
    ratios = fidelity_cross_gpu.cross_gpu_ratios(RUNS, _points({"H100-SXM5-80GB": 2.0}))
    gpustack = [r for r in ratios if r.source == "gpustack-lab" and "14B" in r.workload]
    for ratio in gpustack:
        expected = 2.0 if ratio.metric == "request_throughput_per_s" else 0.5
        assert ratio.simulated == pytest.approx(expected * ratio.published)
        assert ratio.in_band_a and not ratio.in_band_b


def test_gpustack_h100_speed_up_is_near_the_memory_ratio_on_long_prompts() -> None:
    """What the docs quote: on the three long-prompt 14B workloads GPUStack's H100 served
    1.78-1.87x its A100's requests per second, between the cards' HBM ratio (1.64) and far from
    their dense bf16 ratio (3.17), the 32,000-token run included, which is nearly all prefill."""
    ratios = fidelity_cross_gpu.cross_gpu_ratios(RUNS, _points({}))
    long_runs = [
        r for r in ratios
        if r.source == "gpustack-lab" and "Qwen3-14B" in r.workload and "128/4" not in r.workload
        and r.metric == "request_throughput_per_s"
    ]  # fmt: skip
    assert len(long_runs) == 3
    assert [round(r.published, 2) for r in long_runs] == [1.87, 1.79, 1.78]
    for ratio in long_runs:
        assert ratio.hbm_ratio == pytest.approx(1.64, abs=0.01)
        assert ratio.compute_ratio == pytest.approx(3.17, abs=0.01)


def test_format_cross_gpu_prints_one_line_per_ratio() -> None:
    ratios = fidelity_cross_gpu.cross_gpu_ratios(RUNS, _points({}))
    lines = fidelity_cross_gpu.format_cross_gpu(ratios)
    assert len(lines) == 2 + len(ratios)
    assert "A100-SXM4-80GB -> H100-SXM5-80GB" in lines[2]


def test_prefill_attention_faster_than_the_bf16_peak_is_flagged() -> None:
    # 1 x 40 heads x 16,384 tokens: 2 x 40 x 128 x 16384^2 FLOPs = 2.75 TFLOP, 2.78 ms at 989
    frame = pl.DataFrame(
        {"batch_size": [1, 1], "num_heads": [40, 40], "isl": [16384, 16384],
         "latency": [2.70, 2.90]}
    )  # fmt: skip
    below = frame.select(aic_versions._below_peak(pl.col("latency"), 989.0))["latency"]
    assert below.to_list() == [True, False]


def test_size_buckets() -> None:
    assert aic_versions._bucket(16, (16, 256)) == "<= 16"
    assert aic_versions._bucket(17, (16, 256)) == "<= 256"
    assert aic_versions._bucket(300_000, (16_384, 262_144)) == "> 262,144"


def _gemm_ms(system: str, version: str, m: int, n: int, k: int) -> float:
    root = files("aiconfigurator_core") / "systems" / "data" / system / "gemm"
    table = pl.read_parquet(str(root / "vllm" / version / "gemm_perf.parquet"))
    rows = table.filter(
        pl.col("m") == m, pl.col("n") == n, pl.col("k") == k, pl.col("gemm_dtype") == "bfloat16"
    )
    return rows["latency"].min()


def test_tables_measure_the_h100_about_three_times_the_a100_on_qwen3_14b_prefill_gemms() -> None:
    """What docs/engine-model.md quotes: Qwen3-14B's QKV projection (7,168 x 5,120) and output
    projection (5,120 x 5,120) at 8,192 tokens, H100 SXM (vLLM 0.24.0) against A100 SXM
    (0.14.0)."""
    for (n, k), expected in {(7168, 5120): 2.85, (5120, 5120): 3.14}.items():
        a100 = _gemm_ms("a100_sxm", "0.14.0", 8192, n, k)
        h100 = _gemm_ms("h100_sxm", "0.24.0", 8192, n, k)
        assert a100 / h100 == pytest.approx(expected, abs=0.01)


def test_gpustack_14b_kv_pools_are_about_the_same_on_both_cards() -> None:
    blocks = {}
    for run in RUNS:
        if run.source == "gpustack-lab" and run.row.startswith("14B") and "32k" in run.row:
            cell = fidelity_validation._serve_cell(run, 0, None)
            blocks[run.gpu] = plan_engine(run.architecture, EngineFlags.of_cell(cell)).kv.num_blocks
    assert blocks == {"A100-SXM4-80GB": 17328, "H100-SXM5-80GB": 16791}
