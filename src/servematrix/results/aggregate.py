"""A study's summary: one row per cell trace, every metric, written as Parquet, CSV and HTML."""

from __future__ import annotations

import contextlib
import html
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from servematrix.backends import backend_of, prefixstats
from servematrix.common.files import atomic_path
from servematrix.results import intervals, metrics, steady
from servematrix.spec import matrix, trace
from servematrix.workload import sessions

SORT_KEYS = ("model", "mode", "input_len", "qps")
CSV_DECIMALS = 3
"""Decimals of every float in the CSV (µs for milliseconds); the Parquet keeps full precision."""

# (column, header) of the HTML table: what a reader compares across cells.
HTML_COLUMNS = (
    ("model", "model"),
    ("mode", "mode"),
    ("chunked_prefill", "chunked prefill"),
    ("qps", "QPS"),
    ("input_len", "input len"),
    ("completed", "completed"),
    ("failed", "failed"),
    ("mean_ttft_ms", "mean TTFT (ms)"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("p99_ttft_ms", "P99 TTFT (ms)"),
    ("mean_tpot_ms", "mean TPOT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"),
    ("p99_tpot_ms", "P99 TPOT (ms)"),
    ("mean_itl_ms", "mean ITL (ms)"),
    ("median_itl_ms", "median ITL (ms)"),
    ("p99_itl_ms", "P99 ITL (ms)"),
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tokens/s"),
    ("request_goodput", "goodput (requests/s)"),
    ("preempted_requests", "preempted requests"),
    ("prefix_hit_rate", "prefix-cache hit rate"),
    ("prefix_best_hit_rate", "best possible hit rate"),
)

HTML_STYLE = (
    "body{font-family:sans-serif;margin:1.5em}"
    "table{border-collapse:collapse;font-size:0.9em}"
    "th,td{border:1px solid #ccc;padding:0.25em 0.5em}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums}"
    "th{background:#f2f2f2}"
)


WORKLOAD_COLUMNS = {"max_concurrency": pl.Int64()}
"""Workload settings the identity columns omit, from the trace metadata (the cell's config, or
``servematrix bench``'s workload); null where a trace has none. ``max_concurrency`` tells the
findings that a cell's send lag includes waiting for a free slot."""

SERVING_COLUMNS = {"chunked_prefill": pl.Boolean()}
"""How the servers ran, from the trace metadata's cell: ``chunked_prefill`` whether they chunked
prefills, the mode's choice or else its recipe's default (`matrix.chunks_prefill`); null where
servematrix started no server (backend external, `servematrix bench`), as the mode could not
change it."""

MEMORY_COLUMNS = {
    "peak_gpu_memory_mib": pl.Float64(),
    "peak_kv_cache_usage": pl.Float64(),
    "weights_mib_per_gpu": pl.Float64(),
    "kv_pool_mib_per_gpu": pl.Float64(),
}
"""From the trace metadata's ``memory`` (servematrix.deploy.memory): peaks measured on vllm,
modelled on emulator and simulator, which also give the modelled split of a GPU (weights, KV
pool); null where a trace has none."""

PREEMPTION_COLUMNS = {
    "preemptions_total": pl.Int64(),
    "preempted_requests": pl.Int64(),
    "slowest_preempted_share": pl.Float64(),
    "preempted_median_e2el_ms": pl.Float64(),
    "unpreempted_median_e2el_ms": pl.Float64(),
}
"""From the trace's ``preemptions`` column, over the measured requests; null where the backend
cannot know (a real server's client). ``slowest_preempted_share``: of the slowest
``SLOWEST_FRACTION`` of successful requests by E2E latency (at least one request), the share
that were preempted at least once; the medians are the E2E latencies of the successful requests
that were and were not preempted (null when there are none)."""

SLOWEST_FRACTION = 0.01

PREFIX_COLUMNS = {
    "prefix_hit_rate": pl.Float64(),
    "prefix_best_hit_rate": pl.Float64(),
    "trace_dropped_requests": pl.Int64(),
}
"""From the trace metadata's ``prefix_cache`` (servematrix.backends.prefixstats): the share of
prompt tokens the servers' prefix caches hit (null with caching off or where the server has no
counters), the most a Mooncake trace allows, and the requests its input cap dropped."""

TURN_COLUMNS = {
    "ttft_turn1_mean_ms": pl.Float64(),
    "ttft_later_turns_mean_ms": pl.Float64(),
}
"""A sessions workload's mean TTFT of the users' first turns and of their later turns (whose
prompts carry the history), over the successful measured requests; null for other workloads."""


STEADY_COLUMNS = {"steady": pl.Boolean(), "steady_reason": pl.String()}
"""Whether the point reached steady state (``servematrix.results.steady``); when not, why (a growing
queue: its latencies depend on how long the run was)."""


def steady_summary(table: pa.Table, workload: Mapping[str, Any]) -> dict[str, Any]:
    state = steady.steadiness(steady.measured_frame(table), steady.shape_of(workload))
    return {"steady": state.steady, "steady_reason": state.reason or None}


def _summary_schema() -> dict[str, pl.DataType]:
    """Identity columns typed as in the trace, CellMetrics fields, then the trace path."""
    identity = pl.DataFrame(pa.schema(trace.IDENTITY_COLUMNS).empty_table()).schema
    numeric = {"int": pl.Int64(), "float": pl.Float64()}
    measured = {f.name: numeric[str(f.type)] for f in fields(metrics.CellMetrics)}
    return {
        **identity,
        **measured,
        **WORKLOAD_COLUMNS,
        **SERVING_COLUMNS,
        **MEMORY_COLUMNS,
        **PREEMPTION_COLUMNS,
        **PREFIX_COLUMNS,
        **TURN_COLUMNS,
        **STEADY_COLUMNS,
        **intervals.INTERVAL_COLUMNS,
        "repeats": pl.Int64(),
        "trace": pl.String(),
    }


SUMMARY_SCHEMA = _summary_schema()


def summarize(
    trace_paths: Iterable[str | os.PathLike[str]], slo_ms: Mapping[str, float] | None = None
) -> pl.DataFrame:
    """One row per trace: its cell identity, every `CellMetrics` field and its path.

    Rows are sorted by model, mode, input_len, qps. A malformed trace raises `trace.TraceError`
    and one without usable requests `metrics.MetricsError`; both name the file. Repeats of a
    point (its seeds) are merged into one row with 95 % intervals (`intervals.merge_repeats`).
    """
    rows = [summary_row(path, slo_ms) for path in trace_paths]
    cells = pl.DataFrame(rows, schema=SUMMARY_SCHEMA)
    return intervals.merge_repeats(cells).sort(SORT_KEYS)


def summary_row(
    path: str | os.PathLike[str],
    slo_ms: Mapping[str, float] | None = None,
    with_intervals: bool = True,
) -> dict[str, Any]:
    """One trace's summary row; ``with_intervals=False`` leaves the bootstrap intervals null
    (a capacity probe, judged on its statistics alone, would spend a third of its time on them)."""
    return table_summary_row(trace.read(path), path, slo_ms, with_intervals)


def table_summary_row(
    table: pa.Table,
    path: str | os.PathLike[str],
    slo_ms: Mapping[str, float] | None = None,
    with_intervals: bool = True,
) -> dict[str, Any]:
    """`summary_row` of a trace already in memory (as `trace.read` or `trace.write` return it)."""
    cell = metrics.compute(table, slo_ms, source=path)
    metadata = trace.metadata_of(table.schema, path)
    cell_config = metadata.get("cell")
    workload = cell_config.get("workload") if isinstance(cell_config, dict) else None
    workload = workload or metadata.get("workload") or {}
    memory_use = metadata.get("memory") or {}
    identity = cell_identity(table, path)
    return {
        **identity,
        **asdict(cell),
        **{name: workload.get(name) for name in WORKLOAD_COLUMNS},
        "chunked_prefill": chunked_prefill(cell_config, identity["backend"]),
        **{name: memory_use.get(name) for name in MEMORY_COLUMNS},
        **preemption_summary(table),
        **prefixstats.summary_columns(metadata.get("prefix_cache") or {}),
        **turn_summary(table, workload),
        **steady_summary(table, workload),
        **dict.fromkeys(intervals.INTERVAL_COLUMNS),
        **(
            intervals.bootstrap_columns(metrics.latencies_of(_served(table)))
            if with_intervals
            else {}
        ),
        "repeats": 1,
        "trace": os.fspath(path),
    }


def chunked_prefill(cell_config: Any, backend: str) -> bool | None:
    """Whether the cell's servers chunked prefills (see `SERVING_COLUMNS`); None when unknown."""
    if not backend_of(backend).SETS_FLAGS or not isinstance(cell_config, dict):
        return None
    try:
        recipe, mode = cell_config["recipe"], cell_config["mode"]
        max_model_len = cell_config["serving"]["max_model_len"]
        return matrix.chunks_prefill(recipe, mode["chunked_prefill"], max_model_len)
    except (KeyError, TypeError):
        return None


def _served(table: pa.Table) -> pl.DataFrame:
    """The measured, successful requests (those `metrics.compute` takes latencies of)."""
    frame = pl.from_arrow(table.select(list(metrics.REQUIRED_COLUMNS)))
    return frame.filter(~pl.col("warmup") & pl.col("success")).sort("request_id")


def turn_summary(table: pa.Table, workload: Mapping[str, Any]) -> dict[str, Any]:
    """The `TURN_COLUMNS` of one trace: turns by request id from the workload's session plan
    (measured requests are numbered warm-ups first, then turn-major)."""
    summary: dict[str, Any] = dict.fromkeys(TURN_COLUMNS)
    if not workload.get("sessions"):
        return summary
    turns = sessions.plan(
        sessions.Sessions(**workload["sessions"]),
        workload["input_len"],
        workload["output_len"],
        workload.get("range_ratio", 0.0),
        workload["seed"],
    )
    served = _served(table).filter(pl.col("first_token_s").is_not_null())
    first = workload.get("warmup_requests", 0)
    ttft = {"ttft_turn1_mean_ms": [], "ttft_later_turns_mean_ms": []}
    for request_id, sent, first_token in served.select(
        ["request_id", "sent_s", "first_token_s"]
    ).iter_rows():
        later = turns[request_id - first].turn > 1
        ttft["ttft_later_turns_mean_ms" if later else "ttft_turn1_mean_ms"].append(
            (first_token - sent) * 1e3
        )
    summary.update({name: float(np.mean(v)) if v else None for name, v in ttft.items()})
    return summary


def preemption_summary(table: pa.Table) -> dict[str, Any]:
    """The `PREEMPTION_COLUMNS` of one trace (all null when no measured request has a count)."""
    frame = pl.from_arrow(
        table.select(["warmup", "success", "sent_s", "end_s", "preemptions"])
    ).filter(~pl.col("warmup") & pl.col("preemptions").is_not_null())
    summary: dict[str, Any] = dict.fromkeys(PREEMPTION_COLUMNS)
    if frame.is_empty():
        return summary
    counts = frame["preemptions"]
    summary["preemptions_total"] = int(counts.sum())
    summary["preempted_requests"] = int((counts > 0).sum())
    served = frame.filter(pl.col("success") & pl.col("end_s").is_not_null())
    if served.is_empty():
        return summary
    e2el_ms = ((served["end_s"] - served["sent_s"]) * 1e3).to_numpy()
    preempted = (served["preemptions"] > 0).to_numpy()
    slowest = max(1, math.ceil(SLOWEST_FRACTION * len(e2el_ms)))
    # Stable: among equal latencies the earlier request counts as the slower one.
    order = np.argsort(-e2el_ms, kind="stable")[:slowest]
    summary["slowest_preempted_share"] = float(preempted[order].mean())
    if preempted.any():
        summary["preempted_median_e2el_ms"] = float(np.median(e2el_ms[preempted]))
    if not preempted.all():
        summary["unpreempted_median_e2el_ms"] = float(np.median(e2el_ms[~preempted]))
    return summary


def cell_identity(table: pa.Table, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The identity columns' single value; a trace holding several cells is malformed."""
    identity = {}
    for name in trace.IDENTITY_COLUMNS:
        values = table.column(name).unique().to_pylist()
        if len(values) != 1:
            raise trace.TraceError(
                path, name, f"has {len(values)} distinct values; a trace holds exactly one cell"
            )
        identity[name] = values[0]
    return identity


def write_summary(
    df: pl.DataFrame,
    parquet_path: str | os.PathLike[str],
    csv_path: str | os.PathLike[str],
    html_path: str | os.PathLike[str],
    title: str,
    columns: Sequence[tuple[str, str]] = HTML_COLUMNS,
) -> None:
    """Write the summary three ways; each target appears complete or not at all.

    Everything is written to temporary files first and renamed only when all three succeeded.
    ``columns`` are the HTML table's (column, header) pairs.
    """
    page = render_html(df, title, columns)
    rounded = df.with_columns(pl.selectors.float().round(CSV_DECIMALS))
    _write_all(
        [
            (Path(parquet_path), df.write_parquet),
            (Path(csv_path), rounded.write_csv),
            (Path(html_path), lambda tmp: tmp.write_text(page, encoding="utf-8")),
        ]
    )


def render_html(
    df: pl.DataFrame, title: str, columns: Sequence[tuple[str, str]] = HTML_COLUMNS
) -> str:
    """A self-contained page (no external CSS or JS) with the key columns of the summary (the
    prefix-reuse ones and chunked prefill only where some cell has them)."""
    columns = [
        (name, header)
        for name, header in columns
        if name in df.columns
        and not (name in (*PREFIX_COLUMNS, *SERVING_COLUMNS) and df[name].null_count() == df.height)
    ]
    head = "".join(f"<th>{html.escape(header)}</th>" for _, header in columns)
    body = "\n".join(
        "<tr>" + "".join(_html_cell(row[name]) for name, _ in columns) + "</tr>"
        for row in df.select([name for name, _ in columns]).iter_rows(named=True)
    )
    escaped = html.escape(title)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escaped}</title>\n<style>{HTML_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{escaped}</h1>\n<table>\n<thead><tr>{head}</tr></thead>\n"
        f"<tbody>\n{body}\n</tbody>\n</table>\n</body>\n</html>\n"
    )


def _html_cell(value: Any) -> str:
    if value is None:
        return "<td></td>"
    if isinstance(value, bool):
        return f"<td>{'on' if value else 'off'}</td>"
    if isinstance(value, float):
        return f'<td class="num">{value:.2f}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def _write_all(targets: Sequence[tuple[Path, Callable[[Path], object]]]) -> None:
    """Write every target to its temporary sibling; rename them into place only if all succeeded.

    Leaving the stack on an exception skips every rename and removes every temporary file.
    """
    with contextlib.ExitStack() as stack:
        for target, write in targets:
            write(stack.enter_context(atomic_path(target)))


def check_one_row_per_point(summary: pl.DataFrame, x: str) -> None:
    """Raise ValueError if a (model, mode, x) point has several rows: a line needs one per x."""
    duplicated = summary.filter(pl.struct("model", "mode", x).is_duplicated())
    if not duplicated.is_empty():
        first = duplicated.row(0, named=True)
        raise ValueError(
            f"study summary has several rows for model {first['model']!r}, mode "
            f"{first['mode']!r}, {x}={first[x]}: one row per configuration and x is needed"
        )
