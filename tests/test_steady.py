"""Steady state and the SLO over a run's steady window (servematrix.results.steady), on made-up
traces whose shape is known: a server that keeps up, one whose queue grows, one that fails
requests."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from servematrix.results import steady
from servematrix.spec.slo import Slo
from servematrix.spec.trace import POLARS_SCHEMA, REQUEST_COLUMNS

SLO = Slo.from_config(
    {"ttft": {"statistic": "p99", "max_ms": 500}, "tpot": {"statistic": "p99", "max_ms": 50}}
)


def run(
    n: int = 2000,
    rate_rps: float = 10.0,
    ttft_s=lambda sent: np.full(len(sent), 0.2),
    fail_every: int = 0,
    tokens: int = 6,
    tpot_s: float = 0.02,
) -> pl.DataFrame:
    """A trace of ``n`` Poisson arrivals; each request's TTFT from ``ttft_s(sent times)``."""
    rng = np.random.default_rng(0)
    sent = np.cumsum(rng.exponential(1 / rate_rps, n))
    first = sent + ttft_s(sent)
    end = first + tpot_s * (tokens - 1)
    ok = np.ones(n, dtype=bool)
    if fail_every:
        ok[::fail_every] = False
    frame = pl.DataFrame(
        {
            "request_id": np.arange(n, dtype=np.int32),
            "warmup": np.zeros(n, dtype=bool),
            "scheduled_s": sent,
            "sent_s": sent,
            "first_token_s": np.where(ok, first, np.nan),
            "end_s": np.where(ok, end, np.nan),
            "chunk_s": [list(np.linspace(f, e, tokens)) for f, e in zip(first, end, strict=True)],
            "chunk_tokens": [[1] * tokens] * n,
            "prompt_tokens": np.full(n, 100, dtype=np.int32),
            "completion_tokens": np.where(ok, tokens, 0).astype(np.int32),
            "success": ok,
            "error": [None if good else "HTTP 500" for good in ok],
            "request_input_len": np.full(n, 100, dtype=np.int32),
            "request_output_len": np.full(n, tokens, dtype=np.int32),
            "preemptions": np.zeros(n, dtype=np.int32),
        }
    ).with_columns(pl.col("first_token_s", "end_s").fill_nan(None))
    return frame.cast({k: POLARS_SCHEMA[k] for k in REQUEST_COLUMNS})


def test_a_server_that_keeps_up_is_steady_and_meets_the_slo():
    verdict = steady.judge(run(), SLO, tail_requests=10)
    assert verdict.steadiness.steady and verdict.met and verdict.broken == ()
    assert verdict.steadiness.window_requests == 1600
    assert verdict.output_tokens_per_s == pytest.approx(10 * 6, rel=0.1)


def test_a_growing_queue_is_named_even_when_every_bound_holds():
    # TTFT rises from 0.1 s to 0.45 s over the run: under the 500 ms bound throughout.
    growing = run(ttft_s=lambda sent: 0.1 + 0.35 * sent / sent.max())
    verdict = steady.judge(growing, SLO, tail_requests=10)
    assert not verdict.steadiness.steady and verdict.steadiness.reason == steady.QUEUE_GROWING
    assert verdict.broken == (steady.QUEUE_GROWING,)


def test_completions_falling_behind_the_offered_rate_are_named():
    frame = run()
    late = frame["sent_s"] > frame["sent_s"].max() * 0.5
    # Every other request of the second half never finishes (the client gave up at the end).
    lost = late & (frame["request_id"] % 2 == 0)
    frame = frame.with_columns(
        success=~lost,
        end_s=pl.when(lost).then(None).otherwise(pl.col("end_s")),
        first_token_s=pl.when(lost).then(None).otherwise(pl.col("first_token_s")),
    )
    state = steady.steadiness(steady.measured_frame(frame))
    assert state.reason == steady.BELOW_OFFERED
    assert state.completed_rps < 0.9 * state.offered_rps


def test_failed_requests_count_against_every_statistic_without_attainment():
    # 2 % of requests fail, every served one is fast: P99 TTFT is the failures' (infinite).
    verdict = steady.judge(run(fail_every=50), SLO, tail_requests=10)
    assert not verdict.met and verdict.broken[:3] == ("P99 TTFT", "P99 TPOT", "failed requests")
    # One failure in 500 is under what a P99 lets through, and still breaks the SLO.
    verdict = steady.judge(run(fail_every=500), SLO, tail_requests=10)
    assert verdict.broken == ("failed requests",)
    mean = Slo.from_config({"e2el": {"statistic": "mean", "max_ms": 10_000}})
    assert not steady.judge(run(fail_every=500), mean, tail_requests=10).met
    assert steady.judge(run(), mean, tail_requests=10).met


def test_failures_miss_the_attainment():
    slo = Slo.from_config({"ttft": {"statistic": "mean", "max_ms": 10_000}, "attainment": 0.9})
    verdict = steady.judge(run(fail_every=5), slo, tail_requests=10)  # 20 % fail
    assert "attainment" in verdict.broken


def test_a_percentile_needs_its_tail_of_requests():
    assert steady.requests_needed(99, 50) == 5000
    assert steady.requests_needed(90, 50) == 500
    assert steady.requests_needed(50, 50) == 100
    verdict = steady.judge(run(n=400), SLO, tail_requests=10)  # 320 in the window, P99 needs 1000
    assert not verdict.met and verdict.broken[0] == "P99 TTFT needs 1000 requests"
    assert steady.statistic_s(np.arange(1000) / 1000, "p99", 10) == pytest.approx(0.98901)


def test_a_run_shorter_than_twice_its_latency_is_too_short_to_judge():
    slow = run(n=100, ttft_s=lambda sent: np.full(len(sent), 8.0))
    state = steady.steadiness(steady.measured_frame(slow))
    assert state.reason == steady.TOO_SHORT and not state.steady


def test_a_closed_loop_offers_what_it_is_served_so_only_its_queue_and_slo_count():
    # Every request was due at t = 0 (the client held each back for a free slot), and each
    # takes 4 s: read as a schedule, the window's last 4 s of sends look unserved.
    held = run(n=400, ttft_s=lambda sent: np.full(len(sent), 4.0))
    held = held.with_columns(scheduled_s=pl.lit(0.0))
    assert steady.steadiness(steady.measured_frame(held)).reason == steady.BELOW_OFFERED
    closed = steady.shape_of({"max_concurrency": 20, "qps": "inf"})
    loose = Slo.from_config({"ttft": {"statistic": "p99", "max_ms": 5000}})
    verdict = steady.judge(held, loose, tail_requests=1, shape=closed)
    assert verdict.met and verdict.requests_per_s == pytest.approx(10, rel=0.15)


def test_a_sessions_window_ends_at_the_last_session_to_arrive():
    """The later turns of sessions begun before the last arrival follow with nothing new
    arriving (the sessions' drain): out of the window."""
    frame = run(n=1000)
    shape = steady.shape_of({"sessions": {"users": 600, "turns": 2, "think_time_s": 1.0}})
    last_arrival = frame["sent_s"][599]
    window = steady.steady_window(steady.measured_frame(frame), shape)
    assert window["sent_s"].max() == last_arrival
    assert window.height == 600 - 200


def test_the_binding_check_and_its_noise_over_batches_of_the_window():
    """TTFT drawn around 380 ms (P99 TTFT ≤ 500 ms binds, P99 TPOT at 20 of 50 ms does not):
    the verdict's edge is the share of TTFTs over 500 ms over the 1 % a P99 allows, with a
    batch-means standard error of it, which shrinks as the run grows; a failure without an
    attainment leaves no finite edge to measure."""

    def jittered(sent):
        return np.random.default_rng(1).normal(0.38, 0.05, len(sent)).clip(0.01)

    verdicts = {}
    for n in (2000, 16000):
        verdicts[n] = steady.judge(run(n=n, ttft_s=jittered), SLO, tail_requests=10)
        window = jittered(np.zeros(n))[int(steady.RAMP_FRACTION * n) :]
        assert verdicts[n].met and np.percentile(window, 99) < 0.5
        assert verdicts[n].edge_ratio == pytest.approx(np.mean(window > 0.5) / 0.01)
        assert 0.5 < verdicts[n].edge_ratio < 1
        assert 0 < verdicts[n].edge_se < 0.5
    assert verdicts[16000].edge_se < verdicts[2000].edge_se
    failing = steady.judge(run(fail_every=50), SLO, tail_requests=10)
    assert failing.edge_ratio == float("inf") and failing.edge_se is None
    too_few = steady.judge(run(n=400), SLO, tail_requests=1)  # batches of 40: no P99 in each
    assert too_few.edge_se is None


def test_a_percentiles_edge_moves_with_the_share_beyond_it_not_the_percentile():
    """A P99 set by a rare event: TPOT 20 ms, or 80 ms for a request that met one. The P99
    jumps from 20 to 80 ms as the share meeting it passes 1 %; the edge rises with the share."""
    edges = []
    for every in (400, 200, 120, 80):
        frame = run(n=20000)
        slow = np.arange(frame.height) % every == 0
        end = frame["end_s"].to_numpy() + np.where(slow, 0.06 * 5, 0.0)
        verdict = steady.judge(frame.with_columns(end_s=end), SLO, tail_requests=10)
        assert verdict.met == (1 / every <= 0.01)
        edges.append(verdict.edge_ratio)
    assert edges == pytest.approx([0.25, 0.5, 100 / 120, 1.25], rel=0.02)


def test_runs_pooled_judge_their_windows_together():
    """Two runs at one rate pool their steady windows: a P99 that needs more requests than one
    run's window holds is judged from both; a growing queue in either run breaks the verdict;
    the rates are the pooled requests over the pooled windows' length."""
    one = run(n=1000)
    alone = steady.judge_runs([one], SLO, tail_requests=10)
    assert alone.broken == ("P99 TTFT needs 1000 requests", "P99 TPOT needs 1000 requests")
    pooled = steady.judge_runs([one, run(n=1000)], SLO, tail_requests=10)
    assert pooled.met and pooled.steadiness.window_requests == 1600
    assert pooled.requests_per_s == pytest.approx(10, rel=0.1)
    assert pooled.output_tokens_per_s == pytest.approx(10 * 6, rel=0.1)
    growing = run(n=1000, ttft_s=lambda sent: 0.1 + 0.35 * sent / sent.max())
    mixed = steady.judge_runs([one, growing], SLO, tail_requests=10)
    assert not mixed.met and steady.QUEUE_GROWING in mixed.broken
    assert steady.judge_runs([run()], SLO, 10) == steady.judge(run(), SLO, 10)
