"""Findings on hand-built summaries: the right winner, the right numbers, the right direction."""

from __future__ import annotations

import math
import re

import polars as pl
import pytest

from servematrix.capacity.confirm import Candidate, Candidates, Comparison
from servematrix.reporting.findings import Context, Findings, study_findings, to_html, to_markdown
from servematrix.reporting.findings.recommend import (
    ANSWER_WORDS,
    answer_words,
    fmt_rate,
    study_question,
)
from servematrix.spec.matrix import MODES


def cell(
    model: str,
    mode: str,
    xv: float,
    ttft: float,
    tpot: float = 10.0,
    x: str = "qps",
    **overrides: float,
) -> dict:
    """One summary row; P99s are twice the means unless overridden."""
    row = {
        "model": model,
        "mode": mode,
        "qps": float(xv) if x == "qps" else 16.0,
        "input_len": int(xv) if x == "input_len" else 1024,
        "num_prompts": 200,
        "completed": 200,
        "failed": 0,
        "scheduled_qps": float(xv) if x == "qps" else 16.0,
        "achieved_qps": float(xv) if x == "qps" else 16.0,
        "send_lag_p99_ms": 0.5,
        "mean_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "mean_tpot_ms": tpot,
        "p99_tpot_ms": 2 * tpot,
        "p99_itl_ms": 2 * tpot,
    }
    return row | overrides


def findings(rows: list[dict], x: str = "qps") -> Findings:
    return study_findings(pl.DataFrame(rows), "Test study", x)


def section(result: Findings, title: str) -> list[str]:
    matches = [s.sentences for s in result.sections if s.title == title]
    assert matches, f"no section {title!r} in {[s.title for s in result.sections]}"
    return matches[0]


def titles(result: Findings) -> list[str]:
    return [s.title for s in result.sections]


PLAIN_VS_CHUNKED = [
    cell("m", "nondisagg", 2, 100.0, tpot=20.0),
    cell("m", "nondisagg", 4, 200.0, tpot=30.0),
    cell("m", "chunked", 2, 120.0, tpot=15.0),
    cell("m", "chunked", 4, 300.0, tpot=25.0),
]


def winner_rows(result: Findings) -> list[list[str]]:
    tables = [s.tables for s in result.sections if s.title == "Lowest latency at each point"]
    assert tables, titles(result)
    return tables[0][0].rows


def test_winner_at_each_x_with_margin() -> None:
    rows = winner_rows(findings(PLAIN_VS_CHUNKED))
    assert rows[0] == [
        "QPS 2",
        "nondisagg 100.0 ms, 20.0 ms (16.7%) below chunked",
        "chunked 15.0 ms, 5.0 ms (25.0%) below nondisagg",
    ]
    assert rows[1][1].startswith("nondisagg 200.0 ms, 100.0 ms")


def test_plain_vs_chunked_gap_grows() -> None:
    sentences = section(findings(PLAIN_VS_CHUNKED), "Plain vs chunked prefill")
    ttft = next(s for s in sentences if s.startswith("Mean TTFT"))
    assert "chunked vs nondisagg: +20.0 ms (+20.0%) at QPS 2, +100.0 ms (+50.0%) at QPS 4" in ttft
    assert "the gap grows from 20.0 ms at QPS 2 to 100.0 ms at QPS 4" in ttft
    tpot = next(s for s in sentences if s.startswith("P99 TPOT"))
    assert "-10.0 ms (-25.0%) at QPS 2" in tpot
    assert "stays about the same" in tpot
    assert any(s.startswith("P99 ITL") for s in sentences)


def test_plain_vs_chunked_on_one_instance() -> None:
    rows = [
        {**row, "mode": row["mode"].replace("nondisagg", "single-plain")}
        for row in PLAIN_VS_CHUNKED
    ]
    rows = [{**row, "mode": row["mode"].replace("chunked", "single-chunked")} for row in rows]
    sentences = section(findings(rows), "Plain vs chunked prefill, one instance")
    ttft = next(s for s in sentences if s.startswith("Mean TTFT"))
    assert "single-chunked vs single-plain: +20.0 ms (+20.0%) at QPS 2" in ttft
    assert "Plain vs chunked prefill" not in titles(findings(rows))


def test_rdma_vs_tcp_gap_shrinks_and_changes_sign() -> None:
    rows = [
        cell("m", "mooncake-rdma", 2, 100.0),
        cell("m", "mooncake-rdma", 4, 100.0),
        cell("m", "mooncake-rdma", 8, 100.0),
        cell("m", "mooncake-tcp", 2, 150.0, tpot=12.0),
        cell("m", "mooncake-tcp", 4, 120.0, tpot=11.0),
        cell("m", "mooncake-tcp", 8, 90.0, tpot=10.5),
    ]
    sentences = section(findings(rows), "Mooncake RDMA vs TCP")
    assert "the gap changes sign from 50.0 ms at QPS 2 to -10.0 ms at QPS 8" in sentences[0]
    assert "the gap shrinks from 2.0 ms at QPS 2 to 0.5 ms at QPS 8" in sentences[2]
    assert "Plain vs chunked prefill" not in titles(findings(rows))


def test_disaggregation_trade_off_per_model() -> None:
    rows = []
    for model, scale in (("big", 2.0), ("small", 1.0)):
        for xv in (2, 4):
            rows += [
                cell(model, "nondisagg", xv, 100.0 * scale, tpot=30.0),
                cell(model, "chunked", xv, 110.0 * scale, tpot=25.0),
                cell(model, "mooncake-rdma", xv, 150.0 * scale, tpot=10.0),
                cell(model, "mooncake-tcp", xv, 170.0 * scale, tpot=12.0),
            ]
    sentences = section(findings(rows), "Aggregated vs disaggregated prefill")
    assert len(sentences) == 6
    ttft = sentences[0]
    assert ttft.startswith("Mean TTFT for big, disaggregated (best of mooncake-rdma, mooncake-tcp)")
    assert "vs aggregated (best of nondisagg, chunked): +100.0 ms (+50.0%) at QPS 2" in ttft
    assert "Mean TPOT for big" in sentences[1] and "-15.0 ms (-60.0%) at QPS 2" in sentences[1]
    assert sentences[2] == (
        "Disaggregated serving for big has the lower mean TTFT at 0 of 2 points and the lower "
        "mean TPOT at 2 of 2 points (QPS 2, QPS 4): at most points it trades a higher TTFT for "
        "a lower TPOT."
    )
    assert "for small" in sentences[3]


def test_models_fastest_and_most_stable() -> None:
    rows = [
        cell("steady", "single", 2, 30.0, tpot=8.0),
        cell("steady", "single", 4, 33.0, tpot=8.0),
        cell("steady", "single", 8, 36.0, tpot=9.0),
        cell("fragile", "single", 2, 40.0, tpot=5.0),
        cell("fragile", "single", 4, 60.0, tpot=5.0),
        cell("fragile", "single", 8, 120.0, tpot=6.0),
    ]
    result = findings(rows)
    sentences = section(result, "Model comparison")
    assert sentences[0] == "steady has the lowest mean TTFT at 3 of 3 points (QPS 2, QPS 4, QPS 8)."
    assert sentences[1].startswith("fragile has the lowest mean TPOT at 3 of 3 points")
    assert sentences[2] == (
        "From QPS 2 to QPS 8, mean TTFT changes by steady +20% (30.0 ms → 36.0 ms), "
        "fragile +200% (40.0 ms → 120.0 ms); steady is the most stable."
    )
    assert "P99 TTFT" in sentences[3]
    assert "Plain vs chunked prefill" not in titles(result)


def test_input_length_axis_wording() -> None:
    rows = [
        cell("a", "single", 1024, 50.0, x="input_len"),
        cell("a", "single", 4096, 200.0, x="input_len"),
        cell("b", "single", 1024, 70.0, x="input_len"),
        cell("b", "single", 4096, 140.0, x="input_len"),
    ]
    result = findings(rows, x="input_len")
    stability = section(result, "Model comparison")[2]
    assert stability.startswith("From input 1024 tokens to input 4096 tokens")
    assert stability.endswith("b is the most stable.")
    assert "mean TTFT jumps 4.0× from 50.0 ms at input 1024 tokens" in " ".join(
        section(result, "Saturation")
    )


def test_saturation_jump_and_incomplete_cells() -> None:
    rows = [
        cell("m", "single", 2, 100.0),
        cell("m", "single", 4, 150.0),
        cell("m", "single", 6, 450.0, completed=150, failed=50),
    ]
    sentences = section(findings(rows), "Saturation")
    assert (
        "m: mean TTFT jumps 3.0× from 150.0 ms at QPS 4 to 450.0 ms at QPS 6, a sign of saturation."
    ) in sentences
    assert "m at QPS 6 completed only 150 of 200 requests." in sentences


def test_no_saturation_says_so() -> None:
    rows = [cell("m", "single", 2, 100.0), cell("m", "single", 4, 199.0)]
    sentences = section(findings(rows), "Saturation")
    assert sentences == [
        "No configuration saturates: no TTFT more than doubles between consecutive QPS values "
        "and every cell completed all its requests."
    ]


def test_harness_health_and_failures() -> None:
    rows = [
        cell("m", "nondisagg", 4, 100.0, achieved_qps=3.5),
        cell("m", "chunked", 4, 100.0, send_lag_p99_ms=7.25, failed=3),
        cell("m", "chunked", 2, 100.0, scheduled_qps=2.08, achieved_qps=2.08),
    ]
    sentences = section(findings(rows), "Harness health and failures")
    assert sentences == [
        "nondisagg at QPS 4: sent 3.50 requests/s where the schedule asked for 4.00 (-12.5%).",
        "chunked at QPS 4: P99 send lag is 7.2 ms (limit 5 ms).",
        "3 request(s) failed, in 1 of 3 cells: chunked at QPS 4 (3).",
    ]


def test_healthy_harness() -> None:
    sentences = section(findings(PLAIN_VS_CHUNKED), "Harness health and failures")
    assert sentences[0].startswith("Every cell's requests were sent within 1%")
    assert sentences[1] == "No request failed in any of the 4 cells."


def test_a_concurrency_cap_is_not_called_a_lagging_client() -> None:
    """Under max_concurrency a request waits for a slot: slow sending is the workload's doing."""
    rows = [
        cell("m", "single", 4, 100.0, max_concurrency=2, achieved_qps=3.1, send_lag_p99_ms=640.0),
        cell("m", "single", 8, 100.0, max_concurrency=2),
    ]
    sentences = section(findings(rows), "Harness health and failures")
    assert sentences == [
        "Every cell's requests were sent within 1% of its schedule's rate with a P99 send "
        "lag of at most 5 ms where no concurrency cap held requests back.",
        "m at QPS 4 held at most 2 requests in flight (max_concurrency): its sending rate "
        "and P99 send lag (640.0 ms) include waiting for a free slot.",
        "No request failed in any of the 2 cells.",
    ]


def test_single_cell_does_not_compare() -> None:
    result = findings([cell("m", "single", 2, 100.0)])
    assert titles(result) == ["Saturation", "Harness health and failures"]


def test_zero_and_missing_values_do_not_divide_by_zero() -> None:
    rows = [
        cell("a", "single", 2, 0.0, tpot=0.0, achieved_qps=0.0),
        cell("a", "single", 4, 0.0, tpot=0.0),
        cell("b", "single", 2, 0.0, tpot=0.0),
        cell("b", "single", 4, math.nan, tpot=math.inf, completed=0, failed=200),
    ]
    result = findings(rows)
    text = to_markdown(result)
    assert "tie: a, b (0.0 ms)" in text
    assert "below" not in text
    assert "b at QPS 4 completed only 0 of 200 requests." in text
    assert "nan" not in text.lower()


def test_zero_target_qps_is_not_a_deviation() -> None:
    result = findings([cell("m", "single", 0, 10.0, scheduled_qps=0.0, achieved_qps=0.0)])
    assert "within 1%" in section(result, "Harness health and failures")[0]


def test_requests_sent_at_one_instant() -> None:
    result = findings([cell("m", "single", 4, 10.0, achieved_qps=math.inf)])
    sentences = section(result, "Harness health and failures")
    assert (
        sentences[0]
        == "m at QPS 4: every request was sent at the same instant (no measurable rate)."
    )


def test_empty_summary() -> None:
    empty = pl.DataFrame([cell("m", "single", 2, 1.0)]).clear()
    result = study_findings(empty, "Empty", "qps")
    assert result.sections[0].sentences == ["The study summary has no cells."]


@pytest.mark.parametrize(
    ("summary", "x", "message"),
    [
        (pl.DataFrame([cell("m", "single", 2, 1.0)]).drop("p99_itl_ms"), "qps", "p99_itl_ms"),
        (pl.DataFrame([cell("m", "single", 2, 1.0)]), "latency", "x must be"),
        (pl.DataFrame([cell("m", "single", 2, 1.0)] * 2), "qps", "several rows"),
    ],
)
def test_bad_input_is_named(summary: pl.DataFrame, x: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        study_findings(summary, "t", x)


def test_markdown_rendering() -> None:
    text = to_markdown(findings(PLAIN_VS_CHUNKED))
    assert text.startswith(
        "# Findings: Test study\n\n## Lowest latency at each point\n\n"
        "| point | lowest mean TTFT | lowest mean TPOT |\n| --- | --- | --- |\n| QPS 2 |"
    )
    assert "\n## Plain vs chunked prefill\n" in text


def test_html_is_escaped_and_self_contained() -> None:
    rows = [cell("<script>alert(1)</script>", "single", 2, 1.0), cell("a&b", "single", 2, 2.0)]
    page = to_html(study_findings(pl.DataFrame(rows), "R&D <study>", "qps"))
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "R&amp;D &lt;study&gt;" in page
    assert "a&amp;b" in page
    assert "http" not in page


def test_a_tie_is_never_a_win() -> None:
    """0.02 ms apart: the sentences say "the same", never "0.0 ms (0.0%) below"."""
    rows = [
        cell("m", "nondisagg", 2, 100.0),
        cell("m", "nondisagg", 4, 100.0),
        cell("m", "chunked", 2, 100.02),
        cell("m", "chunked", 4, 100.0),
    ]
    result = findings(rows)
    text = to_markdown(result)
    assert "0.0 ms (0.0%)" not in text and "0.0 ms to 0.0 ms" not in text
    assert winner_rows(result)[0] == [
        "QPS 2",
        "tie: nondisagg, chunked (100.0 ms)",
        "tie: chunked, nondisagg (10.0 ms)",
    ]
    ttft = section(result, "Plain vs chunked prefill")[0]
    assert ttft == (
        "Mean TTFT, chunked vs nondisagg: the same at QPS 2, the same at QPS 4; "
        "the two are the same at QPS 2 and at QPS 4."
    )


def test_a_gap_opening_from_a_tie() -> None:
    rows = [
        cell("m", "nondisagg", 2, 100.0),
        cell("m", "nondisagg", 4, 100.0),
        cell("m", "chunked", 2, 100.04),
        cell("m", "chunked", 4, 150.0),
    ]
    ttft = section(findings(rows), "Plain vs chunked prefill")[0]
    assert "the gap opens from none at QPS 2 to 50.0 ms at QPS 4" in ttft


def test_tied_models_win_no_point() -> None:
    rows = [cell(name, "single", q, 100.0 + q) for name in ("a", "b") for q in (2, 4)]
    sentences = section(findings(rows), "Model comparison")
    assert sentences[0] == "No model has a lower mean TTFT than the others (2 points compared)."


# --- Preemption and memory ---------------------------------------------------------------------


def preempting(mode: str, xv: float, preempted: int | None, share: float | None = None, **more):
    """A summary row with the preemption columns (None: the backend cannot count them)."""
    counts = {
        "preemptions_total": None if preempted is None else 2 * preempted,
        "preempted_requests": preempted,
        "slowest_preempted_share": share,
        "preempted_median_e2el_ms": more.pop("preempted_ms", None),
        "unpreempted_median_e2el_ms": more.pop("unpreempted_ms", None),
    }
    return cell("m", mode, xv, 100.0, **counts, **more)


def test_a_sentence_when_preemption_drives_the_tail() -> None:
    rows = [
        preempting("nondisagg", 2, 0, 0.0, unpreempted_ms=900.0),
        preempting("nondisagg", 8, 37, 1.0, preempted_ms=5200.0, unpreempted_ms=1300.0),
        preempting("chunked", 2, 0, 0.0, unpreempted_ms=900.0),
        preempting("chunked", 8, 5, 0.5, preempted_ms=2000.0, unpreempted_ms=1250.5),
    ]
    sentences = section(findings(rows), "Preemption")
    assert sentences == [
        "nondisagg at QPS 8: 37 of 200 requests were preempted (74 preemptions) and they are "
        "100% of the slowest 1% by E2E latency; their median E2E latency is 5,200.0 ms against "
        "1,300.0 ms for the others: preemption drives the tail.",
        "chunked at QPS 8: 5 of 200 requests were preempted (10 preemptions) and they are 50% "
        "of the slowest 1% by E2E latency; their median E2E latency is 2,000.0 ms against "
        "1,250.5 ms for the others: preemption drives the tail.",
    ]


def test_preemptions_that_do_not_drive_the_tail_are_named_apart() -> None:
    rows = [preempting("nondisagg", 2, 3, 0.0), preempting("nondisagg", 8, 9, 0.49)]
    assert section(findings(rows), "Preemption") == [
        "Requests were preempted without driving the tail (under 50% of the slowest 1% by E2E "
        "latency preempted) in: m at QPS 2 (3 of 200 requests), m at QPS 8 (9 of 200 requests)."
    ]


def test_no_preemption_is_said_and_unknown_preemption_is_not() -> None:
    none = [preempting("nondisagg", 2, 0, 0.0), preempting("nondisagg", 8, 0, 0.0)]
    assert section(findings(none), "Preemption") == [
        "No request was preempted in any of the 2 cells that count them."
    ]
    unknown = [preempting("nondisagg", 2, None), preempting("nondisagg", 8, None)]
    assert "Preemption" not in titles(findings(unknown))
    assert "Preemption" not in titles(findings(PLAIN_VS_CHUNKED))  # no such columns


def model_memory(model: str, xv: float, gpu_mib: float, kv_usage: float, **split: float):
    return cell(
        model,
        "single",
        xv,
        100.0,
        peak_gpu_memory_mib=gpu_mib,
        peak_kv_cache_usage=kv_usage,
        **split,
    )


def test_models_compared_on_gpu_memory_and_kv_cache_usage() -> None:
    rows = [
        model_memory(
            "72b", 2, 65536.0, 0.020, weights_mib_per_gpu=34000.0, kv_pool_mib_per_gpu=28000.0
        ),
        model_memory(
            "72b", 8, 65536.0, 0.310, weights_mib_per_gpu=34000.0, kv_pool_mib_per_gpu=28000.0
        ),
        model_memory(
            "72b-awq", 2, 65536.0, 0.010, weights_mib_per_gpu=10000.0, kv_pool_mib_per_gpu=52000.0
        ),
        model_memory(
            "72b-awq", 8, 65536.0, 0.120, weights_mib_per_gpu=10000.0, kv_pool_mib_per_gpu=52000.0
        ),
    ]
    assert section(findings(rows), "Memory") == [
        "Peak GPU memory (busiest GPU) is the same for every model, 65,536 MiB (vLLM claims its "
        "share of every GPU at start-up and fills what the weights leave with KV cache; "
        "modelled per GPU: 72b-awq 10,000 MiB of weights and a 52,000 MiB KV pool, 72b 34,000 "
        "MiB of weights and a 28,000 MiB KV pool).",
        "Peak KV-cache usage: 72b 2.0% at QPS 2 → 31.0% at QPS 8, 72b-awq 1.0% at QPS 2 → 12.0% "
        "at QPS 8; 72b fills its cache most (31.0%).",
    ]


def test_measured_gpu_memory_is_ranked() -> None:
    rows = [
        model_memory("a", 2, 70000.0, 0.5),
        model_memory("a", 4, 71000.0, 0.6),
        model_memory("b", 2, 41000.0, 0.2),
        model_memory("b", 4, 40000.0, 0.3),
    ]
    gpu, kv = section(findings(rows), "Memory")
    assert gpu == (
        "Peak GPU memory (busiest GPU), highest over the QPS values: b 41,000 MiB, a 71,000 MiB; "
        "b needs the least."
    )
    assert kv.endswith("a fills its cache most (60.0%).")


def test_no_memory_sentence_without_memory_figures() -> None:
    rows = [model_memory("a", 2, None, None), model_memory("b", 2, None, None)]
    assert "Memory" not in titles(findings(rows))
    assert "Memory" not in titles(findings(PLAIN_VS_CHUNKED))


def test_modes_with_one_memory_layout_are_summed_up_once() -> None:
    rows = [
        cell(
            "m",
            mode,
            2,
            100.0,
            peak_gpu_memory_mib=65536.0,
            peak_kv_cache_usage=usage,
            weights_mib_per_gpu=5000.0,
            kv_pool_mib_per_gpu=55000.0,
        )
        for mode, usage in (("nondisagg", 0.1), ("chunked", 0.1))
    ]
    assert section(findings(rows), "Memory") == [
        "Peak GPU memory (busiest GPU) is the same for every mode, 65,536 MiB (vLLM claims its "
        "share of every GPU at start-up and fills what the weights leave with KV cache; "
        "modelled per GPU: 5,000 MiB of weights and a 55,000 MiB KV pool for every mode).",
        "Peak KV-cache usage: nondisagg 10.0% at QPS 2, chunked 10.0% at QPS 2; nondisagg fills "
        "its cache most (10.0%).",
    ]


def with_band(row: dict, column: str, half: float) -> dict:
    return row | {f"{column}_lo": row[column] - half, f"{column}_hi": row[column] + half}


def test_overlapping_intervals_are_the_same_within_noise() -> None:
    """2 ms apart with ±3 ms intervals: no winner and no gap; ±0.5 ms: a difference."""
    noisy = [
        with_band(cell("m", "nondisagg", 2, 100.0), "mean_ttft_ms", 3.0),
        with_band(cell("m", "chunked", 2, 102.0), "mean_ttft_ms", 3.0),
    ]
    result = findings(noisy)
    assert winner_rows(result)[0][1] == (
        "nondisagg, chunked: the same within noise (100.0 ms [97.0, 103.0] vs "
        "102.0 ms [99.0, 105.0])"
    )
    ttft = section(result, "Plain vs chunked prefill")[0]
    assert ttft == (
        "Mean TTFT, chunked vs nondisagg: the same within noise (102.0 ms [99.0, 105.0] vs "
        "100.0 ms [97.0, 103.0]) at QPS 2."
    )
    tight = [with_band(row, "mean_ttft_ms", 0.5) for row in noisy]
    assert winner_rows(findings(tight))[0][1].startswith("nondisagg 100.0 ms, 2.0 ms (2.0%)")


def capacity_row(model: str, mode: str, rate: float, gpus: int = 2, **overrides) -> dict:
    spec = MODES[mode]
    topology = "1P(TP1)+1D(TP1)" if spec.disaggregated else f"{spec.instances}x(TP1)"
    row = {
        "model": model, "mode": mode, "topology": topology, "recipe": "v0", "input_len": 1024,
        "output_len": 6,
        "gpus": gpus, "repeats": 1, "capacity": rate, "capacity_lo": rate,
        "capacity_hi": rate * 1.02, "capacity_per_gpu": rate / gpus,
        "output_tokens_per_s_per_gpu": rate * 6 / gpus, "breaks_first": "P99 TPOT",
        "cost_per_mtok_usd": 2.0 * gpus / 3600 / (rate * 6) * 1e6, "probes": 9,
        "probe_requests": 7000, "search_wall_s": 0.2, "capacity_unit": "req/s",
        "level_unit": "req/s", "ceiling": None,
    }  # fmt: skip
    return row | overrides


def test_the_recommendation_comes_first_with_its_numbers() -> None:
    capacity = pl.DataFrame(
        [
            capacity_row("m", "chunked", 21.0),
            capacity_row("m", "nondisagg", 17.5),
            capacity_row("m", "mooncake-rdma", 1.7, breaks_first="attainment"),
        ]
    )
    rows = PLAIN_VS_CHUNKED + [cell("m", "mooncake-rdma", q, 900.0) for q in (2, 4)]
    rows = [r | {"mean_e2el_ms": r["mean_ttft_ms"] + 5 * r["mean_tpot_ms"]} for r in rows]
    context = Context("P99 TTFT ≤ 2000 ms", "Simulated, not measured.")
    result = study_findings(pl.DataFrame(rows), "Test study", "qps", capacity, context)
    assert titles(result)[:2] == ["Recommendation", "Capacity at the SLO"]
    answer = result.sections[0]
    assert answer.sentences[:3] == [
        "The question: the best mode, at the SLO (P99 TTFT ≤ 2000 ms).",
        "Run chunked: 10.5 req/s per GPU (21 req/s on 2 GPUs, 63 output tokens/s per GPU, "
        "$8.82 per million output tokens), 20% more than nondisagg (8.75).",
        "mooncake-rdma carries the least (0.85 req/s per GPU; above 1.7 req/s its attainment "
        "breaks first).",
    ]
    assert answer.sentences[3] == (
        "By mean E2E latency at the study's loads the winner changes: nondisagg at QPS 4 "
        "(350.0 ms; chunked 425.0 ms)."
    )
    assert answer.sentences[4] == "P99 TPOT is the first bound to break for 2 of 3 configurations."
    assert answer.sentences[-1] == "Simulated, not measured."
    assert not answer.tables  # the detail is below the answer
    detail = result.sections[1]
    assert [r[1] for r in detail.tables[0].rows] == ["chunked", "nondisagg", "mooncake-rdma"]
    assert detail.tables[0].rows[0][4:6] == ["10.5", "[10.5, 10.7]"]
    same = pl.DataFrame(
        [capacity_row("a", "single", 10.0, capacity_hi=12.0), capacity_row("b", "single", 11.0)]
    )
    tied = study_findings(
        pl.DataFrame([cell(n, "single", 2, 100.0) for n in "ab"]), "t", "qps", same, context
    )
    assert "the same within noise as a ([5.5, 5.61] vs [5, 6]" in tied.sections[0].sentences[1]


def test_other_input_lengths_get_a_ranking_each() -> None:
    capacity = pl.DataFrame(
        [
            capacity_row("small", "single", 7.0, gpus=1),
            capacity_row("big", "single", 2.0, gpus=4),
            capacity_row("small", "single", 0.5, gpus=1, input_len=4096),
            capacity_row("big", "single", 0.45, gpus=1, input_len=4096, capacity_hi=0.6),
        ]
    )
    rows = [
        cell(m, "single", n, 100.0, x="input_len") for m in ("small", "big") for n in (1024, 4096)
    ]
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    result = study_findings(pl.DataFrame(rows), "t", "input_len", capacity, context)
    answer = result.sections[0].sentences
    assert (
        answer[0] == "The question: the best model at each input, at the SLO (P99 TTFT ≤ 2000 ms)."
    )
    assert answer[1].startswith("For input 1024 tokens, run small: 7 req/s per GPU")
    assert answer[1].endswith("14.0× the capacity of big (0.5).")
    assert answer[2].startswith("For input 4096 tokens, run small: 0.5 req/s per GPU")
    assert "the same within noise as big ([0.5, 0.51] vs [0.45, 0.6]" in answer[2]
    # small wins at 1024 and ties big at 4096: the same winner, no flip claimed
    assert answer[3] == "small is the best model for every input length."
    assert [t.title for t in result.sections[1].tables] == [
        "input 1024 tokens",
        "input 4096 tokens",
    ]


MODES_BY_MODEL = [
    capacity_row("Qwen2.5-72B", "chunked", 2.8, gpus=8),
    capacity_row("Qwen2.5-72B", "nondisagg", 1.9, gpus=8),
    capacity_row("Qwen2.5-72B", "mooncake-tcp", 0.2, gpus=8),
    capacity_row("Qwen2.5-7B", "nondisagg", 21.0),
    capacity_row("Qwen2.5-7B", "chunked", 17.5),
    capacity_row("Qwen2.5-7B", "mooncake-tcp", 1.6),
]


def modes_summary() -> pl.DataFrame:
    return pl.DataFrame(
        [cell(r["model"], r["mode"], q, 100.0) for r in MODES_BY_MODEL for q in (2, 4)]
    )


def test_a_modes_study_recommends_per_model_never_across_models() -> None:
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    result = study_findings(modes_summary(), "t", "qps", pl.DataFrame(MODES_BY_MODEL), context)
    answer = result.sections[0].sentences
    assert answer[0].startswith("The question: the best mode for each model, at the SLO")
    assert answer[1].startswith("For Qwen2.5-72B, run chunked: 0.35 req/s per GPU (2.8 req/s on 8")
    assert answer[1].endswith("47% more than nondisagg (0.237).")
    assert answer[2].startswith("For Qwen2.5-7B, run nondisagg: 10.5 req/s per GPU")
    assert answer[2].endswith("20% more than chunked (8.75).")
    assert (
        "The best mode is not the same for every model: chunked for Qwen2.5-72B; nondisagg for "
        "Qwen2.5-7B." in answer
    )
    # One ranking table per model, each of its own modes only.
    tables = result.sections[1].tables
    assert [t.title for t in tables] == ["Qwen2.5-72B", "Qwen2.5-7B"]
    assert [[r[1] for r in t.rows] for t in tables] == [
        ["chunked", "nondisagg", "mooncake-tcp"],
        ["nondisagg", "chunked", "mooncake-tcp"],
    ]


def test_no_flip_is_claimed_when_the_winner_is_the_same() -> None:
    same_winner = [
        r | {"capacity": 30.0, "capacity_lo": 30.0, "capacity_hi": 30.6}
        if (r["model"], r["mode"]) == ("Qwen2.5-7B", "chunked")
        else r
        for r in MODES_BY_MODEL
    ]
    capacity = pl.DataFrame(same_winner).with_columns(
        (pl.col("capacity") / pl.col("gpus")).alias("capacity_per_gpu")
    )
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    summary = modes_summary().with_columns(mean_e2el_ms=pl.lit(150.0))
    answer = study_findings(summary, "t", "qps", capacity, context).sections[0].sentences
    assert "chunked is the best mode for every model." in answer
    assert not any("not the same" in s or "changes" in s for s in answer), answer


def test_a_latency_lead_of_an_overloaded_point_is_not_a_flip() -> None:
    capacity = pl.DataFrame(
        [capacity_row("m", "chunked", 21.0), capacity_row("m", "nondisagg", 9.0)]
    )
    rows = [
        cell("m", "chunked", 8, 100.0, mean_e2el_ms=900.0, steady=True),
        cell("m", "nondisagg", 8, 100.0, mean_e2el_ms=500.0, steady=False),
        cell("m", "chunked", 2, 100.0, mean_e2el_ms=400.0, steady=True),
        cell("m", "nondisagg", 2, 100.0, mean_e2el_ms=300.0, steady=True),
    ]
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    result = study_findings(pl.DataFrame(rows), "t", "qps", capacity, context)
    flip = [s for s in result.sections[0].sentences if "winner changes" in s]
    assert flip == [
        "By mean E2E latency at the study's loads the winner changes: nondisagg at QPS 2 "
        "(300.0 ms; chunked 400.0 ms); 1 overloaded point(s) are left out."
    ]
    assert section(result, "Overloaded points") == [
        "1 of 4 points are overloaded: queue growing, latency depends on run length; the latency "
        "comparisons below leave them out: nondisagg at QPS 8."
    ]
    # The per-point latency table compares steady points only.
    rows_by_point = {r[0]: r for r in winner_rows(result)}
    assert "QPS 8" not in rows_by_point and "nondisagg" in rows_by_point["QPS 2"][1]


def test_without_the_steady_column_no_point_is_overloaded() -> None:
    assert "Overloaded points" not in titles(findings(PLAIN_VS_CHUNKED))


def test_a_config_without_slo_says_so_and_shows_the_line_to_add() -> None:
    context = Context("no SLO", "Caveat.")
    result = study_findings(pl.DataFrame(PLAIN_VS_CHUNKED), "t", "qps", None, context)
    answer = section(result, "Recommendation")
    assert answer[0].startswith("No SLO is set, so there is no recommendation")
    assert answer[1].endswith(
        "slo: {ttft: {statistic: p99, max_ms: 2000}, tpot: {statistic: p99, max_ms: 100}, "
        "attainment: 0.9}"
    )
    assert "No SLO is set" in to_markdown(result)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1e4, "10,000"),
        (12345.0, "12,300"),
        (1e9, "1,000,000,000"),
        (351.4, "351"),
        (0.02794, "0.0279"),
        (0.0000123, "0.0000123"),
        (21.0, "21"),
        (10.5, "10.5"),
        (9.996, "10"),
        (0.0, "0"),
    ],
)
def test_rates_have_three_significant_figures_and_no_exponent(value: float, text: str) -> None:
    assert fmt_rate(value) == text


def test_no_number_in_the_findings_is_in_scientific_notation() -> None:
    capacity = pl.DataFrame(
        [
            capacity_row("tiny", "single", 1e-5, gpus=1),
            capacity_row("huge", "single", 1e9, gpus=1, cost_per_mtok_usd=1e-9),
        ]
    )
    rows = [cell(m, "single", q, 100.0) for m in ("tiny", "huge") for q in (1e9, 0.00001)]
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    text = to_markdown(study_findings(pl.DataFrame(rows), "t", "qps", capacity, context))
    assert "QPS 1000000000" in text and "1,000,000,000 req/s" in text
    assert not re.search(r"\d[eE][+-]?\d", text), re.findall(r".{30}\d[eE][+-]?\d.{10}", text)


def test_the_answer_stays_within_its_word_budget() -> None:
    """Twelve models of four modes: the per-model sentences that do not fit give way to a
    pointer to the tables below."""
    models = [f"model-{i}-with-a-rather-long-name" for i in range(12)]
    capacity = pl.DataFrame(
        [
            capacity_row(m, mode, rate * (i + 1))
            for i, m in enumerate(models)
            for mode, rate in (("chunked", 3.0), ("nondisagg", 2.0), ("mooncake-tcp", 1.0))
        ]
    )
    rows = [
        cell(m, mode, 2, 100.0) for m in models for mode in ("chunked", "nondisagg", "mooncake-tcp")
    ]
    context = Context("P99 TTFT ≤ 2000 ms, P99 TPOT ≤ 100 ms", "Caveat: " + "word " * 40)
    answer = study_findings(pl.DataFrame(rows), "t", "qps", capacity, context).sections[0]
    assert answer_words(answer.sentences) <= ANSWER_WORDS
    assert any(s.startswith("The other ") and "tables below" in s for s in answer.sentences)
    assert answer.sentences[-1].startswith("Caveat")


@pytest.mark.parametrize(
    ("varies", "question"),
    [
        (("mode", "model"), "modes"),
        (("model", "input_len"), "models"),
        (("input_len",), "input_len"),
    ],
)
def test_the_question_is_derived_from_what_varies(varies, question) -> None:
    table = pl.DataFrame(
        {
            "model": ["a", "b"] if "model" in varies else ["a", "a"],
            "mode": ["chunked", "single"] if "mode" in varies else ["single"] * 2,
            "input_len": [1, 2] if "input_len" in varies else [1, 1],
        }
    )
    assert study_question(table) == question
    assert study_question(table, "input_len") == "input_len"


def _ledger_row(mode: str, measured: float, simulated: float, lo=None, hi=None) -> dict:
    """A measured deployment's capacity row with its simulator twin's prediction (per GPU; 1
    GPU, so per GPU is the capacity)."""
    return capacity_row(
        "m", mode, measured, gpus=1, simulated_capacity_per_gpu=simulated,
        predicted_lo_per_gpu=lo, predicted_hi_per_gpu=hi,
    )  # fmt: skip


def test_measuring_that_changes_the_winner_says_so_and_the_ledger_is_shown() -> None:
    capacity = pl.DataFrame(
        [
            _ledger_row("chunked", 10.0, 8.0, 7.0, 9.5),
            _ledger_row("nondisagg", 8.0, 12.0, 6.5, 8.0),
        ]
    )
    context = Context("P99 TTFT ≤ 2000 ms", "Measured on the emulator.")
    summary = pl.DataFrame([cell("m", mode, 2, 100.0) for mode in ("chunked", "nondisagg")])
    result = study_findings(summary, "t", "qps", capacity, context)
    assert (
        "Measuring changed the answer: the simulator ranked nondisagg first (12 req/s per GPU "
        "predicted, 8 measured); measured, chunked carries the most (10; predicted 8)."
    ) in result.sections[0].sentences
    detail = result.sections[1]
    assert detail.sentences[1] == (
        "Measured capacity was 0.67–1.25× the simulator's over the 2 deployments; 1 of 2 "
        "inside the range the simulator predicted from the others."
    )
    assert detail.tables[0].header[-2:] == ["simulated per GPU", "predicted from the others"]
    assert detail.tables[0].rows[0][-2:] == ["8", "[7, 9.5]"]


def test_measuring_that_keeps_the_winner_or_a_simulated_table_says_nothing_of_it() -> None:
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    summary = pl.DataFrame([cell("m", mode, 2, 100.0) for mode in ("chunked", "nondisagg")])
    kept = pl.DataFrame([_ledger_row("chunked", 10.0, 12.0), _ledger_row("nondisagg", 8.0, 9.0)])
    simulated = pl.DataFrame(
        [capacity_row("m", "chunked", 10.0), capacity_row("m", "nondisagg", 8.0)]
    )
    for capacity in (kept, simulated):
        result = study_findings(summary, "t", "qps", capacity, context)
        assert not any("Measuring changed" in s for s in result.sections[0].sentences)
    assert (
        "simulated per GPU"
        not in study_findings(summary, "t", "qps", simulated, context).sections[1].tables[0].header
    )


def test_a_mode_only_tied_with_a_winner_is_not_called_the_best_and_never_the_least():
    """Per model the winners differ, each tied within noise with the other's: the agreement
    says so instead of calling one of them the best for every model, and a configuration tied
    with the winner is not named as the one that carries the least."""
    rows = [
        capacity_row("a", "chunked", 10.0, gpus=1, capacity_lo=9.9, capacity_hi=10.2),
        capacity_row("a", "nondisagg", 9.5, gpus=1, capacity_lo=8.0, capacity_hi=11.0),
        capacity_row("a", "single", 9.4, gpus=1, capacity_lo=8.0, capacity_hi=10.5),
        capacity_row("b", "nondisagg", 5.0, gpus=1, capacity_lo=4.9, capacity_hi=5.1),
        capacity_row("b", "chunked", 4.95, gpus=1, capacity_lo=4.0, capacity_hi=6.0),
    ]
    summary = pl.DataFrame(
        [cell(m, mode, 2, 100.0) for m, mode in (("a", "chunked"), ("b", "nondisagg"))]
    )
    context = Context("P99 TTFT ≤ 2000 ms", "Caveat.")
    answer = study_findings(summary, "t", "qps", pl.DataFrame(rows), context).sections[0]
    assert (
        "chunked is the best mode, or the same within noise as the best, for every model."
        in answer.sentences
    )
    assert not any("carries the least" in s for s in answer.sentences), answer.sentences


def test_a_confirming_study_names_the_simulator_candidates_and_their_ranks() -> None:
    def row(topology: str, rate: float, gpus: int) -> dict:
        return capacity_row("m", "chunked", rate, gpus) | {"mode": topology, "topology": topology}

    capacity = pl.DataFrame([row("2x(TP4)", 9.6, 8), row("3x(TP2)", 7.5, 6)])
    summary = pl.DataFrame([cell("m", t, 4, 100.0) for t in ("2x(TP4)", "3x(TP2)")])
    candidates = Candidates(
        2,
        "req/s",
        (
            Comparison(
                "m",
                1024,
                17,
                (Candidate("2x(TP4)", 1, 1.24), Candidate("3x(TP2)", 2, 1.19, True)),
                Candidate("2x(TP4)", 1, 1.24),
                Candidate("2P(TP2)+1D(TP2)", 3, 1.083),
            ),
        ),
    )
    context = Context("P90 TTFT ≤ 1000 ms", "Emulated.", candidates=candidates)
    answer = study_findings(summary, "t", "qps", capacity, context).sections[0].sentences
    assert answer[1].startswith("Run 3x(TP2): 1.25 req/s per GPU (7.5 req/s on 6 GPUs")
    assert answer[1].endswith("4% more than 2x(TP4) (1.2).")
    assert (
        "The measured candidates were the simulator's top 2 of 17 topologies by capacity per "
        "GPU: 2x(TP4) (simulated rank 1, 1.24 req/s per GPU) and 3x(TP2) (rank 2, at least "
        "1.19); the "
        "other 15 were not deployed; no split was among them (the simulator's best is "
        "2P(TP2)+1D(TP2), rank 3, 1.08)."
    ) in answer
