"""The fidelity benchmark's inputs: the published numbers parse and every row builds a valid cell.

Fast checks only: nothing here simulates, times or judges accuracy (that is what
``benchmarks/fidelity.py`` prints).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import jsonschema
import pytest
import yaml

from servematrix.backends.cell import identity
from servematrix.engine.architecture import load_architecture
from servematrix.engine.hardware import gpu_spec
from servematrix.engine.setup import EngineFlags, plan_engine
from servematrix.spec.config import SCHEMA_PATH
from servematrix.spec.matrix import RECIPES, Cell
from tests.benchmark_modules import BENCHMARKS, load

fidelity, fidelity_points, fidelity_validation = load(
    "fidelity", "fidelity_points", "fidelity_validation"
)
ROWS = fidelity.load_published()


def test_header_names_both_sources_with_commits() -> None:
    header = [
        line
        for line in BENCHMARKS.joinpath("data", "mooncake_published.csv").read_text().splitlines()
        if line.startswith("#")
    ]
    text = "\n".join(header)
    assert "vllm_benchmark_results.md @ 348afd75319025441b8e2024a98f56f153245a4f" in text
    assert "vllm-benchmark-results-v0.2.md @ 29fbe9f3ea4283b76315e79da7db496fa89f366e" in text


def test_every_published_table_is_complete() -> None:
    assert Counter(row.table for row in ROWS) == {
        "v0.1-in1024": 5,
        "v0.1-in256": 20,
        "v0.2-tp": 9,
        "v0.2-qps": 12,
        "v0.2-input": 12,
    }
    assert {row.setting for row in ROWS} == {"nondisagg", "chunked", "rdma", "tcp"}


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.label)
def test_published_row_is_self_consistent(row) -> None:
    """Catches transcription slips: throughputs follow from duration and token counts."""
    assert row.completed == 200
    assert row.total_output_tokens == 1200
    assert all(value > 0 for value in row.metrics_ms.values())
    for family in fidelity_points.FAMILIES:
        assert row.metrics_ms[f"p99_{family}_ms"] >= row.metrics_ms[f"median_{family}_ms"]
    # vLLM prints 2 decimals: the rounded duration allows ~0.1 % on the throughputs.
    total = (row.total_input_tokens + row.total_output_tokens) / row.duration_s
    assert row.total_token_throughput == pytest.approx(total, rel=2e-3)
    assert row.request_throughput == pytest.approx(row.completed / row.duration_s, abs=7e-3)
    # Each request has 5 gaps (out 6), so pooled mean ITL equals mean TPOT within rounding.
    assert row.metrics_ms["mean_itl_ms"] == pytest.approx(row.metrics_ms["mean_tpot_ms"], rel=0.01)


def test_mean_input_lengths_are_the_published_means() -> None:
    lengths = {(row.doc, row.input_len): row.mean_input_len for row in ROWS}
    assert lengths[("v0.1", 1024)] == 1012  # 202314 / 200
    assert lengths[("v0.1", 256)] == 245  # 49054 / 200
    assert lengths[("v0.2", 1024)] == 1010  # 201995 / 200
    assert lengths[("v0.2", 8192)] == 8180  # 1636065 / 200


def _engine_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["engine"]


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.label)
def test_every_row_builds_a_valid_cell(row) -> None:
    setup = fidelity.setup_for(row)
    cell = setup.cell
    assert cell is not None, setup.unsupported
    assert cell.recipe in RECIPES
    assert Cell.from_dict(cell.to_dict()) == cell
    jsonschema.validate(dict(cell.engine), _engine_schema())
    gpu_spec(cell.engine["gpu"])
    load_architecture(cell.model.architecture)
    assert cell.model.tensor_parallel == row.tp
    assert len(cell.instance_gpus) == cell.mode.instances
    assert all(len(group) == row.tp for group in cell.instance_gpus)
    w = cell.workload
    assert (w.qps, w.num_prompts, w.output_len, w.seed) == (row.qps, 200, 6, 0)
    assert w.input_len + w.output_len <= cell.serving.max_model_len
    identity(cell)
    assert cell.path.endswith(".parquet")


def test_modes_follow_the_published_setups() -> None:
    by_setting = {row.setting: fidelity.setup_for(row).cell.mode for row in ROWS}
    # Mooncake issue #5: the v0.1 non-disaggregated rows ran one A10 instance.
    assert by_setting["nondisagg"].instances == 1
    assert by_setting["chunked"].instances == 1
    assert by_setting["chunked"].chunked_prefill is True
    assert by_setting["rdma"].disaggregated and by_setting["rdma"].kv_protocol == "rdma"
    assert by_setting["tcp"].disaggregated and by_setting["tcp"].kv_protocol == "tcp"
    utilization = {
        row.doc: fidelity.setup_for(row).cell.serving.gpu_memory_utilization for row in ROWS
    }
    assert utilization == {"v0.1": 0.95, "v0.2": 0.8}


def test_approximations_are_flagged() -> None:
    codes = {row.label: fidelity.setup_for(row).approximations for row in ROWS}
    two_nic = [row for row in ROWS if row.nics == 2]
    assert two_nic and all("2nic" in codes[row.label] for row in two_nic)
    assert all(set(c) <= set(fidelity.APPROXIMATIONS) for c in codes.values())


def test_band_counting() -> None:
    in_band = fidelity_points.in_band
    assert in_band(1.0) and in_band(0.77) and in_band(1.3)
    assert not in_band(0.76) and not in_band(1.31)
    assert not in_band(None)


def test_reseeding_changes_only_the_seed() -> None:
    setups = [fidelity.setup_for(row) for row in ROWS[:3]]
    for original, moved in zip(setups, fidelity.reseeded(setups, 7), strict=True):
        assert moved.cell.workload.seed == 7
        assert moved.row == original.row
        assert replace(moved.cell.workload, seed=0) == original.cell.workload
        assert moved.cell.model == original.cell.model


def _comparison(row, scale: float):
    """A comparison predicting ``scale`` times every published value of ``row``."""
    predicted = {metric: value * scale for metric, value in row.metrics_ms.items()}
    return fidelity.Comparison(fidelity.setup_for(row), predicted, row.duration_s)


def test_spread_marks_misses_inside_the_seed_range() -> None:
    """Seed 0 predicts 0.5x (every ratio a miss); other seeds 0.9x and 1.6x bracket the
    published values, so every miss is within run-to-run spread; a 0.5x/0.6x pair is not."""
    row = ROWS[0]
    bracketing = [[_comparison(row, 0.5)], [_comparison(row, 0.9)], [_comparison(row, 1.6)]]
    lines = fidelity.format_spread(bracketing)
    assert "mean_ttft 0.50 [0.50-1.60]*" in lines[1]
    assert lines[-2] == (
        "outside the band at seed 0: 9; published value inside the range of 3 seeds: 9"
    )
    assert lines[-1] == "ratios in band per seed: 0, 9, 0 (median 0 of 9)"
    low = fidelity.format_spread([[_comparison(row, 0.5)], [_comparison(row, 0.6)]])
    assert "mean_ttft 0.50 [0.50-0.60]," in low[1]
    assert low[-2].endswith("inside the range of 2 seeds: 0")


# --- Validation set ----------------------------------------------------------------------------

RUNS = fidelity_validation.load_validation()


def test_validation_header_cites_every_source_with_a_commit() -> None:
    text = fidelity_validation.VALIDATION_CSV.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert (
        "speed_benchmark.rst\n#                 @ a912d239c2d0e2e5d10bb8d02e6f5685edb43e68"
        in header
    )
    assert "H100_results.md\n#                 @ c41e22af024ae4166f175e52f43e070cb148b7c5" in header
    gpustack = "qwen3-14b/a100.md\n#                 @ 10e9444a07c73556f2ef0d10d2b2766bbf54c9c0"
    assert gpustack in header
    spotcheck = "qwq-32b/vllm-*.json @ b2f80f2c9a2d1ae110f789939b13e2a84c71104e"
    assert spotcheck in header
    for source in {run.source for run in RUNS}:
        assert f"#   {source}:" in header


def test_validation_set_size_and_coverage() -> None:
    values = [(run, metric) for run in RUNS for metric in run.published]
    assert len(values) >= 400
    assert Counter(run.source for run, _ in values) == {
        "qwen25-speed": 147,
        "kvcached-h100": 20,
        "gpustack-lab": 200,
        "vllm-spotcheck": 104,
        "llm-k8s": 40,
    }
    gpus = {"A100-SXM4-80GB", "A100-SXM4-40GB", "H100-SXM5-80GB", "H200-SXM-141GB"}
    loaded = [run for run in RUNS if run.regime != "low"]
    assert {run.gpu for run in loaded} == gpus
    assert sum(len(run.published) for run in loaded) >= 180
    assert {run.gpu for run in RUNS} == gpus
    assert {run.regime for run in RUNS} == set(fidelity_points.REGIMES)


def test_validation_values_are_positive_and_setups_consistent() -> None:
    for run in RUNS:
        assert run.regime in fidelity_points.REGIMES
        assert run.recipe in RECIPES
        assert all(value > 0 for value in run.published.values())
        assert set(run.published) <= {
            *fidelity_points.SERVE_METRICS,
            *fidelity_validation.THROUGHPUT_METRICS,
        }
        load_architecture(run.architecture)
        gpu_spec(run.gpu)
        if run.interface == "offline-llm":
            assert (run.num_prompts, run.request_rate, run.regime) == (1, None, "low")


def test_spot_check_e2e_values_agree_with_its_ttft_and_tpot() -> None:
    """The E2E values were derived from the spot check's per-request data (TTFT + the ITLs, as
    ``benchmark_serving.py`` 0.8.2 times ``latency``). Every request generated its full output
    (``--ignore-eos``), so the mean E2E is the mean TTFT + (output - 1) x the mean TPOT."""
    with_e2e = [run for run in RUNS if "mean_e2el_ms" in run.published]
    assert {run.source for run in with_e2e} == {"vllm-spotcheck"} and len(with_e2e) == 8
    for run in with_e2e:
        values = run.published
        expected = values["mean_ttft_ms"] + (run.output_len - 1) * values["mean_tpot_ms"]
        assert values["mean_e2el_ms"] == pytest.approx(expected, rel=1e-4)
        assert values["median_e2el_ms"] < values["p99_e2el_ms"]


def test_only_the_inconsistent_source_rows_are_left_out() -> None:
    skipped = [run for run in RUNS if fidelity_validation.validation_unsupported(run)]
    assert [(run.row, run.input_len) for run in skipped] == [
        ("32B BF16 tp1 in6144 [setting1]", 6144),
        ("32B BF16 tp1 in14336 [setting1]", 14336),
    ]


def test_prefix_caching_is_as_each_source_ran_vllm() -> None:
    """The V1 default (on) where the command names no flag, off where the spot check's command
    says ``--no-enable-prefix-caching``, off in V0 0.6 (its default)."""
    caching = {(run.source, run.prefix_caching) for run in RUNS}
    assert caching == {
        ("gpustack-lab", True),
        ("kvcached-h100", True),
        ("llm-k8s", True),
        ("vllm-spotcheck", False),
        ("qwen25-speed", False),
    }


def test_v0_chunked_budget_follows_the_vllm_version() -> None:
    by_row = {run.row: run for run in RUNS}
    assert (
        fidelity_validation._v0_chunked_budget(by_row["7B BF16 tp1 in63488 [setting-64k]"]) == 512
    )
    assert fidelity_validation._v0_chunked_budget(by_row["7B BF16 tp1 in6144"]) is None


def test_v1_batch_defaults_follow_the_vllm_version_and_gpu() -> None:
    """vLLM 0.8.2/0.8.3 seat 1,024 sequences on every GPU and give H100/H200 8,192 tokens;
    0.8.4 and >= 0.9 set what the v1 recipe does; 0.8.5 goes by memory (>= 70 GiB)."""
    by_label = {run.label: run for run in RUNS}
    llm_k8s = by_label["llm-k8s 70B A100-40GB tp8 sharegpt rate=16"]
    spot = by_label["vllm-spotcheck QwQ-32B H100 tp2 random 1000/2000 rate=10"]
    gpustack = by_label["gpustack-lab 8B H100 sharegpt c=4"]
    defaults = fidelity_validation.v1_batch_defaults
    assert defaults(llm_k8s) == (2048, 1024) and defaults(spot) == (8192, 1024)
    assert defaults(gpustack) is None
    assert defaults(replace(llm_k8s, vllm="0.8.4")) is None
    assert defaults(replace(llm_k8s, vllm="0.8.5")) == (2048, 256)
    assert defaults(replace(llm_k8s, vllm="0.8.5", gpu="A100-SXM4-80GB")) == (8192, 1024)
    serving = fidelity_validation._serve_cell(llm_k8s, 0, None).serving
    assert (serving.max_num_batched_tokens, serving.max_num_seqs) == (2048, 1024)
    assert fidelity_validation._serve_cell(gpustack, 0, None).serving.max_num_seqs is None


def test_v1_runs_of_vllm_082_and_083_count_the_cuda_context_and_tp_buffers() -> None:
    """0.8.2/0.8.3 subtract everything on the device but torch's allocation (the CUDA context,
    the TP buffers) and capture the graphs after: at TP > 1 that is 0.5 GiB more than the v1
    recipe's reserve, carried as a lower utilization; at TP 1 the same; other versions as run."""
    by_label = {run.label: run for run in RUNS}
    spot = by_label["vllm-spotcheck QwQ-32B H100 tp2 random 10000/500 rate=10"]
    llm_k8s = by_label["llm-k8s 70B A100-40GB tp8 sharegpt rate=16"]
    gpustack = by_label["gpustack-lab 14B H100 random 4k rate=inf"]
    utilization = fidelity_validation.v1_memory_utilization
    assert utilization(spot) == pytest.approx(0.9 - 0.5 / gpu_spec(spot.gpu).memory_gib)
    assert utilization(llm_k8s) == pytest.approx(
        llm_k8s.gpu_memory_utilization - 0.5 / gpu_spec(llm_k8s.gpu).memory_gib
    )
    assert utilization(replace(spot, tp=1)) == spot.gpu_memory_utilization
    assert utilization(gpustack) == gpustack.gpu_memory_utilization  # 0.11: the recipe's
    assert utilization(replace(spot, vllm="0.8.4")) == spot.gpu_memory_utilization
    cell = fidelity_validation._serve_cell(spot, 0, None)
    assert cell.serving.gpu_memory_utilization == utilization(spot)
    # 0.5 GiB / 128 KiB per token per GPU (64 layers x 4 KV heads x 128 x 2 x 2 B) = 256 blocks
    plan = plan_engine(spot.architecture, EngineFlags.of_cell(cell))
    assert plan.kv.num_blocks == 19277


def test_finite_rate_rows_are_simulated_at_the_sends_their_clients_drew() -> None:
    finite = [r for r in RUNS if r.request_rate is not None and r.request_rate != float("inf")]
    assert {r.source for r in finite} == {"kvcached-h100", "vllm-spotcheck", "llm-k8s"}
    for run in finite:
        schedules = fidelity_validation.published_sends(run)
        assert len(schedules) == {"kvcached-h100": 3, "vllm-spotcheck": 1, "llm-k8s": 1}[run.source]
        assert all(len(sends) == run.num_prompts for sends in schedules)
    burst = [r for r in RUNS if r.request_rate == float("inf") or r.interface == "offline-llm"]
    assert burst and all(fidelity_validation.published_sends(r) is None for r in burst)
    with pytest.raises(ValueError, match=r"no reconstruction of vLLM 0\.11\.0's client"):
        fidelity_validation.published_sends(replace(finite[0], vllm="0.11.0"))


def _point(metric: str, ratio: float, regime: str = "saturated") -> object:
    return fidelity_points.Point("validation", "s", regime, "H100-SXM5-80GB", "r", metric, 100.0,
                          (100.0 * ratio,))  # fmt: skip


def test_latency_table_sits_next_to_blis_figures() -> None:
    points = [
        _point("mean_ttft_ms", 0.5, "moderate"),
        _point("mean_ttft_ms", 1.1),
        _point("p99_ttft_ms", 1.0),
        _point("mean_e2el_ms", 0.9),
    ]
    lines = {line.split()[0]: line.split() for line in fidelity_points.format_vs_blis(points)[2:]}
    # metric, values, in band, MAPE, median, moderate MAPE, BLIS's 36 runs, BLIS's issue rows
    assert lines["mean_ttft_ms"] == ["mean_ttft_ms", "2", "50.0%", "30.0%", "30.0%", "50.0%",
                                     "17.6%", "15.1%"]  # fmt: skip
    assert lines["p99_ttft_ms"][-2:] == ["-", "47.8%"]
    assert lines["mean_e2el_ms"][-3:] == ["-", "6.7%", "7.5%"]
    assert "tpot" not in " ".join(lines)


def test_goals_say_how_many_values_each_missed_goal_lacks_and_where_they_are() -> None:
    points = [
        *[_point("mean_tpot_ms", 1.0) for _ in range(6)],
        *[_point("mean_tpot_ms", 0.5) for _ in range(3)],
        _point("mean_tpot_ms", 2.0),
        _point("mean_ttft_ms", 0.5, "moderate"),
        _point("mean_ttft_ms", 0.9, "moderate"),
    ]
    lines = fidelity_points.format_goals(points)
    assert lines[1].split() == ["all", "7/12", "58.3", "%", "goal", "85%:", "4", "values", "short"]
    assert lines[2].endswith("goal 70%: 1 values short")  # moderate: 1 of 2; 2 needed
    assert lines[3].endswith("goal 70%: 1 values short")  # saturated: 6 of 10; 7 needed
    # every point is on one GPU: 7 of 12, 9 needed for 70 %
    assert lines[4].split() == ["gpu", "H100-SXM5-80GB", "7/12", "58.3", "%", "goal", "70%:", "2",
                                "values", "short"]  # fmt: skip
    assert "30.0 % over 2 values (0.50, 0.90)  goal under 20 %: not met" in lines[5]
    saturated = next(line for line in lines if line.startswith("  saturated"))
    assert saturated.split()[3:7] == ["4/10", "(3", "below,", "1"]


def test_counts_without_e2e_leave_out_only_e2e() -> None:
    points = [_point("mean_e2el_ms", 0.5), _point("mean_tpot_ms", 1.0)]
    lines = fidelity_points.format_without_e2e(points)
    assert lines[0].endswith("(1 values left out)")
    assert lines[1].split()[1:3] == ["1/1", "100.0"]


def test_llm_k8s_request_lengths_add_up_to_the_published_totals() -> None:
    """Each run's per-request lengths (from its result file) in the order they were sent: 200
    requests, 42,659 prompt tokens in every run (the same prompts), and the run's own output
    total (no ``--ignore-eos``); the row's lengths are their means."""
    runs = [run for run in RUNS if run.source == "llm-k8s"]
    outputs = {"1": 42722, "4": 42449, "16": 42770, "inf": 42398}
    assert sorted(run.row.rsplit("=", 1)[1] for run in runs) == sorted(outputs)
    for run in runs:
        rows = [json.loads(line) for line in fidelity_validation.request_lengths(run).open()]
        inputs = [row["input_len"] for row in rows]
        assert len(rows) == run.num_prompts == 200 and sum(inputs) == 42659
        total = sum(row["output_len"] for row in rows)
        assert total == outputs[run.row.rsplit("=", 1)[1]]
        assert (run.input_len, run.output_len) == (round(42659 / 200), round(total / 200))
    assert fidelity_validation.request_lengths(RUNS[0]) is None


def test_a_primed_run_finds_its_prompts_cached_and_measures_only_its_own_requests() -> None:
    """llm-k8s's rate-inf run follows the rate-1 run on the same server: simulated after it, its
    200 prompts prefill from the cache (TTFT far below the same run simulated cold), and only
    its own 200 requests are measured (the same request throughput as the cold run, not one
    that spans the priming run)."""
    run = next(r for r in RUNS if r.label == "llm-k8s 70B A100-40GB tp8 sharegpt rate=inf")
    assert run.label in fidelity_validation.PRIMED_RUNS
    primed = fidelity_validation.predict_validation(run, 0)
    cold = fidelity_validation.predict_validation(replace(run, row="cold"), 0)
    assert primed["mean_ttft_ms"] < cold["mean_ttft_ms"] / 3
    assert primed["request_throughput_per_s"] == pytest.approx(
        cold["request_throughput_per_s"], rel=0.3
    )


def test_gpustack_sharegpt_run_borrows_llm_k8s_prompt_lengths_scaled_to_its_total() -> None:
    """Both clients sample ShareGPT alike at seed 0, so GPUStack's 100 prompts are llm-k8s's
    first 100: their lengths, in order, scaled to GPUStack's published 23,260 input tokens; the
    outputs stay at the published mean (each run's are its own model's answers)."""
    run = next(r for r in RUNS if r.label == "gpustack-lab 8B H100 sharegpt c=4")
    path, total = fidelity_validation.BORROWED_PROMPTS[run.label]
    assert total == 23260 and f"{total} input" in run.note
    borrowed = fidelity_validation.borrowed_lengths(run, path, total)
    source = [json.loads(line)["input_len"] for line in path.read_text().splitlines()][:100]
    assert sum(source) == 22398  # Llama 3.3's tokenizer; Qwen3's counted 23,260 (0.963)
    assert len(borrowed) == run.num_prompts == 100
    assert sum(inputs for inputs, _ in borrowed) == total
    assert {outputs for _, outputs in borrowed} == {run.output_len}
    for (inputs, _), length in zip(borrowed, source, strict=True):
        assert abs(inputs - length * total / sum(source)) < 1  # rounded, order kept


def test_gpustack_8b_concurrency_runs_differ_only_in_their_cap() -> None:
    """GPUStack's latency page runs the same 100 ShareGPT prompts at concurrency 1, 2, 4 and 8;
    one request at a time is the low regime, the caps above it moderate."""
    runs = {
        r.max_concurrency: r for r in RUNS if r.label.startswith("gpustack-lab 8B H100 sharegpt c=")
    }
    assert sorted(runs) == [1, 2, 4, 8]
    assert {c: r.regime for c, r in runs.items()} == {
        1: "low",
        2: "moderate",
        4: "moderate",
        8: "moderate",
    }
    for run in runs.values():
        assert run.label in fidelity_validation.BORROWED_PROMPTS
        assert replace(run, row="", max_concurrency=None, regime="", published={}) == replace(
            runs[4], row="", max_concurrency=None, regime="", published={}
        )
    assert runs[1].published["mean_ttft_ms"] == 59.01
    assert runs[8].published["p99_itl_ms"] == 45.48


def test_a_chat_stream_has_the_role_chunk_first_so_mean_itl_is_three_quarters_of_tpot() -> None:
    """vLLM's chat stream sends its role chunk with the first token's: TTFT is unchanged, a
    4-token request has 4 ITLs instead of 3 (the first 0), so the mean ITL is 3/4 of the TPOT,
    the ratio GPUStack's three 128-token runs publish (175/233, 396/529, 394/525)."""
    from servematrix.results.metrics import compute
    from servematrix.spec.trace import RequestRecord, to_table

    def one(request_id: int, sent_s: float) -> RequestRecord:
        chunks = [sent_s + 0.1 + 0.02 * k for k in range(4)]
        return RequestRecord(
            request_id, False, sent_s, sent_s, chunks[0], chunks[-1], chunks, [1, 1, 1, 1],
            8, 4, True, request_input_len=8, request_output_len=4,
        )  # fmt: skip

    records = [one(k, 0.5 * k) for k in range(3)]
    chat = [fidelity_points.as_chat_stream(r) for r in records]
    assert chat[0].chunk_s[:2] == [0.1, 0.1] and chat[0].chunk_tokens == [0, 1, 1, 1, 1]
    assert fidelity_points.as_chat_stream(replace(records[0], chunk_s=[], chunk_tokens=[])) == (
        replace(records[0], chunk_s=[], chunk_tokens=[])
    )
    run = next(r for r in RUNS if r.label == "gpustack-lab 14B A100 random 128 rate=inf")
    cell = identity(fidelity_validation._serve_cell(run, 0, None))
    plain, chatted = (compute(to_table(cell, rs, {})) for rs in (records, chat))
    assert chatted.mean_ttft_ms == pytest.approx(plain.mean_ttft_ms)
    assert chatted.mean_tpot_ms == pytest.approx(plain.mean_tpot_ms) == pytest.approx(20.0)
    assert chatted.mean_itl_ms == pytest.approx(0.75 * plain.mean_itl_ms)


def test_only_the_runs_measured_through_the_chat_endpoint_get_chat_streams() -> None:
    sources = (BENCHMARKS / "data" / "SOURCES.md").read_text().split("\n### ")
    for section in sources[1:]:
        name = section.split("`")[1]
        if name in {run.source for run in RUNS if run.interface == "serve"}:
            chat = "--backend openai-chat" in section
            assert chat == (name in fidelity_validation.CHAT_SOURCES), name


def test_chat_runs_prefill_the_chat_template_around_the_published_prompt() -> None:
    """Qwen3's template adds <|im_start|>user\\n ... <|im_end|>\\n<|im_start|>assistant\\n, 8
    tokens the client's published input count leaves out; a completions run gets none."""
    by_label = {run.label: run for run in RUNS}
    chat = by_label["gpustack-lab 14B A100 random 128 rate=inf"]
    plain = by_label["vllm-spotcheck QwQ-32B H100 tp2 random 1000/2000 rate=10"]
    assert fidelity_validation._serve_cell(chat, 0, None).workload.input_len == 128 + 8
    assert fidelity_validation._serve_cell(plain, 0, None).workload.input_len == 1000
