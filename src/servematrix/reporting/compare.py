"""The simulator's predictions against a measured backend (a run on ``emulator``, ``vllm`` or
``external``, which simulates the same cells too: ``servematrix.workflow.predicted_config``):
figures with one line per backend for the same metric against the study's x, and a table of
simulator / measured per metric and cell, with the share of cells inside the 0.77–1.3× band the
manual's fidelity figures (docs/simulator.md) use. (Where the step times came
from: `servematrix.reporting.steptimes`.)
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from servematrix.common.files import atomic_path, write_text
from servematrix.reporting.figures import (
    LATENCY_FAMILIES,
    THROUGHPUT_PANELS,
    X_AXES,
    Panel,
    figure_grid,
    finite_points,
    latency_panels,
    line_panel,
    save_figure,
    series_order,
)
from servematrix.reporting.steptimes import report_page
from servematrix.results.aggregate import CSV_DECIMALS
from servematrix.spec.matrix import PREDICTING_BACKEND

KEYS = ("model", "mode", "qps", "input_len")
"""What identifies a cell within a study (the other identity columns are the study's own)."""
FIDELITY_BAND = (0.77, 1.3)
"""Ratios inside this band count as close (the band of the manual's fidelity figures)."""

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


def measured_cells(predicted: pl.DataFrame, measured: pl.DataFrame) -> pl.DataFrame:
    """The simulator's rows of the cells the measured run has: a study that confirms the
    simulator's top topologies (``confirm_top``) measures only theirs."""
    return predicted.join(measured.select(KEYS), on=KEYS, how="semi")


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
    return report_page(f"Predicted vs measured: {title}", body + "\n".join(sections))


def _band_class(ratio: float | None) -> str:
    lo, hi = FIDELITY_BAND
    return " class=out" if ratio is not None and not lo <= ratio <= hi else ""


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
) -> dict[str, Any]:
    """One row of panels per configuration (model, mode), one panel per metric, and in each
    panel one line per backend: measured solid, predicted dashed."""
    if x not in X_AXES:
        raise ValueError(f"x must be one of {sorted(X_AXES)}, got {x!r}")
    _check_cells(predicted, measured)
    names = _source_names(measured["backend"][0])
    columns = sorted({*KEYS, *(p.column for p in panels)})
    sources = pl.concat(
        [
            summary.select(columns).with_columns(pl.lit(name).alias("source"))
            for summary, name in ((measured, names[0]), (predicted, names[1]))
        ]
    )
    data = finite_points(sources, panels)
    configurations = _configurations(data)
    models, modes = data["model"].n_unique(), data["mode"].n_unique()
    rows = []
    for model, mode in configurations:
        part = data.filter((pl.col("model") == model) & (pl.col("mode") == mode))
        charts = [_panel(part, panel, x, names) for panel in panels]
        row_title = _row_title(model, mode, models, modes) if len(configurations) > 1 else ""
        rows.append((alt.Title(row_title, fontSize=14, anchor="start"), charts))
    return figure_grid(rows, title, ["color", "strokeDash"])


def _panel(data: pl.DataFrame, panel: Panel, x: str, names: list[str]) -> alt.Chart:
    """Measured solid, predicted dashed, one legend for both."""
    legend = alt.Legend(title="Backend", symbolType="stroke", symbolStrokeWidth=3)
    color = alt.Color(
        "source:N", scale=alt.Scale(domain=names, range=["#1f77b4", "#ff7f0e"]), legend=legend
    )
    dash = alt.StrokeDash(
        "source:N", scale=alt.Scale(domain=names, range=[[1, 0], [6, 3]]), legend=legend
    )
    tooltip = [
        alt.Tooltip("source:N", title="Backend"),
        alt.Tooltip("model:N"),
        alt.Tooltip("mode:N"),
    ]
    return line_panel(data, panel, x, color, tooltip, dash)


def comparison_figures(
    predicted: pl.DataFrame, measured: pl.DataFrame, title: str, x: str
) -> dict[str, dict[str, Any]]:
    """Figure name → Vega-Lite spec: TTFT, TPOT, ITL (mean, P99) and throughput, both backends."""
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
