"""Cell metrics against hand-computed values (vLLM's calculate_metrics semantics)."""

from __future__ import annotations

from dataclasses import asdict, fields

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from servematrix.results import metrics
from servematrix.results.metrics import CellMetrics, MetricsError
from servematrix.spec import trace

IDENTITY = trace.CellIdentity("simulator", "v1", "m", "single", "random", 2.0, 10, 4, 4, 0)


def ok(
    request_id: int,
    sent_s: float,
    chunk_s: list[float],
    chunk_tokens: list[int] | None = None,
    *,
    scheduled_s: float | None = None,
    prompt_tokens: int = 10,
    warmup: bool = False,
) -> trace.RequestRecord:
    tokens = chunk_tokens or [1] * len(chunk_s)
    return trace.RequestRecord(
        request_id=request_id,
        warmup=warmup,
        scheduled_s=sent_s if scheduled_s is None else scheduled_s,
        sent_s=sent_s,
        first_token_s=chunk_s[0],
        end_s=chunk_s[-1],
        chunk_s=chunk_s,
        chunk_tokens=tokens,
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(tokens),
        success=True,
        request_input_len=prompt_tokens,
        request_output_len=sum(tokens),
    )


def failed(request_id: int, sent_s: float, error: str, warmup: bool = False) -> trace.RequestRecord:
    return trace.RequestRecord(
        request_id=request_id,
        warmup=warmup,
        scheduled_s=sent_s,
        sent_s=sent_s,
        error=error,
        request_input_len=10,
        request_output_len=4,
    )


def table(records: list[trace.RequestRecord]) -> pa.Table:
    return trace.to_table(IDENTITY, records, {})


def hand_trace() -> pa.Table:
    """A warm-up, three successful requests and one failure.

    request   sent  chunks (tokens)             TTFT  E2EL  TPOT              ITL gaps
    A (1)     0.0   0.1, 0.2, 0.4 (1, 1, 2)     100   400   (400-100)/3=100   100, 200
    B (2)     0.5   0.8 (1)                     300   300   - (one token)     -
    C (3)     1.0   1.2, 1.4, 1.6 (1, 1, 1)     200   600   (600-200)/2=200   200, 200
    D (4)     1.5   failed                      -     -     -                 -
    The warm-up (0) is sent at -5 s with a 4 s TTFT: counted anywhere it would show.
    """
    return table(
        [
            ok(0, -5.0, [-1.0, -0.5], warmup=True, prompt_tokens=999),
            ok(1, 0.0, [0.1, 0.2, 0.4], [1, 1, 2]),
            ok(2, 0.5, [0.8]),
            ok(3, 1.0, [1.2, 1.4, 1.6]),
            failed(4, 1.5, "HTTP 500: boom"),
        ]
    )


def test_counts_tokens_duration_and_throughput() -> None:
    m = metrics.compute(hand_trace())

    assert m.completed == 3
    assert m.failed == 1
    assert m.total_input_tokens == 30  # 3 successful x 10; the failure and warm-up add nothing
    assert m.total_output_tokens == 8  # 4 + 1 + 3 (completion_tokens, not chunks)
    assert m.duration_s == pytest.approx(1.6)  # first send 0.0 -> last end 1.6 (C)
    assert m.request_throughput == pytest.approx(3 / 1.6)  # 1.875
    assert m.output_throughput == pytest.approx(8 / 1.6)  # 5.0
    assert m.total_token_throughput == pytest.approx(38 / 1.6)  # 23.75


def test_ttft_includes_one_token_request() -> None:
    m = metrics.compute(hand_trace())

    # TTFT [100, 300, 200]; sorted [100, 200, 300]
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.std_ttft_ms == pytest.approx(np.sqrt((100**2 + 100**2 + 0) / 3))  # 81.65, ddof=0
    assert m.p90_ttft_ms == pytest.approx(280.0)  # rank 0.9*2 = 1.8: 200 + 0.8*100
    assert m.p95_ttft_ms == pytest.approx(290.0)  # rank 1.9
    assert m.p99_ttft_ms == pytest.approx(298.0)  # rank 1.98


def test_e2el_includes_one_token_request() -> None:
    m = metrics.compute(hand_trace())

    # E2EL [400, 300, 600]; sorted [300, 400, 600]; mean 1300/3
    assert m.mean_e2el_ms == pytest.approx(1300 / 3)
    assert m.median_e2el_ms == pytest.approx(400.0)
    # deviations -33.3, -133.3, 166.7 -> squares sum 46666.7 -> /3 -> sqrt = 124.72
    assert m.std_e2el_ms == pytest.approx(np.sqrt(140000 / 9))
    assert m.p90_e2el_ms == pytest.approx(560.0)  # rank 1.8: 400 + 0.8*200
    assert m.p95_e2el_ms == pytest.approx(580.0)
    assert m.p99_e2el_ms == pytest.approx(596.0)


def test_tpot_excludes_one_token_request_and_uses_completion_tokens() -> None:
    m = metrics.compute(hand_trace())

    # A: 300 ms over 4 - 1 = 3 tokens (its last chunk carries 2) = 100; C: 400/2 = 200; B absent
    assert m.mean_tpot_ms == pytest.approx(150.0)  # with B as 0 it would be 100
    assert m.median_tpot_ms == pytest.approx(150.0)
    assert m.std_tpot_ms == pytest.approx(50.0)
    assert m.p90_tpot_ms == pytest.approx(190.0)  # rank 0.9: 100 + 0.9*100
    assert m.p95_tpot_ms == pytest.approx(195.0)
    assert m.p99_tpot_ms == pytest.approx(199.0)


def test_itl_pools_chunk_gaps_and_multi_token_chunk_is_one_gap() -> None:
    m = metrics.compute(hand_trace())

    # gaps A: 100, 200 (the 2-token chunk is one gap); B: none; C: 200, 200 -> [100, 200, 200, 200]
    assert m.mean_itl_ms == pytest.approx(175.0)
    assert m.median_itl_ms == pytest.approx(200.0)
    assert m.std_itl_ms == pytest.approx(np.sqrt((75**2 + 3 * 25**2) / 4))  # sqrt(1875) = 43.3
    assert m.p90_itl_ms == pytest.approx(200.0)  # rank 2.7 of [100, 200, 200, 200]
    assert m.p99_itl_ms == pytest.approx(200.0)


def test_all_one_token_requests_give_zero_tpot_and_itl() -> None:
    m = metrics.compute(table([ok(0, 0.0, [0.1]), ok(1, 0.5, [0.7])]))

    assert m.mean_ttft_ms == pytest.approx(150.0)  # (100 + 200) / 2
    assert m.p99_e2el_ms == pytest.approx(199.0)  # 100 + 0.99*(200 - 100)
    for name in ("tpot", "itl"):
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            assert getattr(m, f"{stat}_{name}_ms") == 0.0


def test_warmup_rows_excluded_everywhere() -> None:
    with_warmup = metrics.compute(hand_trace())
    without = metrics.compute(table([ok(1, 0.0, [0.1, 0.2, 0.4], [1, 1, 2])]))
    only_a = metrics.compute(
        table(
            [
                ok(0, -5.0, [-1.0, -0.5], warmup=True),
                failed(9, -4.0, "warm-up failure", warmup=True),
                ok(1, 0.0, [0.1, 0.2, 0.4], [1, 1, 2]),
            ]
        )
    )

    assert with_warmup.completed == 3  # not 4
    assert with_warmup.duration_s == pytest.approx(1.6)  # not 6.6 from the -5 s warm-up send
    assert asdict(only_a) == asdict(without)
    assert only_a.failed == 0


def test_failed_duration_extends_to_a_late_failed_send() -> None:
    # the failure is sent at 3.0, after the last completion (0.4): the run lasted 3 s
    m = metrics.compute(table([ok(0, 0.0, [0.1, 0.4]), failed(1, 3.0, "timeout")]))

    assert m.duration_s == pytest.approx(3.0)
    assert m.request_throughput == pytest.approx(1 / 3)


def test_goodput_without_slo_counts_every_success() -> None:
    m = metrics.compute(hand_trace())

    assert m.request_goodput == pytest.approx(3 / 1.6)
    assert m.good_fraction == pytest.approx(3 / 4)  # the failure is not good


@pytest.mark.parametrize(
    ("slo_ms", "good"),
    [
        ({"ttft": 250}, 2),  # A 100, C 200 meet it; B 300 does not
        ({"ttft": 100}, 1),  # A is exactly 100: the limit is inclusive, as in vLLM
        ({"tpot": 150}, 2),  # A 100; B's one token counts as TPOT 0; C 200 misses
        ({"e2el": 450}, 2),  # A 400, B 300; C 600 misses
        ({"ttft": 250, "tpot": 150}, 1),  # only A meets both
        ({"ttft": 1, "tpot": 1, "e2el": 1}, 0),
    ],
)
def test_goodput_with_slos(slo_ms: dict[str, float], good: int) -> None:
    m = metrics.compute(hand_trace(), slo_ms)

    assert m.request_goodput == pytest.approx(good / 1.6)
    assert m.good_fraction == pytest.approx(good / 4)


def test_unknown_slo_key_is_an_error() -> None:
    with pytest.raises(MetricsError, match=r"unknown SLO key.*itl"):
        metrics.compute(hand_trace(), {"itl": 10})


def test_send_lag_and_achieved_qps() -> None:
    # scheduled 0, 0.5, 1.0, 1.95; sent 0, 0.502, 1.010, 2.0 -> lag 0, 2, 10, 50 ms
    m = metrics.compute(
        table(
            [
                ok(0, 0.0, [0.1], scheduled_s=0.0),
                ok(1, 0.502, [0.6], scheduled_s=0.5),
                ok(2, 1.010, [1.1], scheduled_s=1.0),
                ok(3, 2.0, [2.1], scheduled_s=1.95),
            ]
        )
    )

    assert m.send_lag_p50_ms == pytest.approx(6.0)  # (2 + 10) / 2
    assert m.send_lag_p99_ms == pytest.approx(48.8)  # rank 2.97: 10 + 0.97*40
    assert m.send_lag_max_ms == pytest.approx(50.0)
    assert m.achieved_qps == pytest.approx(1.5)  # 3 gaps over 2.0 s of sends
    assert m.scheduled_qps == pytest.approx(3 / 1.95)  # 3 gaps over 1.95 s of schedule


def test_achieved_qps_counts_failed_sends_and_is_zero_for_one_request() -> None:
    two = metrics.compute(table([ok(0, 0.0, [0.1]), failed(1, 0.25, "x")]))
    one = metrics.compute(table([ok(0, 0.0, [0.1])]))

    assert two.achieved_qps == pytest.approx(4.0)  # 1 gap of 0.25 s
    assert one.achieved_qps == 0.0


def test_all_failed_cell_is_an_error_naming_count_error_and_file() -> None:
    records = [
        ok(0, -1.0, [-0.9], warmup=True),
        failed(1, 0.0, "HTTP 503: Service Unavailable"),
        failed(2, 0.5, "timeout"),
    ]

    with pytest.raises(MetricsError) as error:
        metrics.compute(table(records), source="results/x/qps2.parquet")

    message = str(error.value)
    assert "all 2 measured requests failed" in message
    assert "HTTP 503: Service Unavailable" in message
    assert "results/x/qps2.parquet" in message


def test_no_measured_rows_is_an_error() -> None:
    with pytest.raises(MetricsError, match="no measured"):
        metrics.compute(table([ok(0, -1.0, [-0.9], warmup=True)]))
    with pytest.raises(MetricsError, match="no measured"):
        metrics.compute(table([]))


def test_success_without_timestamps_is_an_error() -> None:
    broken = ok(3, 0.0, [0.1])
    broken.end_s = None

    with pytest.raises(MetricsError, match="request 3 succeeded but has no"):
        metrics.compute(table([broken]))


def test_zero_duration_is_an_error_not_a_division_by_zero() -> None:
    instant = ok(0, 0.0, [0.0])

    with pytest.raises(MetricsError, match="duration is 0"):
        metrics.compute(table([instant]))


def test_polars_frame_gives_the_same_metrics() -> None:
    arrow = hand_trace()

    assert metrics.compute(pl.from_arrow(arrow), {"ttft": 250}) == metrics.compute(
        arrow, {"ttft": 250}
    )


def test_field_names_are_the_contract() -> None:
    names = [f.name for f in fields(CellMetrics)]
    latency = [
        f"{stat}_{m}_ms"
        for m in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "std", "p90", "p95", "p99")
    ]

    assert names[:15] == [
        "completed",
        "failed",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "good_fraction",
        "scheduled_qps",
        "achieved_qps",
        "send_lag_p50_ms",
        "send_lag_p99_ms",
        "send_lag_max_ms",
    ]
    assert names[15:] == latency


def random_records(rng: np.random.Generator, n: int) -> list[trace.RequestRecord]:
    records = []
    sent = np.cumsum(rng.exponential(0.25, n))
    for i in range(n):
        if rng.random() < 0.1:
            records.append(failed(i, float(sent[i]), f"error {i}"))
            continue
        chunks = int(rng.integers(1, 8))
        times = sent[i] + np.cumsum(rng.exponential(0.05, chunks))
        tokens = rng.integers(1, 4, chunks).tolist()
        records.append(
            ok(
                i,
                float(sent[i]),
                times.tolist(),
                tokens,
                scheduled_s=float(sent[i] - rng.exponential(0.001)),
                prompt_tokens=int(rng.integers(5, 50)),
                warmup=i < 3,
            )
        )
    return records


def vllm_reference(records: list[trace.RequestRecord], slo_ms: dict[str, float]) -> dict:
    """A transcription of vLLM's calculate_metrics loop over the measured records."""
    measured = [r for r in records if not r.warmup]
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    total_input = total_output = completed = good = 0
    for r in measured:
        if not r.success:
            continue
        ttft, latency = r.first_token_s - r.sent_s, r.end_s - r.sent_s
        tpot = (latency - ttft) / (r.completion_tokens - 1) if r.completion_tokens > 1 else 0
        if r.completion_tokens > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
        ttfts.append(ttft)
        e2els.append(latency)
        total_input += r.prompt_tokens
        total_output += r.completion_tokens
        completed += 1
        good += slo_ms["ttft"] / 1000 >= ttft and slo_ms["tpot"] / 1000 >= tpot
    start = min(r.sent_s for r in measured)
    duration = max([r.end_s for r in measured if r.end_s is not None]) - start
    expected = {
        "completed": completed,
        "failed": len(measured) - completed,
        "duration_s": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "request_goodput": good / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        expected[f"mean_{name}_ms"] = np.mean(values or 0) * 1000
        expected[f"median_{name}_ms"] = np.median(values or 0) * 1000
        expected[f"std_{name}_ms"] = np.std(values or 0) * 1000
        for p in (90, 95, 99):
            expected[f"p{p}_{name}_ms"] = np.percentile(values or 0, p) * 1000
    return expected


def test_matches_vllm_loop_on_random_trace() -> None:
    records = random_records(np.random.default_rng(7), 300)
    slo_ms = {"ttft": 60.0, "tpot": 40.0}

    got = asdict(metrics.compute(table(records), slo_ms))

    for name, value in vllm_reference(records, slo_ms).items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
