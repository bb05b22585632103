"""Study figures: TTFT, TPOT, ITL, throughput and memory against the study's x axis.

Each figure is a grid of panels: one column per statistic (mean, median, P99) or throughput
measure, and one row per model when a study varies both the model and the serving mode (the
Mooncake studies); otherwise a single row with one line per mode or per model, whichever varies.
The memory figure shows the summary's peak GPU memory and peak KV-cache usage
(``servematrix.deploy.memory``: measured on vllm, modelled on the emulator and the simulator); a
cell without them (null) has no point. When the summary says which points reached steady state
(``steady``), an overloaded point (queue growing: its latency depends on how long the run was) is
a hollow diamond with a legend entry saying so (``overload_points``). Every figure is written
twice: as SVG (static, for the report) and as interactive HTML with the Vega libraries inlined,
so both render without network access.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from servematrix.common.files import cache_root, write_text
from servematrix.reporting.findings.common import OVERLOADED_NOTE, overloaded
from servematrix.results.aggregate import check_one_row_per_point
from servematrix.spec.matrix import MODES

X_AXES = {
    "qps": "Offered load (requests/s)",
    "input_len": "Input length (tokens)",
}
LATENCY_FAMILIES = {
    "ttft": "Time to first token (TTFT)",
    "tpot": "Time per output token (TPOT)",
    "itl": "Inter-token latency (ITL)",
}
STATISTICS = {"mean": "Mean", "median": "Median", "p99": "P99"}
PANEL_WIDTH = 260
PANEL_HEIGHT = 200
LOG_X_RATIO = 8.0
LOG_Y_RATIO = 50.0
SCHEME = "tableau10"
"""Ten distinguishable categorical colours (Vega's default has ten too, but say so)."""
NUMBER = ",.3~r"
"""Tooltip numbers: three significant figures, never in scientific notation."""


@dataclass(frozen=True)
class Panel:
    """One subplot: which summary column goes on y, and how it is labelled."""

    column: str
    title: str
    y_title: str


@dataclass(frozen=True)
class Layout:
    """Which identity column gives the lines and which (if any) the rows of panels."""

    series: str
    rows: str | None


def latency_panels(family: str) -> list[Panel]:
    name = family.upper()
    return [
        Panel(f"{stat}_{family}_ms", f"{label} {name}", f"{label} {name} (ms)")
        for stat, label in STATISTICS.items()
    ]


THROUGHPUT_PANELS = [
    Panel("output_throughput", "Output token throughput", "Output tokens/s"),
    Panel("request_throughput", "Request throughput", "Completed requests/s"),
    Panel("request_goodput", "Goodput (requests meeting the SLOs)", "Good requests/s"),
]


MEMORY_PANELS = [
    Panel("peak_gpu_memory_mib", "Peak GPU memory (busiest GPU)", "Peak GPU memory (MiB)"),
    Panel(
        "peak_kv_cache_usage",
        "Peak KV-cache usage (busiest instance)",
        "Peak share of KV blocks in use (0-1)",
    ),
]


def choose_layout(summary: pl.DataFrame) -> Layout:
    """Lines per mode when modes vary (rows per model if models vary too), else per model."""
    modes = summary["mode"].n_unique()
    models = summary["model"].n_unique()
    if modes > 1:
        return Layout(series="mode", rows="model" if models > 1 else None)
    return Layout(series="model", rows=None)


def _check(summary: pl.DataFrame, x: str, columns: list[str]) -> None:
    if x not in X_AXES:
        raise ValueError(f"x must be one of {sorted(X_AXES)}, got {x!r}")
    missing = [c for c in ["model", "mode", x, *columns] if c not in summary.columns]
    if missing:
        raise ValueError(f"study summary lacks column(s): {', '.join(missing)}")
    if summary.is_empty():
        raise ValueError("study summary has no rows")
    check_one_row_per_point(summary, x)


def series_order(summary: pl.DataFrame, column: str) -> list[str]:
    """Modes in their canonical order (aggregated first), models as the summary lists them."""
    values = summary[column].unique(maintain_order=True).to_list()
    if column == "mode":
        canonical = list(MODES)
        return sorted(
            values, key=lambda v: (canonical.index(v) if v in canonical else len(MODES), v)
        )
    return values


def use_log_x(x_values: list[float]) -> bool:
    """A log x axis when the values span LOG_X_RATIO or more (QPS 2…64): low loads stay legible."""
    return len(x_values) > 2 and x_values[0] > 0 and x_values[-1] / x_values[0] >= LOG_X_RATIO


def use_log_y(values: list[float]) -> bool:
    """A log y axis when one panel's lines differ by LOG_Y_RATIO or more.

    A saturated configuration (seconds of TTFT) otherwise flattens every healthy one (tens of
    ms) onto the zero line, and the comparison the figure exists for disappears. Only when every
    value is positive: a zero (TPOT of one-token requests) has no place on a log axis.
    """
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if len(finite) < 2 or min(finite) <= 0:
        return False
    return max(finite) / min(finite) >= LOG_Y_RATIO


def panel_axes(data: pl.DataFrame, panel: Panel, x: str) -> tuple[alt.X, alt.Y]:
    """The x axis (the study's x values as ticks, log when they span a decade or more) and the
    y axis (log when the panel's lines differ by LOG_Y_RATIO or more) of one panel."""
    x_values = sorted(data[x].unique().to_list())
    log_x = use_log_x(x_values)
    log_y = use_log_y(data[panel.column].to_list())
    x_axis = alt.X(
        f"{x}:Q",
        title=X_AXES[x] + (" — log scale" if log_x else ""),
        scale=alt.Scale(type="log" if log_x else "linear", zero=False, nice=False, padding=10),
        axis=alt.Axis(values=x_values, format="~f"),
    )
    y_axis = alt.Y(
        f"{panel.column}:Q",
        title=panel.y_title + (" — log scale" if log_y else ""),
        scale=alt.Scale(type="log") if log_y else alt.Scale(zero=True),
    )
    return x_axis, y_axis


def line_panel(
    data: pl.DataFrame,
    panel: Panel,
    x: str,
    color: alt.Color,
    tooltip: list[alt.Tooltip],
    stroke_dash: alt.StrokeDash | None = None,
) -> alt.Chart:
    """One panel: the panel's metric against the study's x (`panel_axes`), a line per series
    (``color``, and ``stroke_dash`` if given); the tooltip adds x and the metric to
    ``tooltip``."""
    x_axis, y_axis = panel_axes(data, panel, x)
    dash = {} if stroke_dash is None else {"strokeDash": stroke_dash}
    encoding = {
        "x": x_axis,
        "y": y_axis,
        "color": color,
        **dash,
        "tooltip": [
            *tooltip,
            alt.Tooltip(f"{x}:Q", title=X_AXES[x]),
            alt.Tooltip(f"{panel.column}:Q", title=panel.y_title, format=",.2f"),
        ],
    }
    base = alt.Chart(data, title=panel.title, width=PANEL_WIDTH, height=PANEL_HEIGHT)
    if "overloaded" not in data.columns:
        return base.mark_line(point=True).encode(**encoding)
    line = base.mark_line().encode(**encoding)
    return alt.layer(line, *overload_points(base, encoding, bool(data["overloaded"].any())))


def overload_points(base: alt.Chart, encoding: dict[str, Any], marked: bool) -> list[alt.Chart]:
    """A line chart's points (the data's boolean ``overloaded`` column): steady ones filled;
    with ``marked``, overloaded ones as hollow diamonds whose legend entry says what they mean
    (OVERLOADED_NOTE)."""
    steady = base.mark_point(filled=True, opacity=1)
    if not marked:
        return [steady.encode(**encoding)]
    shape = alt.Shape(
        "load:N",
        title=None,
        scale=alt.Scale(domain=[OVERLOADED_NOTE], range=["diamond"]),
        legend=alt.Legend(labelLimit=0, symbolFillColor="white", symbolStrokeColor="black"),
    )
    hollow = (
        base.transform_filter("datum.overloaded")
        .transform_calculate(load=f"'{OVERLOADED_NOTE}'")
        .mark_point(filled=False, size=90, strokeWidth=2, opacity=1)
        .encode(shape=shape, **encoding)
    )
    return [steady.transform_filter("!datum.overloaded").encode(**encoding), hollow]


def finite_points(data: pl.DataFrame, panels: list[Panel]) -> pl.DataFrame:
    """``data`` with NaN and infinity (a cell without successful requests) as null in the
    panels' columns: they cannot go into the JSON spec, and such a cell has no point."""
    return data.with_columns(
        pl.when(pl.col(p.column).cast(pl.Float64).is_finite())
        .then(pl.col(p.column))
        .alias(p.column)
        for p in panels
    )


def chart_spec(chart: alt.TopLevelMixin) -> dict[str, Any]:
    """``chart``'s Vega-Lite spec as ``Chart.save`` writes it: every row inlined into its
    ``datasets``, none in a side file. Not validated against the schema here (a third of the
    cost); the tests validate every figure's spec."""
    with alt.data_transformers.enable("default"), alt.data_transformers.disable_max_rows():
        return chart.to_dict(validate=False, context={"pre_transform": False})


Row = tuple["alt.Title | str", list[alt.TopLevelMixin]]
"""A row of panels under its title."""


def figure_grid(rows: list[Row], title: str, shared: list[str]) -> dict[str, Any]:
    """The Vega-Lite spec of rows of panels under one title; the ``shared`` encodings (a
    legend each) are shared by every panel, each panel keeps its own y scale.

    Composed as dicts from each panel's spec, as Altair composes it (a row's data lifted to
    the row when its panels share it): Altair's concat charts deep-copy every subchart at
    each level and for each method applied, about a second a figure."""
    datasets: dict[str, Any] = {}
    theme: dict[str, Any] = {}

    def part(chart: alt.TopLevelMixin) -> dict[str, Any]:
        spec = chart_spec(chart)
        datasets.update(spec.pop("datasets", {}))
        theme.update(spec.pop("config", {}))
        spec.pop("$schema", None)
        return spec

    grid = [
        _lift_data({"hconcat": [part(c) for c in charts], "title": _title_spec(row_title)})
        for row_title, charts in rows
    ]
    config = {
        **theme,
        "axis": {"labelFontSize": 11, "titleFontSize": 12},
        "legend": {"labelFontSize": 12, "labelLimit": 0, "orient": "right", "titleFontSize": 12},
        "title": {"fontSize": 13},
    }
    spec = _lift_data(
        {
            "config": config,
            "vconcat": grid,
            "resolve": {"scale": {**dict.fromkeys(shared, "shared"), "y": "independent"}},
            "title": {"text": title, "anchor": "start", "fontSize": 16},
        }
    )
    return {**spec, "$schema": alt.SCHEMA_URL, "datasets": datasets}


def _lift_data(concat: dict[str, Any]) -> dict[str, Any]:
    """``concat`` with its parts' data moved up to it when they all share one, right after
    its parts (the keys in the order Altair writes them: the HTML page has the spec's text)."""
    key = "hconcat" if "hconcat" in concat else "vconcat"
    parts = concat[key]
    if not parts or not all("data" in p and p["data"] == parts[0]["data"] for p in parts):
        return concat
    data = parts[0]["data"]
    for p in parts:
        del p["data"]
    lifted = {}
    for name, value in concat.items():
        lifted[name] = value
        if name == key:
            lifted["data"] = data
    return lifted


def _title_spec(title: alt.Title | str) -> dict[str, Any] | str:
    return title.to_dict(validate=False) if isinstance(title, alt.Title) else title


def _panel_chart(
    data: pl.DataFrame, panel: Panel, x: str, layout: Layout, order: list[str]
) -> alt.Chart:
    legend = alt.Legend(title=layout.series.capitalize(), symbolType="stroke", symbolStrokeWidth=3)
    tooltip = [
        alt.Tooltip(f"{layout.series}:N"),
        *([alt.Tooltip(f"{layout.rows}:N")] if layout.rows else []),
    ]
    color = alt.Color(
        f"{layout.series}:N", sort=order, legend=legend, scale=alt.Scale(scheme=SCHEME)
    )
    return line_panel(data, panel, x, color, tooltip)


def build_figure(summary: pl.DataFrame, title: str, x: str, panels: list[Panel]) -> dict[str, Any]:
    """The grid of panels for one figure: rows per facet value, columns per panel."""
    _check(summary, x, [p.column for p in panels])
    layout = choose_layout(summary)
    columns = sorted({"model", "mode", x, *(p.column for p in panels)})
    data = finite_points(summary.select(columns), panels)
    if "steady" in summary.columns:  # overloaded points drawn apart (overload_points)
        data = data.with_columns(overloaded(summary))
    order = series_order(data, layout.series)
    facets = series_order(data, layout.rows) if layout.rows else [None]
    rows = []
    for facet in facets:
        part = data if facet is None else data.filter(pl.col(layout.rows) == facet)
        charts = [_panel_chart(part, p, x, layout, order) for p in panels]
        row_title = (
            alt.Title(f"Model: {facet}", fontSize=14, anchor="start") if facet is not None else ""
        )
        rows.append((row_title, charts))
    return figure_grid(rows, title, ["color", "shape"])


@functools.cache
def vega_bundle() -> str:
    """vega-embed with Vega and Vega-Lite, as Altair inlines it (no network at view time).

    vl-convert takes ~1.6 s to assemble it in each new process (a figure job), the same text
    every time for one vl-convert and Vega-Lite version: it is kept in the cache, per version.
    """
    from altair.utils._importers import import_vl_convert, vl_version_for_vl_convert

    converter, vl_version = import_vl_convert(), vl_version_for_vl_convert()
    path = cache_root() / "vega" / f"vega-embed-{vl_version}-vl-convert-{converter.__version__}.js"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    bundle = converter.javascript_bundle(vl_version=vl_version)
    write_text(path, bundle)
    return bundle


def offline_html(spec: dict[str, Any]) -> str:
    """The page ``Chart.save(format="html", inline=True)`` writes for ``spec`` (Altair's inline
    template), with the Vega bundle from `vega_bundle` instead of vl-convert on every chart."""
    from altair.utils.html import INLINE_HTML_TEMPLATE

    return INLINE_HTML_TEMPLATE.render(
        spec=json.dumps(spec),
        embed_options=json.dumps({"mode": "vega-lite"}),
        output_div="vis",
        vegalite_version=alt.VEGALITE_VERSION,
        vegaembed_script=vega_bundle(),
    )


def save_figure(chart: alt.TopLevelMixin | dict[str, Any], stem: Path) -> list[Path]:
    """``stem``.svg and ``stem``.html, both usable offline: the files ``Chart.save`` writes,
    from one spec (``Chart.save`` builds it again for each file); ``chart`` is a chart or its
    Vega-Lite spec (`figure_grid`)."""
    from altair.utils.mimebundle import spec_to_mimebundle

    spec = chart if isinstance(chart, dict) else chart_spec(chart)
    svg = spec_to_mimebundle(
        spec, format="svg", mode="vega-lite", vegalite_version=alt.VEGALITE_VERSION
    )
    paths = [stem.with_suffix(".svg"), stem.with_suffix(".html")]
    write_text(paths[0], svg["image/svg+xml"])
    write_text(paths[1], offline_html(spec))
    return paths


def study_figures(summary: pl.DataFrame, title: str, x: str) -> dict[str, dict[str, Any]]:
    """Figure name → Vega-Lite spec, for every figure of one study."""
    figures = {
        family: build_figure(summary, f"{label} — {title}", x, latency_panels(family))
        for family, label in LATENCY_FAMILIES.items()
    }
    figures["throughput"] = build_figure(summary, f"Throughput — {title}", x, THROUGHPUT_PANELS)
    figures["memory"] = build_figure(summary, f"Memory — {title}", x, MEMORY_PANELS)
    return figures


TableSource = pl.DataFrame | str | os.PathLike[str]
"""A table in memory, or the path of its Parquet file (as a workflow job is given it)."""


def frame(table: TableSource) -> pl.DataFrame:
    return table if isinstance(table, pl.DataFrame) else pl.read_parquet(table)


def write_study_figures(summary: TableSource, title: str, x: str, out_dir: Path) -> list[Path]:
    """Write ``{ttft,tpot,itl,throughput,memory}.{svg,html}`` for one study; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, chart in study_figures(frame(summary), title, x).items():
        written += save_figure(chart, out_dir / name)
    return written
