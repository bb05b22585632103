"""The simulator's predictions, judged: where their step times came from, and how they compare
with a measured backend.

Two report items per study:

* **Step-time sources** (every run that simulates the study): per model setup, whether
  aiconfigurator-core's measured vLLM tables or the roofline model gave the step times, and why
  the roofline stood in (``step_time_fallback`` in each simulator trace's engine parameters). A
  roofline step time is an estimate from datasheet bandwidth and FLOPs; the report says so
  instead of letting it pass for a measured one.
* **Predicted vs measured** (a run on ``emulator``, ``vllm`` or ``external``, which simulates the
  same cells too: ``servematrix.workflow.predicted_config``): figures with one line per backend
  for the same metric against the study's x, and a table of simulator / measured per metric and
  cell, with the share of cells inside the 0.77–1.3× band the README's fidelity figures use.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import altair as alt
import polars as pl

from servematrix import trace
from servematrix.aggregate import CSV_DECIMALS, HTML_STYLE
from servematrix.figures import (
    LATENCY_FAMILIES,
    PANEL_HEIGHT,
    PANEL_WIDTH,
    THROUGHPUT_PANELS,
    X_AXES,
    Panel,
    latency_panels,
    panel_axes,
    save_figure,
    series_order,
)
from servematrix.files import atomic_path, write_text

PREDICTING_BACKEND = "simulator"
KEYS = ("model", "mode", "qps", "input_len")
"""What identifies a cell within a study (the other identity columns are the study's own)."""
FIDELITY_BAND = (0.77, 1.3)
"""Ratios inside this band count as close (the band of the README's fidelity figures)."""

COMPARED_FIGURES: dict[str, list[Panel]] = {
    **{
        family: [p for p in latency_panels(family) if not p.column.startswith("median_")]
        for family in ("ttft", "tpot", "itl")
    },
    "throughput": [p for p in THROUGHPUT_PANELS if p.column != "request_goodput"],
}
"""Overlaid figures: mean and P99 of each latency, output and request throughput."""
COMPARED = [panel for panels in COMPARED_FIGURES.values() for panel in panels]
RATIO_COLUMNS = ("metric", "label", *KEYS, "simulator", "measured", "ratio")


# Step-time sources ------------------------------------------------------------------------


@dataclass(frozen=True)
class CellStepTimes:
    """Where one simulated cell's step times came from (its trace's engine parameters)."""

    model: str
    mode: str
    qps: float
    input_len: int
    gpu: str
    tensor_parallel: int
    quantization: str
    source: str
    fallback_reason: str | None
    """Why the roofline stood in for aiconfigurator's measured tables; None: measured tables."""


@dataclass(frozen=True)
class SetupStepTimes:
    """The cells of one model setup (model, GPU, TP, quantization) that share a step-time
    source; a setup has one source, whatever the mode or load."""

    model: str
    gpu: str
    tensor_parallel: int
    quantization: str
    source: str
    fallback_reason: str | None
    modes: tuple[str, ...]
    cells: int


def cell_step_times(path: str | os.PathLike[str]) -> CellStepTimes:
    """Read a simulator trace's step-time source; TraceError (naming the file) for a trace of
    another backend, which records none."""
    metadata = trace.read_metadata(path)
    engine = (metadata.get("deployment") or {}).get("engine")
    cell = metadata.get("cell")
    if not isinstance(engine, dict) or "step_time_source" not in engine or cell is None:
        raise trace.TraceError(path, None, "records no step-time source (only simulator traces do)")
    source = str(engine["step_time_source"])
    if "step_time_fallback" in engine:
        fallback = engine["step_time_fallback"]
        reason = fallback["reason"] if fallback else None
    else:  # written before the field existed: its source label is all it says
        reason = source if source.startswith("roofline") else None
    return CellStepTimes(
        model=cell["model"]["name"],
        mode=cell["mode"]["name"],
        qps=float(cell["workload"]["qps"]),
        input_len=int(cell["workload"]["input_len"]),
        gpu=str(engine["gpu"]),
        tensor_parallel=int(engine["tensor_parallel"]),
        quantization=str(engine["quantization"]),
        source=source,
        fallback_reason=reason,
    )


def group_setups(cells: Iterable[CellStepTimes]) -> list[SetupStepTimes]:
    """One row per (model setup, source), in the order the cells list them."""
    groups: dict[tuple, list[CellStepTimes]] = {}
    for cell in cells:
        key = (
            cell.model,
            cell.gpu,
            cell.tensor_parallel,
            cell.quantization,
            cell.source,
            cell.fallback_reason,
        )
        groups.setdefault(key, []).append(cell)
    return [
        SetupStepTimes(
            *key, modes=tuple(dict.fromkeys(c.mode for c in members)), cells=len(members)
        )
        for key, members in groups.items()
    ]


def _setup_name(setup: SetupStepTimes) -> str:
    return f"{setup.model} on {setup.gpu}, TP {setup.tensor_parallel}, {setup.quantization}"


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def step_time_sentences(setups: Sequence[SetupStepTimes]) -> list[str]:
    """Which cells' step times came from the roofline and why, or that none did."""
    total = sum(s.cells for s in setups)
    fallbacks = [s for s in setups if s.fallback_reason is not None]
    if not fallbacks:
        return [
            f"All {_cells(total)} took their step times from aiconfigurator-core's measured vLLM "
            "operator tables; none fell back to the roofline model."
        ]
    estimated = sum(s.cells for s in fallbacks)
    share = f"All {_cells(total)}" if estimated == total else f"{estimated} of {_cells(total)}"
    sentences = [
        f"{share} took their step times from the roofline model (an "
        "estimate from datasheet bandwidth and FLOPs, docs/engine-model.md), not from measured "
        "tables:"
    ]
    sentences += [
        f"{_setup_name(s)} ({_cells(s.cells)}; modes {', '.join(s.modes)}): {s.fallback_reason}."
        for s in fallbacks
    ]
    return sentences


def step_times_markdown(title: str, setups: Sequence[SetupStepTimes]) -> str:
    lines = [f"# Step-time sources: {title}", ""]
    lines += [f"- {sentence}" for sentence in step_time_sentences(setups)]
    lines += ["", "| model | GPU | TP | quantization | modes | cells | step-time source |"]
    lines.append("|---|---|---|---|---|---|---|")
    lines += [
        f"| {s.model} | {s.gpu} | {s.tensor_parallel} | {s.quantization} | "
        f"{', '.join(s.modes)} | {s.cells} | {s.source} |"
        for s in setups
    ]
    return "\n".join(lines) + "\n"


def step_times_html(title: str, setups: Sequence[SetupStepTimes]) -> str:
    """A self-contained page: the sentences, then every setup with its source."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("model", "GPU", "TP", "quantization", "modes", "cells", "step-time source")
    )
    rows = "\n".join(
        f"<tr{' class=out' if s.fallback_reason else ''}>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                s.model,
                s.gpu,
                s.tensor_parallel,
                s.quantization,
                ", ".join(s.modes),
                s.cells,
                s.source,
            )
        )
        + "</tr>"
        for s in setups
    )
    items = "".join(f"<li>{html.escape(s)}</li>" for s in step_time_sentences(setups))
    table = f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>"
    body = f"<ul>{items}</ul>\n{table}"
    return _page(f"Step-time sources: {title}", body)


def write_step_times(
    trace_paths: Iterable[str | os.PathLike[str]],
    title: str,
    markdown_path: str | os.PathLike[str],
    html_path: str | os.PathLike[str],
) -> list[SetupStepTimes]:
    setups = group_setups(cell_step_times(path) for path in trace_paths)
    write_text(markdown_path, step_times_markdown(title, setups))
    write_text(html_path, step_times_html(title, setups))
    return setups


# Predicted vs measured --------------------------------------------------------------------


def _check_cells(predicted: pl.DataFrame, measured: pl.DataFrame) -> None:
    """Both summaries hold the same cells, each once, and each comes from one backend."""
    for name, summary, expected in (
        ("predicted", predicted, PREDICTING_BACKEND),
        ("measured", measured, None),
    ):
        missing = [c for c in ("backend", *KEYS, *(p.column for p in COMPARED)) if c not in summary]
        if missing:
            raise ValueError(f"{name} summary lacks column(s): {', '.join(missing)}")
        backends = summary["backend"].unique().to_list()
        if len(backends) != 1 or (expected is not None and backends != [expected]):
            wanted = expected or "one measured backend"
            raise ValueError(f"{name} summary holds backend(s) {backends}, expected {wanted}")
        if summary.select(KEYS).is_duplicated().any():
            raise ValueError(f"{name} summary has several rows for one cell")
    if measured["backend"][0] == PREDICTING_BACKEND:
        raise ValueError("the measured summary is the simulator's own")
    ours, theirs = (set(s.select(KEYS).iter_rows()) for s in (predicted, measured))
    if ours != theirs:
        only = sorted(ours ^ theirs, key=str)[0]
        side = "simulator" if only in ours else "measured"
        raise ValueError(
            f"the summaries differ in their cells: model {only[0]!r}, mode {only[1]!r}, "
            f"QPS {only[2]:g}, input {only[3]} is only in the {side} one"
        )


def ratio_table(predicted: pl.DataFrame, measured: pl.DataFrame) -> pl.DataFrame:
    """One row per metric and cell: the simulator's value, the measured one and their ratio
    simulator / measured (1: a perfect prediction; above 1 the simulator predicts more, e.g.
    a slower TTFT or a higher throughput). The ratio is null where a value is missing or not
    finite, or the measured one is not positive."""
    _check_cells(predicted, measured)
    columns = [p.column for p in COMPARED]
    joined = predicted.select(*KEYS, *columns).join(
        measured.select(*KEYS, *columns), on=KEYS, suffix="_measured"
    )
    parts = [
        joined.select(
            pl.lit(p.column).alias("metric"),
            pl.lit(p.y_title).alias("label"),
            *KEYS,
            pl.col(p.column).cast(pl.Float64).alias("simulator"),
            pl.col(f"{p.column}_measured").cast(pl.Float64).alias("measured"),
        ).sort("model", "mode", "input_len", "qps", maintain_order=True)
        for p in COMPARED
    ]
    table = pl.concat(parts)
    valid = (
        pl.col("simulator").is_finite() & pl.col("measured").is_finite() & (pl.col("measured") > 0)
    )
    ratio = pl.when(valid).then(pl.col("simulator") / pl.col("measured")).alias("ratio")
    return table.with_columns(ratio).select(RATIO_COLUMNS)


@dataclass(frozen=True)
class RatioSummary:
    """How one metric's predictions compare, over the cells with a ratio."""

    metric: str
    label: str
    cells: int
    geomean_ratio: float | None
    min_ratio: float | None
    max_ratio: float | None
    within_band: int


def summarize_ratios(table: pl.DataFrame) -> list[RatioSummary]:
    lo, hi = FIDELITY_BAND
    out = []
    for metric, label in table.select("metric", "label").unique(maintain_order=True).iter_rows():
        ratios = [
            r for r in table.filter(pl.col("metric") == metric)["ratio"].to_list() if r is not None
        ]
        out.append(
            RatioSummary(
                metric=metric,
                label=label,
                cells=len(ratios),
                geomean_ratio=(
                    math.exp(sum(math.log(r) for r in ratios) / len(ratios))
                    if ratios and min(ratios) > 0
                    else None
                ),
                min_ratio=min(ratios, default=None),
                max_ratio=max(ratios, default=None),
                within_band=sum(lo <= r <= hi for r in ratios),
            )
        )
    return out


def _ratio_text(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _number_text(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:,.2f}"


def ratios_html(table: pl.DataFrame, title: str, measured_backend: str) -> str:
    """A self-contained page: one line per metric (how close, over all cells), then one table
    per metric with every cell; ratios outside the band are marked."""
    lo, hi = FIDELITY_BAND
    summaries = summarize_ratios(table)
    head = (
        "<tr><th>metric</th><th>cells</th><th>geometric mean ratio</th><th>min</th><th>max</th>"
        f"<th>within {lo:g}–{hi:g}×</th></tr>"
    )
    overview = "\n".join(
        f"<tr><td>{html.escape(s.label)}</td><td class=num>{s.cells}</td>"
        f"<td class=num>{_ratio_text(s.geomean_ratio)}</td>"
        f"<td class=num>{_ratio_text(s.min_ratio)}</td>"
        f"<td class=num>{_ratio_text(s.max_ratio)}</td>"
        f"<td class=num>{s.within_band} of {s.cells}</td></tr>"
        for s in summaries
    )
    sections = []
    for s in summaries:
        part = table.filter(pl.col("metric") == s.metric)
        rows = "\n".join(
            f"<tr{_band_class(row['ratio'])}><td>{html.escape(row['model'])}</td>"
            f"<td>{html.escape(row['mode'])}</td><td class=num>{row['qps']:g}</td>"
            f"<td class=num>{row['input_len']}</td>"
            f"<td class=num>{_number_text(row['simulator'])}</td>"
            f"<td class=num>{_number_text(row['measured'])}</td>"
            f"<td class=num>{_ratio_text(row['ratio'])}</td></tr>"
            for row in part.iter_rows(named=True)
        )
        sections.append(
            f"<h2>{html.escape(s.label)}</h2>\n<table>\n<thead><tr><th>model</th><th>mode</th>"
            "<th>QPS</th><th>input len</th><th>simulator</th>"
            f"<th>{html.escape(measured_backend)}</th><th>ratio</th></tr></thead>\n"
            f"<tbody>\n{rows}\n</tbody>\n</table>"
        )
    intro = (
        f"<p>Ratio = simulator / {html.escape(measured_backend)} per cell: 1 is a perfect "
        "prediction, above 1 the simulator predicts more (a slower latency, a higher "
        f"throughput). Marked: outside {lo:g}–{hi:g}×.</p>"
    )
    body = f"{intro}\n<table>\n<thead>{head}</thead>\n<tbody>\n{overview}\n</tbody>\n</table>\n"
    return _page(f"Predicted vs measured: {title}", body + "\n".join(sections))


def _band_class(ratio: float | None) -> str:
    lo, hi = FIDELITY_BAND
    return " class=out" if ratio is not None and not lo <= ratio <= hi else ""


def _page(title: str, body: str) -> str:
    escaped = html.escape(title)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escaped}</title>\n<style>{HTML_STYLE}tr.out td{{background:#fde2e1}}"
        f"h2{{margin-top:1.5em}}</style>\n</head>\n<body>\n<h1>{escaped}</h1>\n{body}\n"
        "</body>\n</html>\n"
    )


def _source_names(measured_backend: str) -> list[str]:
    return [f"{measured_backend} (measured)", f"{PREDICTING_BACKEND} (predicted)"]


def _configurations(data: pl.DataFrame) -> list[tuple[str, str]]:
    """(model, mode) pairs: models as the summary lists them, modes in canonical order."""
    modes = series_order(data, "mode")
    pairs = set(data.select("model", "mode").iter_rows())
    return [
        (model, mode)
        for model in series_order(data, "model")
        for mode in modes
        if (model, mode) in pairs
    ]


def _row_title(model: str, mode: str, models: int, modes: int) -> str:
    if models > 1 and modes > 1:
        return f"{model} · {mode}"
    return model if models > 1 else mode


def comparison_figure(
    predicted: pl.DataFrame, measured: pl.DataFrame, title: str, x: str, panels: list[Panel]
) -> alt.VConcatChart:
    """One row of panels per configuration (model, mode), one panel per metric, and in each
    panel one line per backend: measured solid, predicted dashed."""
    if x not in X_AXES:
        raise ValueError(f"x must be one of {sorted(X_AXES)}, got {x!r}")
    _check_cells(predicted, measured)
    names = _source_names(measured["backend"][0])
    columns = sorted({*KEYS, *(p.column for p in panels)})
    data = pl.concat(
        [
            summary.select(columns).with_columns(pl.lit(name).alias("source"))
            for summary, name in ((measured, names[0]), (predicted, names[1]))
        ]
    ).with_columns(
        pl.when(pl.col(p.column).cast(pl.Float64).is_finite())
        .then(pl.col(p.column))
        .alias(p.column)
        for p in panels
    )
    configurations = _configurations(data)
    models, modes = data["model"].n_unique(), data["mode"].n_unique()
    rows = []
    for model, mode in configurations:
        part = data.filter((pl.col("model") == model) & (pl.col("mode") == mode))
        charts = [_panel(part, panel, x, names) for panel in panels]
        row_title = _row_title(model, mode, models, modes) if len(configurations) > 1 else ""
        rows.append(alt.hconcat(*charts, title=alt.Title(row_title, fontSize=14, anchor="start")))
    return (
        alt.vconcat(*rows, title=alt.Title(title, fontSize=16, anchor="start"))
        .resolve_scale(color="shared", strokeDash="shared", y="independent")
        .configure_legend(orient="right", labelLimit=0, titleFontSize=12, labelFontSize=12)
        .configure_axis(labelFontSize=11, titleFontSize=12)
        .configure_title(fontSize=13)
    )


def _panel(data: pl.DataFrame, panel: Panel, x: str, names: list[str]) -> alt.Chart:
    x_axis, y_axis = panel_axes(data, panel, x)
    legend = alt.Legend(title="Backend", symbolType="stroke", symbolStrokeWidth=3)
    return (
        alt.Chart(data, title=panel.title, width=PANEL_WIDTH, height=PANEL_HEIGHT)
        .mark_line(point=True)
        .encode(
            x=x_axis,
            y=y_axis,
            color=alt.Color(
                "source:N",
                scale=alt.Scale(domain=names, range=["#1f77b4", "#ff7f0e"]),
                legend=legend,
            ),
            strokeDash=alt.StrokeDash(
                "source:N", scale=alt.Scale(domain=names, range=[[1, 0], [6, 3]]), legend=legend
            ),
            tooltip=[
                alt.Tooltip("source:N", title="Backend"),
                alt.Tooltip("model:N"),
                alt.Tooltip("mode:N"),
                alt.Tooltip(f"{x}:Q", title=X_AXES[x]),
                alt.Tooltip(f"{panel.column}:Q", title=panel.y_title, format=",.2f"),
            ],
        )
    )


def comparison_figures(
    predicted: pl.DataFrame, measured: pl.DataFrame, title: str, x: str
) -> dict[str, alt.VConcatChart]:
    """Figure name → chart: TTFT, TPOT, ITL (mean, P99) and throughput, both backends."""
    names = {**LATENCY_FAMILIES, "throughput": "Throughput"}
    vs = f"predicted vs measured ({measured['backend'][0]})"
    return {
        family: comparison_figure(
            predicted, measured, f"{names[family]}, {vs} — {title}", x, panels
        )
        for family, panels in COMPARED_FIGURES.items()
    }


def write_comparison(
    predicted: pl.DataFrame, measured: pl.DataFrame, title: str, x: str, out_dir: Path
) -> pl.DataFrame:
    """``ratios.{parquet,csv,html}`` and ``{ttft,tpot,itl,throughput}.{svg,html}`` in
    ``out_dir``; returns the ratio table."""
    out_dir = Path(out_dir)
    table = ratio_table(predicted, measured)
    page = ratios_html(table, title, measured["backend"][0])
    with atomic_path(out_dir / "ratios.parquet") as tmp:
        table.write_parquet(tmp)
    with atomic_path(out_dir / "ratios.csv") as tmp:
        table.with_columns(pl.selectors.float().round(CSV_DECIMALS)).write_csv(tmp)
    write_text(out_dir / "ratios.html", page)
    for name, chart in comparison_figures(predicted, measured, title, x).items():
        save_figure(chart, out_dir / name)
    return table
