"""Study figures are really rendered: SVG that parses, offline HTML, readable labels."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import altair as alt
import polars as pl
import pytest

from servematrix.reporting.figures import (
    MEMORY_PANELS,
    build_figure,
    chart_spec,
    choose_layout,
    latency_panels,
    offline_html,
    save_figure,
    series_order,
    study_figures,
    use_log_x,
    use_log_y,
    vega_bundle,
    write_study_figures,
)

STATS = ("mean", "median", "std", "p90", "p95", "p99")


def make_summary(models: list[str], modes: list[str], xs: list[float], x: str = "qps"):
    """A small synthetic study summary: latency grows with x, model index and mode index."""
    rows = []
    for i, model in enumerate(models):
        for j, mode in enumerate(modes):
            for k, xv in enumerate(xs):
                base = 40.0 * (i + 1) * (1 + 0.3 * j) * (1 + 0.5 * k)
                row = {
                    "model": model,
                    "mode": mode,
                    "qps": float(xv) if x == "qps" else 16.0,
                    "input_len": int(xv) if x == "input_len" else 1024,
                    "output_throughput": 6.0 * (k + 1),
                    "request_throughput": 1.0 * (k + 1),
                    "request_goodput": 0.8 * (k + 1),
                    "peak_gpu_memory_mib": 64_839.7,
                    "peak_kv_cache_usage": min(0.05 * (i + 1) * (j + 1) * (k + 1), 1.0),
                }
                for family, scale in (("ttft", 1.0), ("tpot", 0.2), ("itl", 0.15)):
                    row |= {f"{s}_{family}_ms": base * scale * (1 + n) for n, s in enumerate(STATS)}
                rows.append(row)
    return pl.DataFrame(rows)


MOONCAKE = make_summary(["Qwen-72B", "Qwen-7B"], ["mooncake-tcp", "nondisagg"], [2, 4])
TITLE = "Disaggregation <test> study"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_study_figures(MOONCAKE, TITLE, "qps", tmp_path_factory.mktemp("figs"))


def svg_text(path: Path) -> str:
    """All text drawn in an SVG, joined; parsing also proves it is well-formed XML."""
    root = ET.parse(path).getroot()
    return " ".join(t for t in root.itertext() if t.strip())


def test_writes_every_figure_as_svg_and_html(rendered: list[Path]) -> None:
    names = sorted(p.name for p in rendered)
    expected = [
        f"{f}.{ext}"
        for f in ("itl", "memory", "throughput", "tpot", "ttft")
        for ext in ("html", "svg")
    ]
    assert names == expected
    assert all(p.stat().st_size > 0 for p in rendered)
    leftovers = [p.name for p in rendered[0].parent.iterdir() if p not in rendered]
    assert leftovers == []


def test_svg_has_titles_axes_and_legend(rendered: list[Path]) -> None:
    text = svg_text(rendered[0].parent / "ttft.svg")
    for label in (
        "Time to first token (TTFT)",
        TITLE,
        "Mean TTFT",
        "Median TTFT",
        "P99 TTFT",
        "Mean TTFT (ms)",
        "Offered load (requests/s)",
        "Model: Qwen-72B",
        "Model: Qwen-7B",
        "Mode",
        "nondisagg",
        "mooncake-tcp",
    ):
        assert label in text, label
    throughput = svg_text(rendered[0].parent / "throughput.svg")
    for label in ("Output tokens/s", "Completed requests/s", "Good requests/s"):
        assert label in throughput, label


def test_html_is_interactive_and_offline(rendered: list[Path]) -> None:
    for path in rendered:
        if path.suffix != ".html":
            continue
        page = path.read_text()
        assert "cdn.jsdelivr" not in page
        assert not re.search(r"<script[^>]*\bsrc\s*=", page)
        assert not re.search(r"""<link[^>]*href\s*=\s*["']?http""", page)
        assert "vegaEmbed" in page
        assert "Disaggregation" in page
        assert {
            "ttft": "Mean TTFT",
            "tpot": "P99 TPOT",
            "itl": "Median ITL",
            "memory": "Peak GPU memory (MiB)",
        }.get(path.stem, "Goodput") in page


def test_input_length_axis(tmp_path: Path) -> None:
    summary = make_summary(["cmd-r", "cmd-r-plus"], ["single"], [1024, 2048, 4096], "input_len")
    write_study_figures(summary, "Input study", "input_len", tmp_path)
    text = svg_text(tmp_path / "tpot.svg")
    assert "Input length (tokens)" in text
    assert "4096" in text
    assert "Model" in text and "cmd-r-plus" in text


def test_layout_follows_what_varies() -> None:
    both = choose_layout(MOONCAKE)
    assert (both.series, both.rows) == ("mode", "model")
    models = choose_layout(make_summary(["a", "b"], ["single"], [2]))
    assert (models.series, models.rows) == ("model", None)
    modes = choose_layout(make_summary(["a"], ["chunked", "nondisagg"], [2]))
    assert (modes.series, modes.rows) == ("mode", None)


def test_modes_in_canonical_order() -> None:
    assert series_order(MOONCAKE, "mode") == ["nondisagg", "mooncake-tcp"]


def test_wide_qps_range_uses_a_log_axis() -> None:
    assert use_log_x([2, 4, 8, 16, 32, 64])
    assert not use_log_x([2, 4, 6, 8])
    assert not use_log_x([1024, 2048, 4096])
    assert not use_log_x([2, 64])


def test_y_axis_starts_at_zero() -> None:
    spec = build_figure(MOONCAKE, "t", "qps", latency_panels("ttft"))
    scales = re.findall(r"'y': \{[^{}]*'scale': \{'zero': (\w+)", str(spec))
    assert scales and set(scales) == {"True"}


def test_missing_values_and_single_point_render(tmp_path: Path) -> None:
    summary = make_summary(["only"], ["single"], [2]).with_columns(
        pl.lit(math.nan).alias("p99_ttft_ms"),
        pl.lit(None, pl.Float64).alias("mean_itl_ms"),
        pl.lit(math.inf).alias("output_throughput"),
    )
    paths = write_study_figures(summary, "Degenerate", "qps", tmp_path)
    assert len(paths) == 10
    assert "P99 TTFT" in svg_text(tmp_path / "ttft.svg")


def test_memory_figure_shows_both_peaks(rendered: list[Path]) -> None:
    text = svg_text(rendered[0].parent / "memory.svg")
    for label in (
        f"Memory — {TITLE}",
        "Peak GPU memory (busiest GPU)",
        "Peak GPU memory (MiB)",
        "Peak KV-cache usage (busiest instance)",
        "Peak share of KV blocks in use (0-1)",
        "Model: Qwen-72B",
        "mooncake-tcp",
    ):
        assert label in text, label


def test_memory_figure_renders_with_null_values(tmp_path: Path) -> None:
    """vllm without NVML has no GPU memory, a cell without /metrics no KV usage: those cells
    have no point, the others still do; an all-null column gives an empty panel, no error."""
    summary = make_summary(["a", "b"], ["single"], [2, 4, 8])
    partly = summary.with_columns(
        pl.when(pl.col("qps") == 4.0)
        .then(None)
        .otherwise(pl.col("peak_kv_cache_usage"))
        .alias("peak_kv_cache_usage"),
        pl.lit(None, pl.Float64).alias("peak_gpu_memory_mib"),
    )
    spec = build_figure(partly, "t", "qps", MEMORY_PANELS)
    values = [
        row["peak_kv_cache_usage"]
        for data in spec["datasets"].values()
        for row in data
        if "peak_kv_cache_usage" in row
    ]
    assert values.count(None) == 2 and len([v for v in values if v is not None]) == 4
    write_study_figures(partly, "Partly measured", "qps", tmp_path)
    text = svg_text(tmp_path / "memory.svg")
    assert "Peak GPU memory (MiB)" in text
    # 4 KV-usage points (2 models x 2 QPS values), none for GPU memory.
    assert (tmp_path / "memory.svg").read_text().count('aria-roledescription="point"') == 4


@pytest.mark.parametrize(
    ("summary", "x", "message"),
    [
        (MOONCAKE.drop("p99_itl_ms"), "qps", "p99_itl_ms"),
        (MOONCAKE, "seconds", "x must be"),
        (pl.concat([MOONCAKE, MOONCAKE.head(1)]), "qps", "several rows"),
        (MOONCAKE.clear(), "qps", "no rows"),
    ],
)
def test_bad_summary_is_named(tmp_path: Path, summary: pl.DataFrame, x: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_study_figures(summary, "t", x, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_log_y_only_when_one_panel_spans_orders_of_magnitude() -> None:
    assert use_log_y([60.0, 70.0, 24_000.0])
    assert not use_log_y([60.0, 70.0, 900.0])
    assert not use_log_y([0.0, 0.5, 12_000.0])  # a zero has no place on a log axis
    assert not use_log_y([])


def test_files_are_what_chart_save_writes(tmp_path: Path) -> None:
    """One spec for both files, the Vega bundle from the cache: what Altair writes for the chart
    of that spec (which Altair validates against Vega-Lite's schema: `figure_grid` does not);
    the page's spec text differs only in the order of its keys."""
    specs = study_figures(MOONCAKE.with_columns(steady=pl.lit(False)), TITLE, "qps")
    for other in specs.values():  # each valid, overloaded points drawn too
        alt.VConcatChart.from_dict(other)
    spec = study_figures(MOONCAKE, TITLE, "qps")["ttft"]
    chart = alt.VConcatChart.from_dict(spec)
    assert chart_spec(chart) == spec
    chart.save(tmp_path / "altair.svg", format="svg")
    chart.save(tmp_path / "altair.html", format="html", inline=True)
    save_figure(spec, tmp_path / "ours")
    assert (tmp_path / "ours.svg").read_bytes() == (tmp_path / "altair.svg").read_bytes()
    page = (tmp_path / "altair.html").read_text(encoding="utf-8")
    assert offline_html(chart_spec(chart)) == page
    assert (tmp_path / "ours.html").read_text(encoding="utf-8") == offline_html(spec)


def test_the_vega_bundle_is_built_once_per_version(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SERVEMATRIX_CACHE", str(tmp_path))
    vega_bundle.cache_clear()
    try:
        bundle = vega_bundle()
        [cached] = (tmp_path / "vega").glob("vega-embed-v*-vl-convert-*.js")
        assert cached.read_text(encoding="utf-8") == bundle and "vegaEmbed" in bundle
    finally:
        vega_bundle.cache_clear()


def test_overloaded_points_are_hollow_diamonds_with_a_legend_note(tmp_path: Path) -> None:
    """With the summary's `steady` column, overloaded points are drawn apart and the legend says
    what they mean; without it the figure is as before (one filled point per value)."""
    steady = [True, False] * (MOONCAKE.height // 2)
    marked = MOONCAKE.with_columns(steady=pl.Series(steady))
    spec = build_figure(marked, TITLE, "qps", latency_panels("ttft"))
    text = repr(spec)
    assert "overloaded: queue growing, latency depends on run length" in text
    assert "'filled': False" in text and "diamond" in text
    svg = save_figure(build_figure(marked, TITLE, "qps", latency_panels("ttft")), tmp_path / "t")[0]
    drawn = svg.read_text()
    assert "overloaded: queue growing, latency depends on run length" in drawn
    ET.fromstring(drawn)
    plain = build_figure(MOONCAKE, TITLE, "qps", latency_panels("ttft"))
    assert "overloaded" not in repr(plain)


def test_every_steady_point_keeps_its_filled_marker() -> None:
    all_steady = MOONCAKE.with_columns(steady=pl.lit(True))
    spec = repr(build_figure(all_steady, TITLE, "qps", latency_panels("ttft")))
    assert "'filled': False" not in spec and "queue growing" not in spec
