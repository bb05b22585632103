"""The findings about limits and the harness: saturation, preemption, memory, and whether the
load generator delivered the load it was asked for."""

from __future__ import annotations

import itertools
import math

import polars as pl

from servematrix.reporting.findings.common import (
    KV_POOL_MIB,
    MEAN_TTFT,
    OVERLOADED_NOTE,
    P99_TTFT,
    PEAK_GPU_MEMORY,
    PEAK_KV_USAGE,
    WEIGHTS_MIB,
    Curve,
    Group,
    Metric,
    Section,
    fmt_mib,
    fmt_ms,
    fmt_x,
    label_of,
    overloaded,
)
from servematrix.results.aggregate import SLOWEST_FRACTION

SATURATION_JUMP = 2.0
QPS_TOLERANCE = 0.01
SEND_LAG_LIMIT_MS = 5.0
PREEMPTION_DRIVES_TAIL = 0.5
"""Preemption drives a cell's tail when at least this share of its slowest requests
(`aggregate.SLOWEST_FRACTION` of the successful ones by E2E latency) were preempted."""
SAME_MEMORY = 0.005
"""Memory figures within this fraction of each other are the same (a modelled claim is
identical across models; measured ones differ by a few MiB of noise)."""


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
        f"{label_of(row, series)} at {fmt_x(x, row[x])} completed only {row['completed']} of "
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


def overloaded_section(summary: pl.DataFrame, x: str, series: list[str]) -> Section | None:
    """The points that never reached steady state (the summary's ``steady``), which the latency
    comparisons leave out; none when the summary does not say."""
    if "steady" not in summary.columns:
        return None
    marked = summary.filter(overloaded(summary))
    if marked.is_empty():
        return Section("Overloaded points", ["Every point reached steady state."])
    points = [
        f"{' / '.join(str(k) for k in key)} at {', '.join(fmt_x(x, v) for v in part[x].sort())}"
        for key, part in marked.group_by(series, maintain_order=True)
    ]
    return Section(
        "Overloaded points",
        [
            f"{marked.height} of {summary.height} points are {OVERLOADED_NOTE}; the latency "
            f"comparisons below leave them out: {'; '.join(points)}."
        ],
    )


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
        where = f"{label_of(row, series)} at {fmt_x(x, row[x])}"
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
        where = f"{label_of(row, series)} at {fmt_x(x, row[x])}"
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
            # Not "the load generator": the simulator has none (its sends are the schedule).
            f"Every cell's requests were sent within {QPS_TOLERANCE:.0%} of its schedule's "
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
                f"{label_of(row, series)} at {fmt_x(x, row[x])} ({row['failed']})"
                for row in failed.iter_rows(named=True)
            )
            + "."
        )
    return Section("Harness health and failures", sentences)
