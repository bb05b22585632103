"""Prefix reuse: how much of what a trace allows each configuration's prefix caches got."""

from __future__ import annotations

import polars as pl

from servematrix.reporting.findings.common import Section, label_of


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
        label = label_of(dict(zip(series, key, strict=True)), series)
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
