"""The knee of the latency curve: where a published request-rate sweep's mean TTFT bends, and
the capacity at an SLO, against the simulator's (issue 42).

A sweep is one setup (source, model, GPU, workload) published at several request rates. Its
knee is the rate at which mean TTFT first exceeds `KNEE_FACTOR` times its value at the lowest
rate, and its capacity the rate at which mean TTFT first exceeds `SLO_MEAN_TTFT_MS`; both
interpolated between neighbouring points on a log-log scale (`crossing`). A published sweep is
coarse, so either may only be bracketed: it never bends up to its highest rate, it bends between
a finite rate and rate inf (no rate to interpolate to), or it is already past the threshold at its
lowest rate. The simulator's curve is a finer sweep of the same setup (`simulated_curve`: eight
steps per doubling from the lowest published rate, each rate simulated as the published run of the
nearest published rate at or below it), and its crossing is found the same way on it. The error
of one against the other is that of the nearest ends of the two ranges (`range_error`): 0 when
they overlap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from fidelity_validation import ValidationRun, predict_validation

KNEE_FACTOR = 3.0
"""The knee: mean TTFT first above this multiple of its lowest-rate value (issue 42)."""
SLO_MEAN_TTFT_MS = 500.0
"""The SLO the capacity is stated at: mean TTFT at most 500 ms (an interactive chat target)."""
GRID_STEPS_PER_DOUBLING = 8
"""The simulated sweep's steps per doubling of the rate (9 % each): finer than the ±15 % the knee
is judged by, and exact at the published rates that are a power of two apart."""
GRID_SPAN = 64.0
"""How far above the lowest published rate a sweep that ends at rate inf is simulated."""
KNEE_TOLERANCE = 0.15
"""Issue 42's goal: the simulated knee within ±15 % of the published one on every sweep."""


@dataclass(frozen=True)
class Crossing:
    """Where a curve first exceeds a threshold: the rate range [low, high] it lies in (low ==
    high when interpolated) and, when only bracketed, why."""

    low: float
    high: float
    note: str = ""

    @property
    def rate(self) -> float | None:
        return self.low if self.low == self.high else None

    def text(self) -> str:
        if math.isinf(self.low):
            return "never"
        if self.rate is not None:
            return f"{self.rate:.3g}"
        if math.isinf(self.high):
            return f">{self.low:.3g}"
        return f"<={self.high:.3g}" if self.low == 0 else f"{self.low:.3g}-{self.high:.3g}"


def crossing(rates: Sequence[float], values: Sequence[float], threshold: float) -> Crossing:
    """The first rate at which ``values`` (at ascending ``rates``, the last may be inf) exceed
    ``threshold``, interpolated linearly in log(value) against log(rate) between the last point
    at or below it and the first above it. Bracketed when the curve is past the threshold at its
    lowest rate, never reaches it, or reaches it only at rate inf."""
    if values[0] > threshold:
        return Crossing(0.0, rates[0], f"above {threshold:.0f} ms already at {rates[0]:g}")
    for k in range(1, len(rates)):
        if values[k] <= threshold:
            continue
        r0, r1, v0, v1 = rates[k - 1], rates[k], values[k - 1], values[k]
        if math.isinf(r1):
            return Crossing(r0, math.inf, f"bends between {r0:g} and rate inf")
        share = math.log(threshold / v0) / math.log(v1 / v0)
        rate = math.exp(math.log(r0) + share * math.log(r1 / r0))
        return Crossing(rate, rate)
    top = rates[-1]
    note = "never, even at rate inf" if math.isinf(top) else f"never up to {top:g}"
    return Crossing(top, math.inf, note)


def range_error(published: Crossing, simulated: Crossing) -> float:
    """Simulated over published less 1, between the nearest ends of the two ranges: 0 when they
    overlap, negative when the simulator bends early."""
    if simulated.high < published.low:
        return simulated.high / published.low - 1
    if simulated.low > published.high:
        return simulated.low / published.high - 1
    return 0.0


@dataclass(frozen=True)
class Sweep:
    """One setup published at several request rates (ascending; inf last when published):
    the published mean TTFT at each, and how to simulate the setup's mean TTFT at any rate."""

    set_name: str
    label: str
    rates: tuple[float, ...]
    mean_ttft_ms: tuple[float, ...]
    simulate: Callable[[float], float]


@dataclass(frozen=True)
class Knee:
    """A sweep's knee and capacity at the SLO, published and simulated."""

    sweep: Sweep
    published_knee: Crossing
    simulated_knee: Crossing
    published_capacity: Crossing
    simulated_capacity: Crossing
    simulated_points: int


def simulated_curve(sweep: Sweep) -> tuple[list[float], list[float]]:
    """The simulator's mean TTFT on a finer sweep: from the lowest published rate in
    `GRID_STEPS_PER_DOUBLING` steps per doubling up to the highest finite published rate, or,
    when the published sweep ends at rate inf, on until the curve is past both the knee and the
    SLO (at most `GRID_SPAN` times the lowest rate), then at rate inf itself."""
    finite = [rate for rate in sweep.rates if not math.isinf(rate)]
    ends_at_inf = len(finite) < len(sweep.rates)
    top = finite[0] * GRID_SPAN if ends_at_inf else finite[-1]
    grid = sorted({*finite, *_geometric(finite[0], top)})
    rates: list[float] = []
    values: list[float] = []
    for rate in grid:
        if rate > finite[-1] and values and values[-1] > _stop_ms(values[0]):
            break
        rates.append(rate)
        values.append(sweep.simulate(rate))
    if ends_at_inf:
        rates.append(math.inf)
        values.append(sweep.simulate(math.inf))
    return rates, values


def _geometric(low: float, high: float) -> list[float]:
    steps = math.floor(GRID_STEPS_PER_DOUBLING * math.log2(high / low) + 1e-9)
    return [low * 2 ** (k / GRID_STEPS_PER_DOUBLING) for k in range(steps + 1)]


def _stop_ms(lowest_ms: float) -> float:
    return max(KNEE_FACTOR * lowest_ms, SLO_MEAN_TTFT_MS)


def knee(sweep: Sweep) -> Knee:
    """The published and the simulated knee and capacity of one sweep."""
    rates, values = simulated_curve(sweep)
    published = (sweep.rates, sweep.mean_ttft_ms)
    return Knee(
        sweep,
        crossing(*published, KNEE_FACTOR * sweep.mean_ttft_ms[0]),
        crossing(rates, values, KNEE_FACTOR * values[0]),
        crossing(*published, SLO_MEAN_TTFT_MS),
        crossing(rates, values, SLO_MEAN_TTFT_MS),
        len(rates),
    )


def _error_text(published: Crossing, simulated: Crossing) -> str:
    error = range_error(published, simulated)
    mark = "" if abs(error) <= KNEE_TOLERANCE else "!"
    return f"{100 * error:+.0f} %{mark}"


def format_knees(knees: Sequence[Knee]) -> list[str]:
    """One line per sweep: published rates and mean TTFT, the knee and the capacity at the SLO
    published and simulated (req/s; a range when only bracketed) and the error between them
    (`range_error`; ``!`` beyond ±15 %), then why each bracketed published value is one."""
    lines = [
        f"== Knee (mean TTFT > {KNEE_FACTOR:g}x its lowest-rate value, each curve its own) and "
        f"capacity at mean TTFT <= {SLO_MEAN_TTFT_MS:.0f} ms, published vs simulated (req/s, "
        f"seed 0; error = simulated/published - 1 between the nearest ends of the two ranges, "
        f"! beyond +-{100 * KNEE_TOLERANCE:.0f} %)",
        f"{'set':<11} {'sweep':<46} {'published rates: mean TTFT ms':<44} "
        f"{'knee publ':>9} {'sim':>7} {'error':>7}  {'cap publ':>9} {'sim':>7} {'error':>7}",
    ]
    notes = []
    for k in knees:
        published = zip(k.sweep.rates, k.sweep.mean_ttft_ms, strict=True)
        curve = " ".join(f"{rate:g}:{value:.0f}" for rate, value in published)
        lines.append(
            f"{k.sweep.set_name:<11} {k.sweep.label:<46} {curve:<44} "
            f"{k.published_knee.text():>9} {k.simulated_knee.text():>7} "
            f"{_error_text(k.published_knee, k.simulated_knee):>7}  "
            f"{k.published_capacity.text():>9} {k.simulated_capacity.text():>7} "
            f"{_error_text(k.published_capacity, k.simulated_capacity):>7}"
        )
        if k.published_knee.note or k.published_capacity.note:
            notes.append(
                f"  {k.sweep.label}: published knee {k.published_knee.note or 'interpolated'}; "
                f"capacity {k.published_capacity.note or 'interpolated'}"
            )
    points = sum(k.simulated_points for k in knees)
    return [*lines, *notes, f"  ({points} simulated rates in all)"]


def validation_sweeps(runs: Sequence[ValidationRun]) -> list[Sweep]:
    """The validation runs that form request-rate sweeps: ``serve`` runs of one source, model,
    GPU, TP, dataset, input length, prompt count and concurrency cap at two or more rates (the
    output lengths of a ShareGPT run are its model's answers, so they may differ). A sweep of
    concurrency caps at rate inf is not one: a closed loop's queue cannot grow past the cap."""
    groups: dict[tuple[object, ...], list[ValidationRun]] = {}
    for run in runs:
        if run.interface != "serve" or run.request_rate is None:
            continue
        key = (run.source, run.model, run.gpu, run.tp, run.dataset, run.input_len,
               run.num_prompts, run.max_concurrency)  # fmt: skip
        groups.setdefault(key, []).append(run)
    sweeps = []
    for group in groups.values():
        group.sort(key=_rate)
        if len({_rate(run) for run in group}) < 2:
            continue
        label = f"{group[0].source} {group[0].row.rsplit(' rate=', 1)[0]}"
        rates = tuple(_rate(run) for run in group)
        ttft = tuple(run.published["mean_ttft_ms"] for run in group)
        sweeps.append(Sweep("validation", label, rates, ttft, partial(_simulate_run, group)))
    return sweeps


def _rate(run: ValidationRun) -> float:
    assert run.request_rate is not None
    return run.request_rate


def _simulate_run(group: Sequence[ValidationRun], rate: float) -> float:
    """Mean TTFT at ``rate``, simulated as the group's run of the highest rate at or below it
    (its prompts, priming and client; seed 0)."""
    template = [run for run in group if _rate(run) <= rate][-1]
    return predict_validation(template, 0, request_rate=rate)["mean_ttft_ms"]
