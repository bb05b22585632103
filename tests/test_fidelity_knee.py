"""The knee and capacity of a latency curve (``benchmarks/fidelity_knee.py``): where a sweep's
mean TTFT first exceeds a threshold, interpolated on a log scale or bracketed, and how a
simulated crossing is scored against a published one. Pure logic, no simulation."""

from __future__ import annotations

import math

import pytest

from tests.benchmark_modules import load

(fidelity_knee,) = load("fidelity_knee")
crossing, range_error, Crossing = (
    fidelity_knee.crossing,
    fidelity_knee.range_error,
    fidelity_knee.Crossing,
)


def test_the_crossing_is_interpolated_linearly_on_log_log_axes() -> None:
    # 100 ms at 2 req/s, 1,000 ms at 8: 300 ms lies log(3)/log(10) of the way, in log rate.
    found = crossing([1.0, 2.0, 8.0], [90.0, 100.0, 1000.0], 300.0)
    assert found.rate == pytest.approx(2.0 * 4.0 ** (math.log(3) / math.log(10)))
    assert found.note == ""


def test_a_point_exactly_at_the_threshold_has_not_crossed_it() -> None:
    assert crossing([1.0, 2.0, 4.0], [100.0, 300.0, 900.0], 300.0).rate == pytest.approx(2.0)


def test_a_curve_that_never_bends_gives_a_lower_bound() -> None:
    found = crossing([2.0, 4.0, 8.0], [64.0, 75.0, 120.0], 192.0)
    assert (found.low, found.high, found.rate) == (8.0, math.inf, None)
    assert "never up to 8" in found.note and found.text() == ">8"


def test_a_bend_only_at_rate_inf_is_bracketed_not_interpolated() -> None:
    found = crossing([16.0, math.inf], [39.0, 2905.0], 117.0)
    assert (found.low, found.high) == (16.0, math.inf)
    assert "rate inf" in found.note


def test_a_curve_below_the_threshold_even_at_rate_inf_never_crosses() -> None:
    found = crossing([1.0, 16.0, math.inf], [65.0, 60.0, 360.0], 500.0)
    assert found.text() == "never" and "even at rate inf" in found.note


def test_a_curve_past_the_threshold_at_its_lowest_rate_gives_an_upper_bound() -> None:
    found = crossing([2.0, 4.0], [600.0, 900.0], 500.0)
    assert (found.low, found.high) == (0.0, 2.0) and found.text() == "<=2"


def test_the_error_is_relative_between_points_and_zero_for_overlapping_ranges() -> None:
    assert range_error(Crossing(5.0, 5.0), Crossing(4.0, 4.0)) == pytest.approx(-0.2)
    assert range_error(Crossing(16.0, math.inf), Crossing(92.0, 92.0)) == 0.0
    assert range_error(Crossing(16.0, math.inf), Crossing(8.0, 8.0)) == pytest.approx(-0.5)
    assert range_error(Crossing(0.0, 2.0), Crossing(3.0, 3.0)) == pytest.approx(0.5)


def test_the_simulated_grid_lands_exactly_on_rates_a_power_of_two_apart() -> None:
    grid = fidelity_knee._geometric(2.0, 8.0)
    assert len(grid) == 17 and grid[8] == 4.0 and grid[-1] == 8.0
