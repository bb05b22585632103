"""Tails below saturation (issue 42): the simulator's spread of each latency checked against the
published one, rather than assumed.

Below saturation a latency's tail is set by what varies from request to request: prompt and
output lengths, the prefills a decode waits behind, and the step-time noise the simulator adds
(`engine.instance.Jitter`: a lognormal CV of 3 % and 0.5 % stragglers, from peers' figures, not
fitted). For every run in the ``low`` or ``moderate`` regime that publishes a tail and a centre
of one latency, the tail over the centre, published and simulated: P99 over the median where
the median is published, else P90 and P99 over the mean (BLIS's runs). The ratio of the two
spreads says whether the simulated tail is as wide as the published one; it is read from the
values `fidelity.py` already scores, so it costs no simulation.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fidelity_points import Point

FAMILIES = ("ttft", "tpot", "itl", "e2el")
BELOW_SATURATION = ("low", "moderate")
PAIRS = (("median", "p99"), ("mean", "p90"), ("mean", "p99"))
"""(centre, tail) in the order they are looked for; a run with a median uses only the first."""


@dataclass(frozen=True)
class Spread:
    """One latency's tail over its centre in one run, published and at each simulated seed."""

    set_name: str
    source: str
    label: str
    family: str
    centre: str
    tail: str
    published: float
    simulated: tuple[float, ...]

    @property
    def excess_ratio(self) -> float:
        """How much of the published spread beyond the centre the simulation has, seed 0
        (1: as wide; below 1: narrower)."""
        return (self.simulated[0] - 1.0) / (self.published - 1.0)


def spreads(points: Iterable[Point]) -> list[Spread]:
    """Every (tail, centre) pair of `PAIRS` both published for a run below saturation."""
    runs: dict[tuple[str, str, str], dict[str, Point]] = {}
    for point in points:
        if point.regime in BELOW_SATURATION:
            runs.setdefault((point.set_name, point.source, point.label), {})[point.metric] = point
    found: list[Spread] = []
    for (set_name, source, label), metrics in runs.items():
        for family in FAMILIES:
            for centre, tail in _pairs(metrics, family):
                low, high = metrics[f"{centre}_{family}_ms"], metrics[f"{tail}_{family}_ms"]
                if low.published <= 0 or min(low.predicted) <= 0:
                    continue
                simulated = tuple(t / c for t, c in zip(high.predicted, low.predicted, strict=True))
                published = high.published / low.published
                found.append(
                    Spread(set_name, source, label, family, centre, tail, published, simulated)
                )
    return found


def _pairs(metrics: dict[str, Point], family: str) -> list[tuple[str, str]]:
    present = [
        (centre, tail)
        for centre, tail in PAIRS
        if f"{centre}_{family}_ms" in metrics and f"{tail}_{family}_ms" in metrics
    ]
    return present[:1] if present and present[0][0] == "median" else present


def format_tails(found: Sequence[Spread], seeds: int) -> list[str]:
    """The spreads one per line, then per set and latency how the simulated compare."""
    seeds_text = f"; range over {seeds} seeds" if seeds > 1 else ""
    lines = [
        "== Tails below saturation: a latency's tail over its centre, published vs simulated "
        f"(seed 0{seeds_text}; excess = (simulated - 1) / (published - 1): below 1 the "
        "simulated tail is narrower)"
    ]
    lines.append(f"{'set':<12}{'source':<16}{'run':<46}{'tail/centre':<17}"
                 f"{'published':>10}{'simulated':>10}{'excess':>8}")  # fmt: skip
    for s in found:
        name = f"{s.tail}/{s.centre} {s.family}"
        seed_range = ""
        if seeds > 1:
            seed_range = f"  [{min(s.simulated):.2f}-{max(s.simulated):.2f}]"
        lines.append(
            f"{s.set_name:<12}{s.source:<16}{s.label[:45]:<46}{name:<17}"
            f"{s.published:>10.2f}{s.simulated[0]:>10.2f}{s.excess_ratio:>8.2f}{seed_range}"
        )
    groups: dict[tuple[str, str], list[Spread]] = {}
    for s in found:
        groups.setdefault((s.set_name, s.family), []).append(s)
    for (set_name, family), group in sorted(groups.items()):
        narrower = sum(s.simulated[0] < s.published for s in group)
        excess = statistics.median(s.excess_ratio for s in group)
        lines.append(
            f"  {set_name} {family}: {len(group)} spreads, {narrower} simulated narrower than "
            f"published, median excess ratio {excess:.2f}"
        )
    if not found:
        lines.append("  (no run below saturation publishes a tail and its centre)")
    return lines
