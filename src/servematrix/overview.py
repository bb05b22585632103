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

from servematrix.figures import TableSource, frame, save_figure, vega_bundle
from servematrix.files import write_text
from servematrix.findings.common import Section
from servematrix.findings.recommend import config_names
from servematrix.findings.render import html_table, recommendation_of

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


def _named(capacity: pl.DataFrame) -> pl.DataFrame:
    named = capacity.with_columns(
        pl.Series("configuration", config_names(capacity), dtype=pl.String)
    )
    return named.with_columns(
        (pl.col("capacity_lo_rps") / pl.col("gpus")).alias("lo_per_gpu"),
        (pl.col("capacity_hi_rps") / pl.col("gpus")).alias("hi_per_gpu"),
        pl.col("input_len").cast(pl.String).alias("input"),
    )


def capacity_chart(capacity: pl.DataFrame, title: str) -> alt.LayerChart:
    """Bars of capacity per GPU, whiskers for the interval, one row per configuration."""
    data = _named(capacity).select(
        "configuration", "input", "capacity_per_gpu", "lo_per_gpu", "hi_per_gpu", "breaks_first"
    )
    order = (
        data.sort("capacity_per_gpu", descending=True)["configuration"]
        .unique(maintain_order=True)
        .to_list()
    )
    y = alt.Y("configuration:N", sort=order, title=None, axis=alt.Axis(labelLimit=0))
    base = alt.Chart(
        data, title=alt.Title("Capacity per GPU at the SLO", subtitle=title), width=300
    )
    bars = base.mark_bar().encode(
        x=alt.X("capacity_per_gpu:Q", title="capacity per GPU (req/s)"),
        y=y,
        yOffset="input:N",
        color=alt.Color("input:N", title="input tokens"),
        tooltip=["configuration", "input", "capacity_per_gpu", "breaks_first"],
    )
    whiskers = base.mark_rule(color="black").encode(
        x="lo_per_gpu:Q", x2="hi_per_gpu:Q", y=y, yOffset="input:N"
    )
    return alt.layer(bars, whiskers)


def pareto_frame(summary: pl.DataFrame, capacity: pl.DataFrame) -> pl.DataFrame:
    """The summary's points with the deployment's GPUs and the two Pareto axes."""
    gpus = _named(capacity).select("model", "mode", "input_len", "gpus", "configuration")
    joined = summary.join(gpus, on=["model", "mode", "input_len"], how="inner")
    return joined.filter(pl.col("mean_tpot_ms") > 0).with_columns(
        (1000 / pl.col("mean_tpot_ms")).alias("tokens_per_s_per_user"),
        (pl.col("output_throughput") / pl.col("gpus")).alias("tokens_per_s_per_gpu"),
        pl.col("input_len").cast(pl.String).alias("input"),
    )


def pareto_chart(summary: pl.DataFrame, capacity: pl.DataFrame, title: str) -> alt.Chart:
    data = pareto_frame(summary, capacity).select(
        "configuration", "input", "qps", "tokens_per_s_per_user", "tokens_per_s_per_gpu"
    )
    return (
        alt.Chart(
            data,
            title=alt.Title("Throughput vs interactivity", subtitle=title),
            width=360,
            height=260,
        )
        .mark_line(point=True)
        .encode(
            x=alt.X("tokens_per_s_per_user:Q", title="output tokens/s per user (1000 / mean TPOT)"),
            y=alt.Y("tokens_per_s_per_gpu:Q", title="output tokens/s per GPU"),
            color=alt.Color("configuration:N", legend=alt.Legend(labelLimit=0)),
            detail="input:N",
            order="qps:Q",
            tooltip=[
                "configuration",
                "input",
                "qps",
                "tokens_per_s_per_user",
                "tokens_per_s_per_gpu",
            ],
        )
    )


def write_answer_figures(
    summary: TableSource, capacity: TableSource, title: str, out_dir: Path
) -> list[Path]:
    """``capacity.{svg,html}`` and ``pareto.{svg,html}`` of one study."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, capacity = frame(summary), frame(capacity)
    return save_figure(capacity_chart(capacity, title), out_dir / "capacity") + save_figure(
        pareto_chart(summary, capacity, title), out_dir / "pareto"
    )


@dataclass(frozen=True)
class StudyPage:
    """One study on the front page."""

    name: str
    title: str
    recommendation: Section
    capacity: alt.TopLevelMixin
    pareto: alt.TopLevelMixin


STYLE = (
    "body{font-family:sans-serif;margin:1.5em}"
    "table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}"
    "th,td{border:1px solid #ccc;padding:0.2em 0.45em;text-align:left}th{background:#f2f2f2}"
    ".charts{display:flex;flex-wrap:wrap;gap:2em;align-items:flex-start}"
    "figure{margin:0;flex:0 0 auto}.chart{display:inline-block}"
    "figcaption{font-size:0.85em;max-width:36em;color:#333}"
)


def _study_html(i: int, page: StudyPage) -> tuple[str, list[tuple[str, str]]]:
    charts = [(f"capacity-{i}", page.capacity, CAPACITY_CAPTION)]
    charts.append((f"pareto-{i}", page.pareto, PARETO_CAPTION))
    figures = "".join(
        f'<figure><div class="chart" id="{cid}"></div><figcaption>{html.escape(caption)}'
        "</figcaption></figure>"
        for cid, _, caption in charts
    )
    sentences = "".join(f"<li>{html.escape(s)}</li>" for s in page.recommendation.sentences)
    tables = "".join(html_table(t) for t in page.recommendation.tables)
    body = (
        f'<section id="{html.escape(page.name)}"><h2>{html.escape(page.title)}</h2>'
        f'<ul>{sentences}</ul>{tables}<div class="charts">{figures}</div></section>'
    )
    return body, [(cid, chart.to_json()) for cid, chart, _ in charts]


def write_overview(
    names: Sequence[str],
    titles: Sequence[str],
    summaries: Sequence[TableSource],
    capacities: Sequence[TableSource],
    recommendations: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
) -> None:
    """The front page of these studies (per study: its summary, capacity table and the
    recommendation its findings job wrote)."""
    pages = []
    for name, title, summary, capacity, recommendation in zip(
        names, titles, summaries, capacities, recommendations, strict=True
    ):
        table = frame(capacity)
        pages.append(
            StudyPage(
                name,
                title,
                recommendation_of(recommendation),
                capacity_chart(table, title),
                pareto_chart(frame(summary), table, title),
            )
        )
    write_text(output, overview_html(pages, "servematrix: what to run at the SLO"))


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
