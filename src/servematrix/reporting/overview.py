"""The report's front page: every study's recommendation table, its capacity chart and its
Pareto chart, each with a caption, in one self-contained HTML page (Vega inlined once, every
chart rendered by the browser as SVG), plus each chart as SVG and HTML for the report.

Capacity chart: capacity per GPU of every configuration at the SLO, with its interval.
Pareto chart: output tokens/s per GPU (what the operator pays for) against output tokens/s
per user (1000 / mean TPOT: what a user sees), one curve per configuration across the study's
loads; the upper right is better, and a configuration below another's curve is dominated.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import altair as alt
import polars as pl

from servematrix.common.files import write_text
from servematrix.reporting.figures import (
    NUMBER,
    SCHEME,
    TableSource,
    frame,
    overload_points,
    save_figure,
    vega_bundle,
)
from servematrix.reporting.findings.common import Section, overloaded
from servematrix.reporting.findings.recommend import SLO_EXAMPLE, config_names, study_question
from servematrix.reporting.findings.render import html_table, recommendation_of

CAPACITY_CAPTION = (
    "Capacity per GPU at the SLO: the highest request rate each configuration serves within "
    "every bound, divided by the GPUs it occupies; the bar is the search's answer, the whisker "
    "its interval (95 % over repeats, or the search's bracket for one seed)."
)
PARETO_CAPTION = (
    "Throughput against interactivity: output tokens/s per GPU against output tokens/s per "
    "user (1000 / mean TPOT), one curve per configuration across the study's loads. Up and to "
    "the right is better; a curve below and left of another is dominated."
)


def _named(capacity: pl.DataFrame, question: str | None = None) -> pl.DataFrame:
    """The capacity table with a configuration name (only the mode within a model's panel when
    the study compares modes) and per-GPU interval ends."""
    names = config_names(capacity)
    if question == "modes":
        names = capacity["mode"].cast(pl.String).to_list()
    named = capacity.with_columns(pl.Series("configuration", names, dtype=pl.String))
    return named.with_columns(
        (pl.col("capacity_lo") / pl.col("gpus")).alias("lo_per_gpu"),
        (pl.col("capacity_hi") / pl.col("gpus")).alias("hi_per_gpu"),
        pl.col("input_len").cast(pl.String).alias("input"),
    )


def _per_model(data: pl.DataFrame, question: str | None) -> list[tuple[str, pl.DataFrame]]:
    """One panel per model when the study compares modes (a 7B and a 72B are never on one
    axis), else one panel."""
    if question == "modes" and data["model"].n_unique() > 1:
        return [
            (m, data.filter(pl.col("model") == m))
            for m in data["model"].unique(maintain_order=True)
        ]
    return [("", data)]


def _capacity_panel(data: pl.DataFrame, label: str, unit: str) -> alt.LayerChart:
    order = (
        data.sort("capacity_per_gpu", descending=True)["configuration"]
        .unique(maintain_order=True)
        .to_list()
    )
    y = alt.Y("configuration:N", sort=order, title=label or None, axis=alt.Axis(labelLimit=0))
    base = alt.Chart(data, width=300)
    bars = base.mark_bar().encode(
        x=alt.X("capacity_per_gpu:Q", title=f"capacity per GPU ({unit})"),
        y=y,
        yOffset="input:N",
        color=alt.Color("input:N", title="input tokens", scale=alt.Scale(scheme=SCHEME)),
        tooltip=[
            "configuration",
            "input",
            alt.Tooltip("capacity_per_gpu:Q", format=NUMBER),
            "breaks_first",
        ],
    )
    whiskers = base.mark_rule(color="black").encode(
        x="lo_per_gpu:Q", x2="hi_per_gpu:Q", y=y, yOffset="input:N"
    )
    return alt.layer(bars, whiskers)


def capacity_chart(
    capacity: pl.DataFrame, title: str, question: str | None = None
) -> alt.TopLevelMixin:
    """Bars of capacity per GPU, whiskers for the interval, one row per configuration; a panel
    per model (its own axis) when the study compares modes."""
    data = _named(capacity, question).select(
        "model",
        "configuration",
        "input",
        "capacity_per_gpu",
        "lo_per_gpu",
        "hi_per_gpu",
        "breaks_first",
    )
    unit = capacity["capacity_unit"][0]
    panels = [_capacity_panel(part, label, unit) for label, part in _per_model(data, question)]
    heading = alt.Title("Capacity per GPU at the SLO", subtitle=title)
    if len(panels) == 1:
        return panels[0].properties(title=heading)
    return alt.vconcat(*panels, title=heading).resolve_scale(x="independent")


def pareto_frame(
    summary: pl.DataFrame, capacity: pl.DataFrame, question: str | None = None
) -> pl.DataFrame:
    """The summary's points with the deployment's GPUs and the two Pareto axes."""
    gpus = _named(capacity, question).select("model", "mode", "input_len", "gpus", "configuration")
    joined = summary.join(gpus, on=["model", "mode", "input_len"], how="inner")
    return joined.filter(pl.col("mean_tpot_ms") > 0).with_columns(
        (1000 / pl.col("mean_tpot_ms")).alias("tokens_per_s_per_user"),
        (pl.col("output_throughput") / pl.col("gpus")).alias("tokens_per_s_per_gpu"),
        pl.col("input_len").cast(pl.String).alias("input"),
        overloaded(joined.filter(pl.col("mean_tpot_ms") > 0)),
    )


def _pareto_panel(data: pl.DataFrame, label: str, subtitle: str) -> alt.LayerChart:
    base = alt.Chart(data, title=alt.Title(label or "", subtitle=subtitle), width=360, height=260)
    encoding = {
        "x": alt.X("tokens_per_s_per_user:Q", title="output tokens/s per user (1000 / mean TPOT)"),
        "y": alt.Y("tokens_per_s_per_gpu:Q", title="output tokens/s per GPU"),
        "color": alt.Color(
            "configuration:N", scale=alt.Scale(scheme=SCHEME), legend=alt.Legend(labelLimit=0)
        ),
        "detail": "input:N",
        "tooltip": [
            "configuration",
            "input",
            "qps",
            alt.Tooltip("tokens_per_s_per_user:Q", format=NUMBER),
            alt.Tooltip("tokens_per_s_per_gpu:Q", format=NUMBER),
        ],
    }
    line = base.mark_line().encode(order="qps:Q", **encoding)
    points = overload_points(base, encoding, data["overloaded"].any())
    return alt.layer(line, *points)


def pareto_chart(
    summary: pl.DataFrame, capacity: pl.DataFrame, title: str, question: str | None = None
) -> alt.TopLevelMixin:
    """Output tokens/s per GPU against tokens/s per user, one curve per configuration (a
    categorical scheme of ten colours); a panel per model when the study compares modes;
    overloaded points hollow."""
    data = pareto_frame(summary, capacity, question).select(
        "model",
        "configuration",
        "input",
        "qps",
        "tokens_per_s_per_user",
        "tokens_per_s_per_gpu",
        "overloaded",
    )
    heading = "Throughput vs interactivity"
    panels = _per_model(data, question)
    if len(panels) == 1:
        return _pareto_panel(data, heading, title)
    charts = [_pareto_panel(part, label, "") for label, part in panels]
    return alt.hconcat(*charts, title=alt.Title(heading, subtitle=title)).resolve_scale(
        x="independent", y="independent"
    )


def write_answer_figures(
    summary: TableSource,
    capacity: TableSource,
    title: str,
    out_dir: Path,
    question: str | None = None,
) -> list[Path]:
    """``capacity.{svg,html}`` and ``pareto.{svg,html}`` of one study (``question``: the one
    the config names, else derived)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, capacity = frame(summary), frame(capacity)
    question = study_question(capacity, question) if not capacity.is_empty() else question
    return save_figure(capacity_chart(capacity, title, question), out_dir / "capacity") + (
        save_figure(pareto_chart(summary, capacity, title, question), out_dir / "pareto")
    )


@dataclass(frozen=True)
class StudyInputs:
    """What the config says of the front page's studies, in its order: names, titles and the
    questions it names (None: derived from the data)."""

    names: Sequence[str]
    titles: Sequence[str]
    questions: Sequence[str | None]


@dataclass(frozen=True)
class StudyPage:
    """One study on the front page; no charts without a capacity table (no SLO)."""

    name: str
    title: str
    recommendation: Section
    capacity: alt.TopLevelMixin | None
    pareto: alt.TopLevelMixin | None


STYLE = (
    "body{font-family:sans-serif;margin:1.5em}"
    "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}"
    "caption{text-align:left;font-weight:bold;padding:0.3em 0}"
    "th,td{border:1px solid #ccc;padding:0.2em 0.45em;text-align:left}th{background:#f2f2f2}"
    ".charts{display:flex;flex-wrap:wrap;gap:2em;align-items:flex-start}"
    "figure{margin:0;flex:0 0 auto}.chart{display:inline-block}"
    "figcaption{font-size:0.85em;max-width:36em;color:#333}"
    "code{background:#f2f2f2;padding:0.1em 0.3em}"
)


def _study_html(i: int, page: StudyPage) -> tuple[str, list[tuple[str, str]]]:
    charts = [
        (f"{kind}-{i}", chart, caption)
        for kind, chart, caption in (
            ("capacity", page.capacity, CAPACITY_CAPTION),
            ("pareto", page.pareto, PARETO_CAPTION),
        )
        if chart is not None
    ]
    figures = "".join(
        f'<figure><div class="chart" id="{cid}"></div><figcaption>{html.escape(caption)}'
        "</figcaption></figure>"
        for cid, _, caption in charts
    )
    sentences = "".join(f"<li>{_sentence_html(s)}</li>" for s in page.recommendation.sentences)
    tables = "".join(html_table(t) for t in page.recommendation.tables)
    body = (
        f'<section id="{html.escape(page.name)}"><h2>{html.escape(page.title)}</h2>'
        f'<ul>{sentences}</ul>{tables}<div class="charts">{figures}</div></section>'
    )
    return body, [(cid, chart.to_json()) for cid, chart, _ in charts]


def _sentence_html(sentence: str) -> str:
    """A sentence escaped, the config line it may end with (``slo: {...}``) as code."""
    head, found, line = sentence.partition(SLO_EXAMPLE)
    if not found:
        return html.escape(sentence)
    return f"{html.escape(head)}<code>{html.escape(SLO_EXAMPLE)}</code>{html.escape(line)}"


def write_overview(
    studies: StudyInputs,
    summaries: Sequence[TableSource],
    capacities: Sequence[TableSource],
    recommendations: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
) -> None:
    """The front page of these studies (per study: its summary, capacity table and the
    recommendation its findings job wrote). Without capacity tables (no SLO) every study shows
    what its findings say instead: that no SLO is set, and the line to add."""
    pages = []
    tables = list(capacities) or [None] * len(studies.names)
    for name, title, question, summary, capacity, recommendation in zip(
        studies.names,
        studies.titles,
        studies.questions,
        summaries,
        tables,
        recommendations,
        strict=True,
    ):
        table = None if capacity is None else frame(capacity)
        if table is not None and not table.is_empty():
            question = study_question(table, question)
        charts = (
            (None, None)
            if table is None
            else (
                capacity_chart(table, title, question),
                pareto_chart(frame(summary), table, title, question),
            )
        )
        pages.append(StudyPage(name, title, recommendation_of(recommendation), *charts))
    heading = "servematrix: what to run at the SLO" if capacities else "servematrix: no SLO set"
    write_text(output, overview_html(pages, heading))


def overview_html(pages: Sequence[StudyPage], heading: str) -> str:
    """The whole front page; the browser renders every chart (``renderer: svg``)."""
    sections, specs = [], []
    for i, page in enumerate(pages):
        body, charts = _study_html(i, page)
        sections.append(body)
        specs += charts
    calls = "\n".join(
        f"vegaEmbed('#{cid}', {spec}, {{renderer: 'svg', actions: false}}).catch(console.error);"
        for cid, spec in specs
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(heading)}</title>\n<style>{STYLE}</style>\n"
        f'<script type="text/javascript">{vega_bundle()}</script>\n</head>\n<body>\n'
        f"<h1>{html.escape(heading)}</h1>\n" + "\n".join(sections) + "\n"
        f'<script type="text/javascript">\n{calls}\n</script>\n</body>\n</html>\n'
    )
