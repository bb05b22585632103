"""Capacity at an SLO: the highest request rate a deployment serves within its latency targets.

A search over rates, each probe one steady-state run at that rate (``servematrix.capacity_run``
runs them, ``servematrix.steady`` judges them): bracket the capacity between a rate that meets
the SLO and one that does not, expanding from a first guess by a factor, then bisect until the
bracket is within ``tolerance`` of the rate or the probes run out. Rates are rounded to three
significant figures, so a probe's cell path stays readable and a rerun lands on the same cells
(cached like any cell). A measured search may start from the simulator's capacity with a small
factor: a few probes around it instead of a blind bracket (``WARM_FACTOR``). The search stops
at ``limit_rps`` (a multiple of the deployment's physical ceiling where one is known): a
search that met the SLO there found no failing rate, and says so (``Search.limited``).

Pure logic: the probe is a function given by the caller, so the search is tested directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from servematrix.intervals import Interval, t_interval

BLIND_FACTOR = 2.0
"""A blind search doubles (or halves) the rate until the SLO's edge is bracketed."""
WARM_FACTOR = 1.1
"""A search from the simulator's capacity steps 10 % at a time around it."""
MIN_RATE_RPS = 0.01
MAX_RATE_RPS = 1e4
"""The search gives up below (capacity 0: not even a trickle meets the SLO) and, without a
physical ceiling, above (the SLO never broke)."""


@dataclass(frozen=True)
class Probe:
    """One measured rate: did it meet the SLO, which bounds broke, what it delivered."""

    rate_rps: float
    met: bool
    broken: tuple[str, ...]
    output_tokens_per_s: float
    trace: str
    requests: int = 0


@dataclass(frozen=True)
class Search:
    """``capacity_rps`` is the highest rate that met the SLO below the lowest that did not
    (``failing_rps``; None when none failed up to ``limit_rps``); ``probes`` in the order run."""

    capacity_rps: float
    failing_rps: float | None
    probes: tuple[Probe, ...]
    limit_rps: float = MAX_RATE_RPS

    @property
    def limited(self) -> bool:
        """No failing rate up to the limit: the capacity is at least it, not measured."""
        return self.failing_rps is None and self.capacity_rps > 0

    @property
    def at_capacity(self) -> Probe | None:
        return next((p for p in self.probes if p.rate_rps == self.capacity_rps and p.met), None)

    @property
    def breaks_first(self) -> tuple[str, ...]:
        """The bounds broken at the lowest failing rate, furthest over its limit first."""
        failing = next((p for p in self.probes if p.rate_rps == self.failing_rps), None)
        return failing.broken if failing else ()


def round_rate(rate_rps: float) -> float:
    """Three significant figures (a probe's path names its rate)."""
    if rate_rps <= 0:
        return 0.0
    return float(f"{rate_rps:.3g}")


def bracket(probes: Iterable[Probe]) -> tuple[float | None, float | None]:
    """(highest passing rate below the lowest failing one, lowest failing rate)."""
    probes = list(probes)
    failing = min((p.rate_rps for p in probes if not p.met), default=None)
    passing = [p.rate_rps for p in probes if p.met and (failing is None or p.rate_rps < failing)]
    return max(passing, default=None), failing


def next_rate(
    lo: float | None,
    hi: float | None,
    guess: float,
    factor: float,
    tolerance: float,
    limit_rps: float = MAX_RATE_RPS,
) -> float | None:
    """The rate to probe next, or None when the search is done."""
    if lo is None and hi is None:
        return round_rate(min(guess, limit_rps))
    if hi is None:
        return None if lo >= limit_rps else round_rate(min(lo * factor, limit_rps))
    if lo is None:
        return None if hi <= MIN_RATE_RPS else round_rate(max(hi / factor, MIN_RATE_RPS))
    if hi - lo <= tolerance * lo:
        return None
    mid = round_rate((lo + hi) / 2)
    return mid if lo < mid < hi else None


def search(
    probe: Callable[[float], Probe],
    guess_rps: float,
    factor: float = BLIND_FACTOR,
    tolerance: float = 0.05,
    max_probes: int = 16,
    limit_rps: float = MAX_RATE_RPS,
) -> Search:
    """Bracket, then bisect, at most ``max_probes`` probes and no rate above ``limit_rps``."""
    probes: list[Probe] = []
    seen: set[float] = set()
    while len(probes) < max_probes:
        lo, hi = bracket(probes)
        rate = next_rate(lo, hi, guess_rps, factor, tolerance, limit_rps)
        if rate is None or rate in seen:
            break
        probes.append(probe(rate))
        seen.add(rate)
    lo, hi = bracket(probes)
    return Search(lo or 0.0, hi, tuple(probes), round_rate(limit_rps))


def capacity_interval(searches: Iterable[Search]) -> Interval:
    """Over repeats (one search per seed): the mean capacity and its t interval. One search:
    the capacity and its bracket (the search's resolution, not a noise estimate)."""
    searches = list(searches)
    if len(searches) == 1:
        s = searches[0]
        return Interval(s.capacity_rps, s.capacity_rps, s.failing_rps or s.capacity_rps)
    return t_interval(s.capacity_rps for s in searches)


def cost_per_million_tokens(gpu_hour_usd: float, gpus: int, output_tokens_per_s: float) -> float:
    """What a million output tokens cost at this throughput (all GPUs of the deployment paid)."""
    if output_tokens_per_s <= 0:
        return math.inf
    return gpu_hour_usd * gpus / 3600 / output_tokens_per_s * 1e6
