"""Capacity at an SLO: the highest load a deployment serves within its latency targets.

A load is a level on one axis (``servematrix.capacity.loads``): a request rate in req/s, a number of
concurrent users, or a session arrival rate. The search runs over levels, each probe one
steady-state run at that level (``servematrix.capacity.run`` runs them,
``servematrix.results.steady`` judges them): bracket the capacity between a level that meets the SLO
and one that does not, expanding from a first guess by a factor, then bisect until the bracket
is within ``tolerance`` of the level or the probes run out. Rates lie on a fixed grid of
levels (`next_level`), rounded to four significant figures, and users are whole numbers, so
searches from different guesses meet on the same levels, a probe's cell path stays readable
and a rerun lands on the same cells (cached like any cell). A measured search
may start from the simulator's capacity with a small factor: a few probes around it instead
of a blind bracket (``WARM_FACTOR``). The search stops at ``limit`` (a multiple of the
deployment's physical ceiling where one is known): a search that met the SLO there found no
failing level, and says so (``Search.limited``).

Pure logic: the probe is a function given by the caller, so the search is tested directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from servematrix.results.intervals import T_975, Interval, t_interval
from servematrix.results.steady import BATCHES

BLIND_FACTOR = 2.0
"""A blind search doubles (or halves) the level until the SLO's edge is bracketed."""
WARM_FACTOR = 1.1
"""A search from the simulator's capacity steps 10 % at a time around it."""
MIN_LEVEL = 0.01
MAX_LEVEL = 1e4
"""The search gives up below (capacity 0: not even a trickle meets the SLO; on an integer
axis below 1) and, without a physical ceiling, above (the SLO never broke)."""


@dataclass(frozen=True)
class Probe:
    """One measured load level: did it meet the SLO, which bounds broke, what it delivered
    (``requests_per_s`` completed in the steady window: the rate itself on a rate axis)."""

    level: float
    met: bool
    broken: tuple[str, ...]
    output_tokens_per_s: float
    trace: str
    requests: int = 0
    requests_per_s: float = 0.0
    edge_ratio: float = math.inf
    edge_se: float | None = None
    """The binding check's ratio to its limit and its standard error
    (`servematrix.results.steady.Judgement`)."""
    runs: int = 1
    """Independent runs pooled for the verdict (``requests`` counts them all; ``trace`` is
    the first's)."""


@dataclass(frozen=True)
class Search:
    """``capacity`` is the highest level that met the SLO below the lowest that did not
    (``failing``; None when none failed up to ``limit``); ``probes`` in the order run."""

    capacity: float
    failing: float | None
    probes: tuple[Probe, ...]
    limit: float = MAX_LEVEL

    @property
    def limited(self) -> bool:
        """No failing level up to the limit: the capacity is at least it, not measured."""
        return self.failing is None and self.capacity > 0

    @property
    def at_capacity(self) -> Probe | None:
        return next((p for p in self.probes if p.level == self.capacity and p.met), None)

    @property
    def breaks_first(self) -> tuple[str, ...]:
        """The bounds broken at the lowest failing level, furthest over its limit first."""
        failing = next((p for p in self.probes if p.level == self.failing), None)
        return failing.broken if failing else ()


def round_level(level: float, integer: bool = False) -> float:
    """Four significant figures (a probe's path names its level); whole numbers, at least
    one, on an integer axis."""
    if level <= 0:
        return 0.0
    if integer:
        return float(max(round(level), 1))
    return float(f"{level:.4g}")


def bracket(probes: Iterable[Probe]) -> tuple[float | None, float | None]:
    """(highest passing level below the lowest failing one, lowest failing level)."""
    probes = list(probes)
    failing = min((p.level for p in probes if not p.met), default=None)
    passing = [p.level for p in probes if p.met and (failing is None or p.level < failing)]
    return max(passing, default=None), failing


GRID_ROUNDING = 0.0011
"""Neighbouring levels of the grid lie this much closer than the tolerance, so that rounded to
four significant figures (up to 0.05 % each) they are still within it."""


def grid_steps(tolerance: float) -> int:
    """Levels per decade of the search's grid: the fewest whose neighbours lie within
    ``tolerance`` of each other (49 for 5 %: 4.8 % apart)."""
    return math.ceil(math.log(10) / math.log1p(tolerance - GRID_ROUNDING))


def next_level(
    lo: float | None,
    hi: float | None,
    guess: float,
    factor: float,
    tolerance: float,
    limit: float = MAX_LEVEL,
    integer: bool = False,
) -> float | None:
    """The level to probe next, or None when the search is done.

    A rate lives on a fixed grid, ``grid_steps(tolerance)`` levels per decade: the guess is
    moved to its nearest level, the bracket widens by whole grid steps (about ``factor``) and
    bisects grid steps, until its ends are neighbours. So two searches from different guesses
    (a scout's, the simulator's, a longer probe's) probe the same levels near the edge, and
    their capacities differ only where their probes' verdicts do. An integer axis (users)
    bisects whole levels instead."""
    least = 1.0 if integer else MIN_LEVEL
    if integer:
        return _next_whole(lo, hi, guess, factor, tolerance, limit, least)
    steps = grid_steps(tolerance)
    if lo is None and hi is None:
        return _grid_level(round(_grid_index(max(min(guess, limit), least), steps)), steps)
    stride = max(round(steps * math.log10(factor)), 1)
    if hi is None:
        up = _grid_level(round(_grid_index(lo, steps)) + stride, steps)
        return None if lo >= limit else min(up, round_level(limit))
    if lo is None:
        down = _grid_level(round(_grid_index(hi, steps)) - stride, steps)
        return None if hi <= least else max(down, least)
    mid = _grid_level(
        math.floor((_grid_index(lo, steps) + _grid_index(hi, steps)) / 2 + 0.5), steps
    )
    return mid if lo < mid < hi and hi - lo > tolerance * lo else None


def _grid_index(level: float, steps: int) -> float:
    """Where a level lies on the grid, in steps from 1 (whole on the grid, up to rounding)."""
    return steps * math.log10(level)


def _grid_level(index: int, steps: int) -> float:
    return round_level(10 ** (index / steps))


def _next_whole(
    lo: float | None,
    hi: float | None,
    guess: float,
    factor: float,
    tolerance: float,
    limit: float,
    least: float,
) -> float | None:
    if lo is None and hi is None:
        return round_level(max(min(guess, limit), least), True)
    if hi is None:
        return None if lo >= limit else round_level(min(lo * factor, limit), True)
    if lo is None:
        return None if hi <= least else round_level(max(hi / factor, least), True)
    if hi - lo <= tolerance * lo:
        return None
    mid = round_level((lo + hi) / 2, True)
    return mid if lo < mid < hi else None


def search(
    probe: Callable[[float], Probe],
    guess: float,
    factor: float = BLIND_FACTOR,
    tolerance: float = 0.05,
    max_probes: int = 16,
    limit: float = MAX_LEVEL,
    integer: bool = False,
) -> Search:
    """Bracket, then bisect, at most ``max_probes`` probes and no level above ``limit``."""
    probes: list[Probe] = []
    seen: set[float] = set()
    while len(probes) < max_probes:
        lo, hi = bracket(probes)
        level = next_level(lo, hi, guess, factor, tolerance, limit, integer)
        if level is None or level in seen:
            break
        probes.append(probe(level))
        seen.add(level)
    lo, hi = bracket(probes)
    return Search(lo or 0.0, hi, tuple(probes), round_level(limit, integer))


EDGE_SPAN = 1.3
"""Probes within this factor of the bracket's ends give the slope of the binding check."""
EDGE_UNRESOLVED = 0.25
"""The relative noise of a capacity whose binding check does not rise across its probes
(noise larger than the slope): its edge is not resolved within ±25 %."""


def edge_resolution(s: Search) -> float:
    """How sure one search is of where the SLO's edge lies, as a relative standard error of the
    level: the binding check's noise at the bracket (the larger standard error of its two
    probes) over how fast the check rises with the level there (the least-squares slope of
    its edge, `Probe.edge_ratio`, against log level over the probes near the bracket). 0 when
    the bracket is sharp (the failing probe broke without a finite edge: a request failed or
    the queue grew) or its noise unknown; `EDGE_UNRESOLVED` when the check does not rise.

    The share of requests beyond a P99's limit can rise slowly across a tenth of the rate
    while its batches scatter, so a bisection to ``tolerance`` would claim a precision the
    probes do not have; the interval says how wide it is."""
    if not s.capacity or s.failing is None:
        return 0.0
    ends = [p for p in s.probes if p.level in (s.capacity, s.failing)]
    noise = [p.edge_se for p in ends]
    if any(se is None for se in noise) or not all(math.isfinite(p.edge_ratio) for p in ends):
        return 0.0
    near = [
        p
        for p in s.probes
        if s.capacity / EDGE_SPAN <= p.level <= s.failing * EDGE_SPAN
        and math.isfinite(p.edge_ratio)
    ]
    logs = [math.log(p.level) for p in near]
    mean_log = sum(logs) / len(logs)
    spread = sum((x - mean_log) ** 2 for x in logs)
    slope = sum((x - mean_log) * p.edge_ratio for x, p in zip(logs, near, strict=True)) / spread
    return min(max(noise) / slope, EDGE_UNRESOLVED) if slope > 0 else EDGE_UNRESOLVED


EDGE_T = T_975[BATCHES - 2]
"""Student's t 97.5 % quantile for the batches' degrees of freedom: a 95 % interval."""


def capacity_interval(searches: Iterable[Search]) -> Interval:
    """Over repeats (one search per seed): the mean capacity and its t interval. One search:
    the capacity, and its bracket widened by `EDGE_T` times its `edge_resolution` at each
    end."""
    searches = list(searches)
    if len(searches) == 1:
        s = searches[0]
        widen = math.exp(EDGE_T * edge_resolution(s))
        return Interval(s.capacity, s.capacity / widen, (s.failing or s.capacity) * widen)
    return t_interval(s.capacity for s in searches)


@dataclass(frozen=True)
class LedgerRow:
    """One deployment of a measured study in the error ledger: the capacity per GPU measured,
    and the simulator twin's for the same deployment with its interval (``None`` when the
    deployment was not simulated first)."""

    measured: float
    simulated: float | None = None
    simulated_lo: float | None = None
    simulated_hi: float | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over simulated: how far the simulator was off for this deployment."""
        if not self.simulated or not self.measured:
            return None
        return self.measured / self.simulated


def predicted_ranges(rows: list[LedgerRow]) -> list[tuple[float, float] | None]:
    """Per deployment, the capacity a user would read from the simulator alone: its interval
    (the sampling part) scaled by the ledger's error, the lowest and highest measured/simulated
    ratio of the study's *other* deployments (held out, so a deployment's own measurement never
    predicts it). None without a simulated capacity or another deployment's ratio."""
    ratios = [row.ratio for row in rows]
    ranges: list[tuple[float, float] | None] = []
    for i, row in enumerate(rows):
        others = [r for j, r in enumerate(ratios) if j != i and r is not None]
        if row.simulated is None or not others:
            ranges.append(None)
            continue
        lo = row.simulated if row.simulated_lo is None else row.simulated_lo
        hi = row.simulated if row.simulated_hi is None else row.simulated_hi
        ranges.append((lo * min(others), hi * max(others)))
    return ranges


def cost_per_million_tokens(gpu_hour_usd: float, gpus: int, output_tokens_per_s: float) -> float:
    """What a million output tokens cost at this throughput (all GPUs of the deployment paid)."""
    if output_tokens_per_s <= 0:
        return math.inf
    return gpu_hour_usd * gpus / 3600 / output_tokens_per_s * 1e6
