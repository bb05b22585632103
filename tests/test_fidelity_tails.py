"""Tails below saturation (``benchmarks/fidelity_tails.py``): which tail and centre of a latency
are paired, which runs count, and how the spreads compare. Pure logic, no simulation."""

from __future__ import annotations

import pytest

from tests.benchmark_modules import load

fidelity_points, fidelity_tails = load("fidelity_points", "fidelity_tails")
Point, spreads, format_tails = (
    fidelity_points.Point,
    fidelity_tails.spreads,
    fidelity_tails.format_tails,
)


def _point(label: str, metric: str, published: float, *predicted: float, regime="moderate"):
    return Point("validation", "src", regime, "H100", label, metric, published, predicted)


def test_a_median_pairs_with_the_p99_and_a_mean_with_p90_and_p99() -> None:
    points = [
        _point("a", "median_itl_ms", 10.0, 8.0, 9.0),
        _point("a", "p99_itl_ms", 50.0, 16.0, 27.0),
        _point("a", "mean_itl_ms", 11.0, 9.0, 9.0),  # the median is there: the mean is not used
        _point("b", "mean_ttft_ms", 100.0, 100.0),
        _point("b", "p90_ttft_ms", 120.0, 110.0),
        _point("b", "p99_ttft_ms", 200.0, 300.0),
        _point("b", "p99_tpot_ms", 9.0, 9.0),  # no centre of its own: no spread
    ]
    found = {(s.label, s.tail, s.centre, s.family): s for s in spreads(points)}
    assert set(found) == {
        ("a", "p99", "median", "itl"),
        ("b", "p90", "mean", "ttft"),
        ("b", "p99", "mean", "ttft"),
    }
    itl = found[("a", "p99", "median", "itl")]
    assert itl.published == 5.0 and itl.simulated == (2.0, 3.0)
    assert itl.excess_ratio == pytest.approx(0.25)  # (2 - 1) / (5 - 1): a quarter as wide
    assert found[("b", "p99", "mean", "ttft")].excess_ratio == pytest.approx(2.0)


def test_only_runs_below_saturation_count() -> None:
    regimes = ("low", "moderate", "saturated")
    points = [
        _point(regime, metric, published, 2 * published, regime=regime)
        for regime in regimes
        for metric, published in (("median_ttft_ms", 10.0), ("p99_ttft_ms", 20.0))
    ]
    assert sorted(s.label for s in spreads(points)) == ["low", "moderate"]


def test_the_table_counts_narrower_simulated_tails_per_set_and_latency() -> None:
    points = [
        _point("a", "median_itl_ms", 10.0, 10.0),
        _point("a", "p99_itl_ms", 30.0, 20.0),
        _point("b", "median_itl_ms", 10.0, 10.0),
        _point("b", "p99_itl_ms", 20.0, 40.0),
    ]
    lines = format_tails(spreads(points), seeds=1)
    assert lines[-1] == (
        "  validation itl: 2 spreads, 1 simulated narrower than published, median excess ratio 1.75"
    )
    assert format_tails([], seeds=1)[-1].startswith("  (no run below saturation")
