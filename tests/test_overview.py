"""The report's front page: its content, and that a real headless Chromium draws its charts.

The browser test fails (never skips) without Chromium: `make test` installs it when missing.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict

import polars as pl
import pytest

from servematrix.reporting import browser
from servematrix.reporting.figures import SCHEME
from servematrix.reporting.findings.common import Section, Table
from servematrix.reporting.findings.recommend import no_slo_section
from servematrix.reporting.overview import (
    StudyInputs,
    StudyPage,
    capacity_chart,
    overview_html,
    pareto_chart,
    write_overview,
)

CAPACITY = pl.DataFrame(
    {
        "model": ["m", "m"],
        "mode": ["chunked", "nondisagg"],
        "input_len": [1024, 1024],
        "gpus": [2, 2],
        "capacity": [21.0, 17.5],
        "capacity_lo": [21.0, 17.5],
        "capacity_hi": [21.2, 17.8],
        "capacity_per_gpu": [10.5, 8.75],
        "capacity_unit": ["req/s", "req/s"],
        "breaks_first": ["P99 TPOT", "P99 TPOT"],
    }
)
SUMMARY = pl.DataFrame(
    {
        "model": ["m"] * 4,
        "mode": ["chunked", "chunked", "nondisagg", "nondisagg"],
        "input_len": [1024] * 4,
        "qps": [2.0, 4.0, 2.0, 4.0],
        "mean_tpot_ms": [8.0, 9.0, 8.5, 10.0],
        "output_throughput": [12.0, 24.0, 12.0, 24.0],
    }
)


ANSWER = Section("Recommendation", ["Run chunked."], [Table(["rank"], [["1"]])])


def page(n_studies: int = 2) -> str:
    pages = [
        StudyPage(
            f"s{i}",
            f"Study <{i}>",
            ANSWER,
            capacity_chart(CAPACITY, f"Study <{i}>"),
            pareto_chart(SUMMARY, CAPACITY, f"Study <{i}>"),
        )
        for i in range(n_studies)
    ]
    return overview_html(pages, "front page")


def test_the_page_holds_every_study_its_table_and_captioned_charts():
    text = page(3)
    assert text.count("<figcaption>") == 6 and text.count("vegaEmbed('#") == 6
    assert "Study &lt;1&gt;" in text and "<td>1</td>" in text
    assert not re.search(r"<script[^>]+src=", text)  # Vega is inlined: no network to view it


def test_the_workflow_job_builds_the_same_page_from_the_files_its_jobs_wrote(tmp_path):
    """`write_overview` (the overview rule) reads each study's summary, capacity table and
    recommendation JSON from disk: the page is the one built from the same tables in memory."""
    SUMMARY.write_parquet(tmp_path / "summary.parquet")
    CAPACITY.write_parquet(tmp_path / "capacity.parquet")
    (tmp_path / "answer.json").write_text(json.dumps(asdict(ANSWER)), encoding="utf-8")
    write_overview(
        StudyInputs(["s0", "s1"], ["Study <0>", "Study <1>"], [None, None]),
        [tmp_path / "summary.parquet"] * 2,
        [str(tmp_path / "capacity.parquet")] * 2,
        [tmp_path / "answer.json"] * 2,
        tmp_path / "overview.html",
    )
    written = (tmp_path / "overview.html").read_text(encoding="utf-8")
    assert written == page(2).replace("front page", "servematrix: what to run at the SLO")


def test_without_an_slo_the_page_says_so_and_shows_the_line_to_add(tmp_path):
    """No capacity tables (no `slo:`): every study shows its findings' answer, no charts."""
    SUMMARY.write_parquet(tmp_path / "summary.parquet")
    (tmp_path / "answer.json").write_text(json.dumps(asdict(no_slo_section())), encoding="utf-8")
    write_overview(
        StudyInputs(["s0"], ["Study 0"], [None]),
        [tmp_path / "summary.parquet"],
        [],
        [tmp_path / "answer.json"],
        tmp_path / "overview.html",
    )
    written = (tmp_path / "overview.html").read_text(encoding="utf-8")
    assert "servematrix: no SLO set" in written and "No SLO is set" in written
    assert (
        "<code>slo: {ttft: {statistic: p99, max_ms: 2000}, tpot: {statistic: p99, max_ms: 100}, "
        "attainment: 0.9}</code>" in written
    )
    assert "vegaEmbed('#" not in written


def test_ten_configurations_get_ten_distinct_colours():
    """A categorical scheme of ten colours (Vega's tableau10) on the Pareto chart; Vega's
    named scheme resolves in the browser, so the test checks the spec and the scheme's size."""
    names = [f"model-{i}" for i in range(10)]
    capacity = pl.concat([CAPACITY.head(1).with_columns(model=pl.lit(n)) for n in names])
    summary = pl.concat([SUMMARY.head(2).with_columns(model=pl.lit(n)) for n in names])
    spec = pareto_chart(summary, capacity, "t").to_dict()
    scales = [layer["encoding"]["color"]["scale"] for layer in spec["layer"]]
    assert all(scale == {"scheme": SCHEME} for scale in scales)
    assert SCHEME in ("tableau10", "category10")
    svg_colours = set(
        re.findall(r'stroke="(#[0-9a-f]{6})"', _svg(pareto_chart(summary, capacity, "t")))
    )
    assert len(svg_colours & TABLEAU10) == 10


TABLEAU10 = {
    "#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b",
    "#eeca3b", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac",
}  # fmt: skip


def _svg(chart) -> str:
    import altair as alt
    from altair.utils.mimebundle import spec_to_mimebundle

    return spec_to_mimebundle(
        chart.to_dict(), format="svg", mode="vega-lite", vegalite_version=alt.VEGALITE_VERSION
    )["image/svg+xml"]


def test_a_modes_study_gets_a_capacity_and_pareto_panel_per_model():
    capacity = pl.concat([CAPACITY, CAPACITY.with_columns(model=pl.lit("big"))])
    summary = pl.concat([SUMMARY, SUMMARY.with_columns(model=pl.lit("big"))])
    bars = capacity_chart(capacity, "t", "modes").to_dict()
    assert len(bars["vconcat"]) == 2 and bars["resolve"]["scale"]["x"] == "independent"
    assert [panel["layer"][0]["encoding"]["y"]["title"] for panel in bars["vconcat"]] == [
        "m",
        "big",
    ]
    pareto = pareto_chart(summary, capacity, "t", "modes").to_dict()
    assert len(pareto["hconcat"]) == 2


def test_overloaded_points_are_hollow_on_the_pareto_chart():
    summary = SUMMARY.with_columns(steady=pl.Series([True, False, True, True]))
    spec = pareto_chart(summary, CAPACITY, "t").to_dict()
    hollow = [layer for layer in spec["layer"] if layer["mark"].get("filled") is False]
    assert len(hollow) == 1
    assert hollow[0]["encoding"]["shape"]["scale"]["domain"] == [
        "overloaded: queue growing, latency depends on run length"
    ]


def png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


@pytest.mark.slow
def test_chromium_renders_every_chart_of_the_front_page(tmp_path):
    html = tmp_path / "overview.html"
    html.write_text(page(2), encoding="utf-8")
    dom = browser.rendered_dom(html)
    # vega-embed draws each chart as an <svg class="marks"> once its script has run.
    assert len(re.findall(r'<svg[^>]*class="marks"', dom)) == 4
    assert dom.count("<path") > 20  # bars, whiskers, lines: drawn marks, not empty frames
    shot = browser.screenshot(html, tmp_path / "overview.png", 1200, 900)
    assert png_size(shot) == (1200, 900)


def test_a_missing_chromium_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(browser, "CHROMIUM", "chromium-that-is-not-installed")
    with pytest.raises(browser.BrowserError, match="not found: apt-get install -y chromium"):
        browser.rendered_dom(tmp_path / "x.html")
