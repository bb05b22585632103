"""Study findings: the comparisons the published studies drew, as sentences with numbers.

Nothing here knows a study by name. Which comparisons are made depends only on what the
summary contains: several modes are compared within each model (plain vs chunked prefill, RDMA
vs TCP, aggregated vs disaggregated when those modes are present); several models of one mode
are ranked against each other. Every number in a sentence is computed from the summary.
"""

from __future__ import annotations

import html
import itertools
import math
from dataclasses import dataclass

import polars as pl

from servematrix.aggregate import SLOWEST_FRACTION, check_one_row_per_point
from servematrix.config import MODES

SATURATION_JUMP = 2.0
QPS_TOLERANCE = 0.01
SEND_LAG_LIMIT_MS = 5.0
STEADY_GAP = 0.10
"""A gap whose size changes by at most this fraction "stays about the same"."""
STABILITY_TIE = 0.01
"""Models whose relative growth differs by at most this much are equally stable."""
SAME_MS = 0.05
SAME_FRACTION = 0.001
"""Two values closer than SAME_MS or than SAME_FRACTION of the larger one are "the same": a
difference the sentences' precision (0.1 ms, 0.1%) would print as zero is never a win, a loss
or a gap that grows."""


PREEMPTION_DRIVES_TAIL = 0.5
"""Preemption drives a cell's tail when at least this share of its slowest requests
(`aggregate.SLOWEST_FRACTION` of the successful ones by E2E latency) were preempted."""
SAME_MEMORY = 0.005
"""Memory figures within this fraction of each other are the same (a modelled claim is
identical across models; measured ones differ by a few MiB of noise)."""


def same(a: float, b: float) -> bool:
    diff = abs(a - b)
    return diff < SAME_MS or diff < SAME_FRACTION * max(abs(a), abs(b))


REQUIRED = (
    "model",
    "mode",
    "qps",
    "input_len",
    "num_prompts",
    "completed",
    "failed",
    "scheduled_qps",
    "achieved_qps",
    "send_lag_p99_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
)


@dataclass(frozen=True)
class Metric:
    column: str
    label: str


MEAN_TTFT = Metric("mean_ttft_ms", "mean TTFT")
P99_TTFT = Metric("p99_ttft_ms", "P99 TTFT")
MEAN_TPOT = Metric("mean_tpot_ms", "mean TPOT")
P99_TPOT = Metric("p99_tpot_ms", "P99 TPOT")
P99_ITL = Metric("p99_itl_ms", "P99 ITL")
PEAK_GPU_MEMORY = Metric("peak_gpu_memory_mib", "peak GPU memory")
PEAK_KV_USAGE = Metric("peak_kv_cache_usage", "peak KV-cache usage")
WEIGHTS_MIB = Metric("weights_mib_per_gpu", "weights per GPU")
KV_POOL_MIB = Metric("kv_pool_mib_per_gpu", "KV pool per GPU")

Curve = dict[float, float]
"""x value → metric value, only where the value is known."""


@dataclass(frozen=True)
class Section:
    title: str
    sentences: list[str]


@dataclass(frozen=True)
class Findings:
    title: str
    x: str
    sections: list[Section]


@dataclass(frozen=True)
class Group:
    """Configurations compared with each other: one model's modes, or the models of one mode."""

    label: str | None
    series: str
    rows: pl.DataFrame
    x: str

    @property
    def names(self) -> list[str]:
        return self.rows[self.series].unique(maintain_order=True).to_list()

    @property
    def xs(self) -> list[float]:
        return sorted(self.rows[self.x].unique().to_list())

    def curve(self, name: str, metric: Metric) -> Curve:
        part = self.rows.filter(pl.col(self.series) == name)
        return {
            float(xv): float(v)
            for xv, v in zip(part[self.x], part[metric.column], strict=True)
            if v is not None
        }

    def scope(self) -> str:
        return f" for {self.label}" if self.label else ""


def fmt_x(x: str, value: float) -> str:
    return f"QPS {value:g}" if x == "qps" else f"input {value:g} tokens"


def fmt_ms(value: float) -> str:
    return f"{value:,.1f} ms"


def fmt_change(new: float, old: float) -> str:
    """``+12.0 ms (+15.0%)``, or ``the same``; the percentage is left out when ``old`` is 0."""
    if same(new, old):
        return "the same"
    text = f"{new - old:+,.1f} ms"
    return f"{text} ({(new - old) / old:+.1%})" if old else text


def groups(summary: pl.DataFrame, x: str) -> list[Group]:
    """Modes are compared within each model; models are compared when the mode is fixed."""
    if summary["mode"].n_unique() > 1:
        models = summary["model"].unique(maintain_order=True).to_list()
        return [
            Group(
                model if len(models) > 1 else None,
                "mode",
                summary.filter(pl.col("model") == model),
                x,
            )
            for model in models
        ]
    return [Group(None, "model", summary, x)]


def _ranking(group: Group, metric: Metric, xv: float) -> list[tuple[float, str]]:
    values = ((group.curve(name, metric).get(xv), name) for name in group.names)
    return sorted((v, name) for v, name in values if v is not None)


def winner_sentence(group: Group, xv: float) -> str | None:
    """Which configuration has the lowest mean TTFT and mean TPOT at one x, and by how much."""
    parts = []
    for metric in (MEAN_TTFT, MEAN_TPOT):
        ranking = _ranking(group, metric, xv)
        if len(ranking) < 2:
            continue
        (best, name), (second, runner_up) = ranking[0], ranking[1]
        if same(best, second):
            tied = [n for v, n in ranking if same(best, v)]
            parts.append(
                f"{', '.join(tied[:-1])} and {tied[-1]} have the same lowest {metric.label} "
                f"({fmt_ms(best)})"
            )
            continue
        margin = fmt_ms(second - best) + (f" ({(second - best) / second:.1%})" if second else "")
        parts.append(
            f"the lowest {metric.label} is {name}'s {fmt_ms(best)}, {margin} below "
            f"{runner_up}'s {fmt_ms(second)}"
        )
    if not parts:
        return None
    return f"At {fmt_x(group.x, xv)}{group.scope()}, " + "; ".join(parts) + "."


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
    x: str, name_a: str, a: Curve, name_b: str, b: Curve, metric: Metric, scope: str = ""
) -> str | None:
    """``b`` against ``a`` for one metric at every x both have, and how the gap moves."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    points = ", ".join(f"{fmt_change(b[xv], a[xv])} at {fmt_x(x, xv)}" for xv in common)
    sentence = f"{metric.label[0].upper()}{metric.label[1:]}{scope}, {name_b} vs {name_a}: {points}"
    if len(common) > 1:
        gaps = [(xv, 0.0 if same(b[xv], a[xv]) else b[xv] - a[xv]) for xv in common]
        sentence += "; " + gap_trend(gaps, x)
    return sentence + "."


def _pair_section(title: str, a: str, b: str, metrics: list[Metric], gs: list[Group]) -> Section:
    sentences = [
        pair_sentence(g.x, a, g.curve(a, m), b, g.curve(b, m), m, g.scope())
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
        ranking = _ranking(group, metric, xv)
        if len(ranking) >= 2:
            points += 1
            if not same(ranking[0][0], ranking[1][0]):
                wins.setdefault(ranking[0][1], []).append(xv)
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


def _label(row: dict, series: list[str]) -> str:
    return " / ".join(str(row[c]) for c in series)


def jumps(curve: Curve) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """Consecutive points where the value grows by more than SATURATION_JUMP times."""
    points = sorted(curve.items())
    return [
        (a, b) for a, b in itertools.pairwise(points) if a[1] > 0 and b[1] > SATURATION_JUMP * a[1]
    ]


def saturation_section(summary: pl.DataFrame, x: str, series: list[str]) -> Section:
    """Jumps of more than 2× between consecutive x values, and cells short of their requests."""
    sentences = []
    for key, part in summary.group_by(series, maintain_order=True):
        label = " / ".join(str(k) for k in key)
        for metric in (MEAN_TTFT, P99_TTFT):
            curve = {xv: v for xv, v in part.select(x, metric.column).rows() if v is not None}
            sentences += [
                f"{label}: {metric.label} jumps {v1 / v0:.1f}× from {fmt_ms(v0)} at "
                f"{fmt_x(x, x0)} to {fmt_ms(v1)} at {fmt_x(x, x1)}, a sign of saturation."
                for (x0, v0), (x1, v1) in jumps(curve)
            ]
    short = summary.filter(pl.col("completed") < pl.col("num_prompts"))
    sentences += [
        f"{_label(row, series)} at {fmt_x(x, row[x])} completed only {row['completed']} of "
        f"{row['num_prompts']} requests."
        for row in short.iter_rows(named=True)
    ]
    if not sentences:
        sentences = [
            f"No configuration saturates: no TTFT more than doubles between consecutive "
            f"{'QPS values' if x == 'qps' else 'input lengths'} and every cell completed all its "
            "requests."
        ]
    return Section("Saturation", sentences)


def preemption_section(summary: pl.DataFrame, x: str, series: list[str]) -> Section | None:
    """Where the engine preempted requests, and the cells whose tail it drives; none when no
    cell's backend counts preemptions (a real server's client cannot)."""
    if "preemptions_total" not in summary.columns:
        return None
    known = summary.filter(pl.col("preemptions_total").is_not_null())
    if known.is_empty():
        return None
    preempting = known.filter(pl.col("preempted_requests") > 0)
    if preempting.is_empty():
        return Section(
            "Preemption",
            [f"No request was preempted in any of the {known.height} cells that count them."],
        )
    sentences, others = [], []
    tail = f"the slowest {SLOWEST_FRACTION:.0%} by E2E latency"
    for row in preempting.iter_rows(named=True):
        where = f"{_label(row, series)} at {fmt_x(x, row[x])}"
        share = row["slowest_preempted_share"]
        count = f"{row['preempted_requests']} of {row['num_prompts']} requests"
        if share is None or share < PREEMPTION_DRIVES_TAIL:
            others.append(f"{where} ({count})")
            continue
        medians = ""
        if row["preempted_median_e2el_ms"] is not None and row["unpreempted_median_e2el_ms"]:
            medians = (
                f"; their median E2E latency is {fmt_ms(row['preempted_median_e2el_ms'])} "
                f"against {fmt_ms(row['unpreempted_median_e2el_ms'])} for the others"
            )
        sentences.append(
            f"{where}: {count} were preempted ({row['preemptions_total']} preemptions) and they "
            f"are {share:.0%} of {tail}{medians}: preemption drives the tail."
        )
    if others:
        sentences.append(
            f"Requests were preempted without driving the tail (under "
            f"{PREEMPTION_DRIVES_TAIL:.0%} of {tail} preempted) in: {', '.join(others)}."
        )
    return Section("Preemption", sentences)


def reuse_section(summary: pl.DataFrame, x: str, series: list[str]) -> Section | None:
    """How much of the prefix reuse a trace allows each configuration's prefix caches got (the
    servers' hit rate against `replay.reuse_bound`), over the study's points; none when no
    cell knows either."""
    if "prefix_best_hit_rate" not in summary.columns:
        return None
    known = summary.filter(
        pl.col("prefix_best_hit_rate").is_not_null() | pl.col("prefix_hit_rate").is_not_null()
    )
    if known.is_empty():
        return None
    sentences = []
    for key, part in known.group_by(series, maintain_order=True):
        label = _label(dict(zip(series, key, strict=True)), series)
        got = part["prefix_hit_rate"].drop_nulls()
        best = part["prefix_best_hit_rate"].drop_nulls()
        allows = f"the trace allows {_span(best)}" if len(best) else ""
        if not len(got):
            sentences.append(f"{label}: no prefix caching; {allows}.")
            continue
        share = ""
        if len(best) and best.min() > 0:
            share = f" ({_span(got / best, '.0%')} of the possible reuse)"
        of = f", of the {_span(best)} the trace allows{share}" if allows else ""
        sentences.append(f"{label}: the prefix caches hit {_span(got)} of prompt tokens{of}.")
    dropped = known.filter(pl.col("trace_dropped_requests") > 0)
    if not dropped.is_empty():
        sentences.append(
            f"The input cap dropped {_span(dropped['trace_dropped_requests'], ',')} trace "
            "requests from the window (the next ones were replayed instead)."
        )
    return Section("Prefix reuse", sentences)


def _span(values: pl.Series, spec: str = ".1%") -> str:
    """``12.6%``, or ``11.6-12.6%`` across points (``spec``: the format of each value)."""
    low, high = format(values.min(), spec), format(values.max(), spec)
    if low == high:
        return low
    return f"{low.removesuffix('%')}-{high}" if spec.endswith("%") else f"{low}-{high}"


def fmt_mib(value: float) -> str:
    return f"{value:,.0f} MiB"


def _peak(group: Group, metric: Metric) -> dict[str, float]:
    """Each configuration's highest value of ``metric`` over the x values."""
    if metric.column not in group.rows.columns:
        return {}
    curves = {name: group.curve(name, metric) for name in group.names}
    return {name: max(curve.values()) for name, curve in curves.items() if curve}


def _same_memory(values: list[float]) -> bool:
    return max(values) - min(values) <= SAME_MEMORY * max(values)


def gpu_memory_sentence(group: Group) -> str | None:
    """Peak GPU memory of each configuration (busiest GPU, highest over the x values) and,
    where the engine is modelled, how the weights split it with the KV pool."""
    peaks = _peak(group, PEAK_GPU_MEMORY)
    if len(peaks) < 2:
        return None
    if _same_memory(list(peaks.values())):
        text = (
            f"Peak GPU memory (busiest GPU){group.scope()} is the same for every {group.series}, "
            f"{fmt_mib(max(peaks.values()))}"
        )
    else:
        ranked = sorted(peaks.items(), key=lambda item: item[1])
        text = (
            f"Peak GPU memory (busiest GPU){group.scope()}, highest over the "
            f"{'QPS values' if group.x == 'qps' else 'input lengths'}: "
            + ", ".join(f"{name} {fmt_mib(v)}" for name, v in ranked)
            + f"; {ranked[0][0]} needs the least"
        )
    weights, pools = _peak(group, WEIGHTS_MIB), _peak(group, KV_POOL_MIB)
    split = [name for name in peaks if name in weights and name in pools]
    if len(split) >= 2:
        split.sort(key=lambda name: weights[name])
        text += (
            " (vLLM claims its share of every GPU at start-up and fills what the weights leave "
            "with KV cache; modelled per GPU: "
        )
        if _same_memory([weights[n] for n in split]) and _same_memory([pools[n] for n in split]):
            first = split[0]
            text += (
                f"{fmt_mib(weights[first])} of weights and a {fmt_mib(pools[first])} KV pool "
                f"for every {group.series})"
            )
        else:
            text += (
                ", ".join(
                    f"{name} {fmt_mib(weights[name])} of weights and a "
                    f"{fmt_mib(pools[name])} KV pool"
                    for name in split
                )
                + ")"
            )
    return text + "."


def kv_usage_sentence(group: Group) -> str | None:
    """Peak KV-cache usage of each configuration from the lowest to the highest x, and the
    one that fills its cache most."""
    if PEAK_KV_USAGE.column not in group.rows.columns:
        return None
    curves = {name: group.curve(name, PEAK_KV_USAGE) for name in group.names}
    curves = {name: curve for name, curve in curves.items() if curve}
    if len(curves) < 2:
        return None
    parts = []
    for name, curve in curves.items():
        lo, hi = min(curve), max(curve)
        if lo == hi:
            parts.append(f"{name} {curve[hi]:.1%} at {fmt_x(group.x, hi)}")
        else:
            parts.append(
                f"{name} {curve[lo]:.1%} at {fmt_x(group.x, lo)} → {curve[hi]:.1%} at "
                f"{fmt_x(group.x, hi)}"
            )
    fullest = max(curves, key=lambda name: max(curves[name].values()))
    return (
        f"Peak KV-cache usage{group.scope()}: {', '.join(parts)}; {fullest} fills its cache "
        f"most ({max(curves[fullest].values()):.1%})."
    )


def memory_section(gs: list[Group]) -> Section | None:
    """GPU memory and KV-cache usage compared across the configurations of each group, where
    the summary has them (issue 9: a model choice is speed *and* memory)."""
    if "peak_gpu_memory_mib" not in gs[0].rows.columns:
        return None
    sentences = [
        s
        for g in gs
        if len(g.names) > 1
        for s in (gpu_memory_sentence(g), kv_usage_sentence(g))
        if s
    ]
    return Section("Memory", sentences)


def qps_sentence(row: dict, where: str) -> str | None:
    """A sentence when the client sent slower or faster than its own schedule asked.

    The schedule is a random sample, so its rate differs from the nominal QPS by chance; only a
    gap between sent and scheduled rates says the load generator did not keep up.
    """
    scheduled, achieved = row["scheduled_qps"], row["achieved_qps"]
    if not scheduled or achieved is None:
        return None
    if not math.isfinite(achieved):
        return f"{where}: every request was sent at the same instant (no measurable rate)."
    if abs(achieved - scheduled) <= QPS_TOLERANCE * scheduled:
        return None
    return (
        f"{where}: sent {achieved:.2f} requests/s where the schedule asked for "
        f"{scheduled:.2f} ({(achieved - scheduled) / scheduled:+.1%})."
    )


def health_section(summary: pl.DataFrame, x: str, series: list[str]) -> Section:
    """Did the load generator deliver the load it was asked for, and did requests fail?"""
    qps_misses, lags, capped = [], [], []
    for row in summary.iter_rows(named=True):
        where = f"{_label(row, series)} at {fmt_x(x, row[x])}"
        qps_miss = qps_sentence(row, where)
        lag = row["send_lag_p99_ms"]
        lagging = lag is not None and lag > SEND_LAG_LIMIT_MS
        if row.get("max_concurrency"):
            # Waiting for a slot is the workload, not the client falling behind.
            if qps_miss or lagging:
                capped.append(
                    f"{where} held at most {row['max_concurrency']} requests in flight "
                    f"(max_concurrency): its sending rate and P99 send lag "
                    f"({fmt_ms(lag or 0.0)}) include waiting for a free slot."
                )
            continue
        qps_misses += [qps_miss] if qps_miss else []
        if lagging:
            lags.append(f"{where}: P99 send lag is {fmt_ms(lag)} (limit {SEND_LAG_LIMIT_MS:g} ms).")
    sentences = qps_misses + lags
    if not sentences:
        sentences.append(
            f"The load generator kept every cell within {QPS_TOLERANCE:.0%} of its schedule's "
            f"rate with a P99 send lag of at most {SEND_LAG_LIMIT_MS:g} ms"
            + (" where no concurrency cap held requests back." if capped else ".")
        )
    sentences += capped
    failed = summary.filter(pl.col("failed") > 0)
    if failed.is_empty():
        sentences.append(f"No request failed in any of the {summary.height} cells.")
    else:
        sentences.append(
            f"{int(failed['failed'].sum())} request(s) failed, in {failed.height} of "
            f"{summary.height} cells: "
            + ", ".join(
                f"{_label(row, series)} at {fmt_x(x, row[x])} ({row['failed']})"
                for row in failed.iter_rows(named=True)
            )
            + "."
        )
    return Section("Harness health and failures", sentences)


def _check(summary: pl.DataFrame, x: str) -> None:
    if x not in ("qps", "input_len"):
        raise ValueError(f"x must be 'qps' or 'input_len', got {x!r}")
    missing = [c for c in REQUIRED if c not in summary.columns]
    if missing:
        raise ValueError(f"study summary lacks column(s): {', '.join(missing)}")
    check_one_row_per_point(summary, x)


def _clean(summary: pl.DataFrame) -> pl.DataFrame:
    """NaN or infinite metrics (no successful request) are treated as missing values.

    ``achieved_qps`` keeps its infinity: it means every request went out at one instant; so
    do ``qps`` and ``scheduled_qps`` (``qps: inf``, every request scheduled at t = 0).
    """
    keep = ("qps", "scheduled_qps", "achieved_qps")
    floats = [c for c, t in summary.schema.items() if t.is_float() and c not in keep]
    return summary.with_columns(
        pl.when(pl.col(c).is_finite()).then(pl.col(c)).alias(c) for c in floats
    )


def study_findings(summary: pl.DataFrame, title: str, x: str) -> Findings:
    """Turn one study's summary into sections of sentences."""
    _check(summary, x)
    if summary.is_empty():
        return Findings(title, x, [Section("No data", ["The study summary has no cells."])])
    summary = _clean(summary)
    gs = groups(summary, x)
    series = [c for c in ("model", "mode") if summary[c].n_unique() > 1] or ["model"]
    sections = [
        Section(
            "Lowest latency at each point",
            [s for g in gs for xv in g.xs if (s := winner_sentence(g, xv))],
        ),
        _pair_section(
            "Plain vs chunked prefill", "nondisagg", "chunked", [MEAN_TTFT, P99_TPOT, P99_ITL], gs
        ),
        _pair_section(
            "Mooncake RDMA vs TCP",
            "mooncake-rdma",
            "mooncake-tcp",
            [MEAN_TTFT, P99_TTFT, MEAN_TPOT],
            gs,
        ),
        disaggregation_section(gs),
        models_section(gs),
        memory_section(gs),
        saturation_section(summary, x, series),
        preemption_section(summary, x, series),
        reuse_section(summary, x, series),
        health_section(summary, x, series),
    ]
    return Findings(title, x, [s for s in sections if s and s.sentences])


def to_markdown(findings: Findings) -> str:
    lines = [f"# Findings: {findings.title}", ""]
    for section in findings.sections:
        lines += [f"## {section.title}", ""]
        lines += [f"- {sentence}" for sentence in section.sentences]
        lines.append("")
    return "\n".join(lines)


def to_html(findings: Findings) -> str:
    """A self-contained page (no external resources), every text escaped."""
    body = [f"<h1>Findings: {html.escape(findings.title)}</h1>"]
    for section in findings.sections:
        body.append(f"<h2>{html.escape(section.title)}</h2>")
        body.append("<ul>")
        body += [f"<li>{html.escape(s)}</li>" for s in section.sentences]
        body.append("</ul>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>Findings: {html.escape(findings.title)}</title>\n"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.5}"
        "h2{margin-top:1.5em}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )
