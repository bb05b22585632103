"""Capacity at an SLO: the highest load a deployment serves within its latency targets.

A load is a level on one axis (``servematrix.loads``): a request rate in req/s, a number of
concurrent users, or a session arrival rate. The search runs over levels, each probe one
steady-state run at that level (``servematrix.capacity_run`` runs them,
``servematrix.steady`` judges them): bracket the capacity between a level that meets the SLO
and one that does not, expanding from a first guess by a factor, then bisect until the bracket
is within ``tolerance`` of the level or the probes run out. Levels are rounded to three
significant figures, or to whole numbers on an integer axis (users), so a probe's cell path
stays readable and a rerun lands on the same cells (cached like any cell). A measured search
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

from servematrix.intervals import Interval, t_interval

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
    """Three significant figures (a probe's path names its level); whole numbers, at least
    one, on an integer axis."""
    if level <= 0:
        return 0.0
    if integer:
        return float(max(round(level), 1))
    return float(f"{level:.3g}")


def bracket(probes: Iterable[Probe]) -> tuple[float | None, float | None]:
    """(highest passing level below the lowest failing one, lowest failing level)."""
    probes = list(probes)
    failing = min((p.level for p in probes if not p.met), default=None)
    passing = [p.level for p in probes if p.met and (failing is None or p.level < failing)]
    return max(passing, default=None), failing


def next_level(
    lo: float | None,
    hi: float | None,
    guess: float,
    factor: float,
    tolerance: float,
    limit: float = MAX_LEVEL,
    integer: bool = False,
) -> float | None:
    """The level to probe next, or None when the search is done."""
    least = 1.0 if integer else MIN_LEVEL
    if lo is None and hi is None:
        return round_level(max(min(guess, limit), least), integer)
    if hi is None:
        return None if lo >= limit else round_level(min(lo * factor, limit), integer)
    if lo is None:
        return None if hi <= least else round_level(max(hi / factor, least), integer)
    if hi - lo <= tolerance * lo:
        return None
    mid = round_level((lo + hi) / 2, integer)
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


def capacity_interval(searches: Iterable[Search]) -> Interval:
    """Over repeats (one search per seed): the mean capacity and its t interval. One search:
    the capacity and its bracket (the search's resolution, not a noise estimate)."""
    searches = list(searches)
    if len(searches) == 1:
        s = searches[0]
        return Interval(s.capacity, s.capacity, s.failing or s.capacity)
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
