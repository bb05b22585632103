"""Comparisons between the configurations of a group: who is fastest at each point (a table),
how a pair's gap moves along x, aggregated vs disaggregated, and model rankings."""

from __future__ import annotations

from servematrix.reporting.findings.common import (
    MEAN_TPOT,
    MEAN_TTFT,
    P99_TTFT,
    Band,
    Curve,
    Group,
    Metric,
    Section,
    Table,
    fmt_change,
    fmt_ms,
    fmt_x,
    noise_text,
    overlap,
    ranking,
    same,
)
from servematrix.spec.matrix import MODES

STEADY_GAP = 0.10
"""A gap whose size changes by at most this fraction "stays about the same"."""
STABILITY_TIE = 0.01
"""Models whose relative growth differs by at most this much are equally stable."""


def _winner_cell(group: Group, metric: Metric, xv: float) -> str:
    """Who has the lowest value at one x and by how much; a tie (within the sentences'
    precision, or within noise when intervals overlap) is never a win."""
    ranked = ranking(group, metric, xv)
    if len(ranked) < 2:
        return "—"
    (best, name), (second, runner_up) = ranked[0], ranked[1]
    bands = {n: group.band(n, metric).get(xv) for _, n in ranked}
    if same(best, second):
        tied = [n for v, n in ranked if same(best, v)]
        return f"tie: {', '.join(tied)} ({fmt_ms(best)})"
    if overlap(bands[name], bands[runner_up]):
        return f"{name}, {runner_up}: " + noise_text(second, bands[runner_up], best, bands[name])
    margin = fmt_ms(second - best) + (f" ({(second - best) / second:.1%})" if second else "")
    return f"{name} {fmt_ms(best)}, {margin} below {runner_up}"


def winner_section(gs: list[Group]) -> Section:
    """One table row per group and x: the lowest mean TTFT and mean TPOT."""
    labelled = any(g.label for g in gs)
    header = [*(["model"] if labelled else []), "point", "lowest mean TTFT", "lowest mean TPOT"]
    rows = [
        [*([g.label or ""] if labelled else []), fmt_x(g.x, xv)]
        + [_winner_cell(g, m, xv) for m in (MEAN_TTFT, MEAN_TPOT)]
        for g in gs
        for xv in g.xs
    ]
    rows = [row for row in rows if row[-1] != "—" or row[-2] != "—"]
    return Section("Lowest latency at each point", [], [Table(header, rows)] if rows else [])


def gap_trend(gaps: list[tuple[float, float]], x: str) -> str:
    """How the gap b − a moves from the lowest to the highest x (0.0 where b and a are the
    same, see ``same``)."""
    (x0, first), (x1, last) = gaps[0], gaps[-1]
    at0, at1 = fmt_x(x, x0), fmt_x(x, x1)
    if first == 0 and last == 0:
        return f"the two are the same at {at0} and at {at1}"
    if first == 0:
        return f"the gap opens from none at {at0} to {fmt_ms(last)} at {at1}"
    if last == 0:
        return f"the gap closes from {fmt_ms(first)} at {at0} to none at {at1}"
    span = f"from {fmt_ms(first)} at {at0} to {fmt_ms(last)} at {at1}"
    if first * last < 0:
        return f"the gap changes sign {span}"
    if abs(last - first) <= STEADY_GAP * max(abs(first), abs(last)):
        return f"the gap stays about the same ({span})"
    return f"the gap {'grows' if abs(last) > abs(first) else 'shrinks'} {span}"


def pair_sentence(
    x: str,
    name_a: str,
    a: Curve,
    name_b: str,
    b: Curve,
    metric: Metric,
    scope: str = "",
    bands: tuple[Band, Band] = ({}, {}),
) -> str | None:
    """``b`` against ``a`` for one metric at every x both have, and how the gap moves; where
    both have 95 % intervals (``bands``) that overlap, the two are the same within noise."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    band_a, band_b = bands

    def noisy(xv: float) -> bool:
        return overlap(band_a.get(xv), band_b.get(xv))

    def change(xv: float) -> str:
        if noisy(xv) and not same(b[xv], a[xv]):
            return noise_text(a[xv], band_a[xv], b[xv], band_b[xv])
        return fmt_change(b[xv], a[xv])

    points = ", ".join(f"{change(xv)} at {fmt_x(x, xv)}" for xv in common)
    sentence = f"{metric.label[0].upper()}{metric.label[1:]}{scope}, {name_b} vs {name_a}: {points}"
    if len(common) > 1:
        gaps = [(xv, 0.0 if same(b[xv], a[xv]) or noisy(xv) else b[xv] - a[xv]) for xv in common]
        sentence += "; " + gap_trend(gaps, x)
    return sentence + "."


def pair_section(title: str, a: str, b: str, metrics: list[Metric], gs: list[Group]) -> Section:
    sentences = [
        pair_sentence(
            g.x, a, g.curve(a, m), b, g.curve(b, m), m, g.scope(), (g.band(a, m), g.band(b, m))
        )
        for g in gs
        if a in g.names and b in g.names
        for m in metrics
    ]
    return Section(title, [s for s in sentences if s])


def best_of(group: Group, names: list[str], metric: Metric) -> Curve:
    """The lowest value among ``names`` at each x."""
    best: Curve = {}
    for name in names:
        for xv, v in group.curve(name, metric).items():
            best[xv] = min(v, best.get(xv, v))
    return best


def _wins(a: Curve, b: Curve) -> tuple[list[float], int]:
    """The x values at which curve ``b`` is lower than curve ``a``, and how many both have."""
    common = sorted(set(a) & set(b))
    return [xv for xv in common if b[xv] < a[xv] and not same(b[xv], a[xv])], len(common)


TRADE_OFFS = {
    (True, True): "it is ahead on both",
    (False, False): "it is behind on both",
    (False, True): "it trades a higher TTFT for a lower TPOT",
    (True, False): "it trades a higher TPOT for a lower TTFT",
}


def trade_off_sentence(
    group: Group, agg_ttft: Curve, dis_ttft: Curve, agg_tpot: Curve, dis_tpot: Curve
) -> str:
    """Where disaggregation wins on TTFT and on TPOT, and which trade-off that makes."""
    ttft, n_ttft = _wins(agg_ttft, dis_ttft)
    tpot, n_tpot = _wins(agg_tpot, dis_tpot)

    def where(won: list[float], n: int) -> str:
        listed = f" ({', '.join(fmt_x(group.x, xv) for xv in won)})" if won else ""
        return f"{len(won)} of {n} points{listed}"

    verdict = TRADE_OFFS[(2 * len(ttft) > n_ttft, 2 * len(tpot) > n_tpot)]
    return (
        f"Disaggregated serving{group.scope()} has the lower mean TTFT at {where(ttft, n_ttft)} "
        f"and the lower mean TPOT at {where(tpot, n_tpot)}: at most points {verdict}."
    )


def disaggregation_section(gs: list[Group]) -> Section:
    """Best aggregated mode vs best disaggregated mode: the TTFT vs TPOT trade-off."""
    sentences: list[str] = []
    for g in gs:
        agg = [n for n in g.names if n in MODES and not MODES[n].disaggregated]
        dis = [n for n in g.names if n in MODES and MODES[n].disaggregated]
        if not agg or not dis:
            continue
        name_a = f"aggregated (best of {', '.join(agg)})"
        name_b = f"disaggregated (best of {', '.join(dis)})"
        curves = {m: (best_of(g, agg, m), best_of(g, dis, m)) for m in (MEAN_TTFT, MEAN_TPOT)}
        for m, (a, b) in curves.items():
            sentence = pair_sentence(g.x, name_a, a, name_b, b, m, g.scope())
            sentences += [sentence] if sentence else []
        sentences.append(trade_off_sentence(g, *curves[MEAN_TTFT], *curves[MEAN_TPOT]))
    return Section("Aggregated vs disaggregated prefill", sentences)


def fastest_sentence(group: Group, metric: Metric) -> str | None:
    """Which model wins ``metric`` at the most x values."""
    wins: dict[str, list[float]] = {}
    points = 0
    for xv in group.xs:
        ranked = ranking(group, metric, xv)
        if len(ranked) >= 2:
            points += 1
            if not same(ranked[0][0], ranked[1][0]):
                wins.setdefault(ranked[0][1], []).append(xv)
    if not points:
        return None
    if not wins:
        return f"No model has a lower {metric.label} than the others ({points} points compared)."
    total = points
    best = max(wins, key=lambda name: len(wins[name]))
    where = ", ".join(fmt_x(group.x, xv) for xv in wins[best])
    return f"{best} has the lowest {metric.label} at {len(wins[best])} of {total} points ({where})."


def growth(curve: Curve) -> float | None:
    """Relative growth from the lowest to the highest x; None when undefined."""
    if len(curve) < 2:
        return None
    first, last = curve[min(curve)], curve[max(curve)]
    return (last - first) / first if first else None


def stability_sentence(group: Group, metric: Metric) -> str | None:
    """Each model's growth of ``metric`` across x, and the model that grows least."""
    grown = {name: growth(group.curve(name, metric)) for name in group.names}
    known = {name: g for name, g in grown.items() if g is not None}
    if len(known) < 2:
        return None
    lo, hi = fmt_x(group.x, group.xs[0]), fmt_x(group.x, group.xs[-1])
    parts = []
    for name, g in sorted(known.items(), key=lambda item: item[1]):
        curve = group.curve(name, metric)
        parts.append(f"{name} {g:+.0%} ({fmt_ms(curve[min(curve)])} → {fmt_ms(curve[max(curve)])})")
    least = min(known.values())
    steadiest = [name for name, g in known.items() if g - least <= STABILITY_TIE]
    verdict = (
        f"{steadiest[0]} is the most stable"
        if len(steadiest) == 1
        else f"{', '.join(steadiest[:-1])} and {steadiest[-1]} are equally stable"
    )
    return f"From {lo} to {hi}, {metric.label} changes by {', '.join(parts)}; {verdict}."


def models_section(gs: list[Group]) -> Section | None:
    """Fastest and most stable model, when the study compares models of one mode."""
    g = gs[0]
    if g.series != "model" or len(g.names) < 2:
        return None
    sentences = [fastest_sentence(g, m) for m in (MEAN_TTFT, MEAN_TPOT)]
    sentences += [stability_sentence(g, m) for m in (MEAN_TTFT, P99_TTFT)]
    return Section("Model comparison", [s for s in sentences if s])
