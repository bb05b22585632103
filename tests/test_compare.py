"""The simulator's predictions judged: step-time sources, the ratio table, the overlaid figures
and the workflow's plan for them (each in isolation; the end-to-end run is
tests/test_compare_workflow.py)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import altair as alt
import polars as pl
import pyarrow.parquet as pq
import pytest

from servematrix.backends.cell import run_cell
from servematrix.reporting import compare, steptimes
from servematrix.reporting.compare import (
    COMPARED,
    COMPARED_FIGURES,
    comparison_figure,
    ratio_table,
    ratios_html,
    summarize_ratios,
)
from servematrix.reporting.steptimes import SetupStepTimes, step_time_sentences, write_step_times
from servematrix.spec import trace
from servematrix.spec.matrix import MODES, Cell, ConfigError, ModelSpec, Serving, Workload
from servematrix.workflow import check_config, predicted_config
from tests.conftest import SMALL_CONFIG
from tests.workflow_helpers import copy_workflow, planned_jobs, snakemake, write_config

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


def summary(backend: str, cells: list[tuple[str, str, float]], scale: float = 1.0) -> pl.DataFrame:
    """A summary with the compared columns: metric i of cell j is (i + 1) * (j + 1) * scale."""
    rows = []
    for j, (model, mode, qps) in enumerate(cells):
        row = {"backend": backend, "model": model, "mode": mode, "qps": qps, "input_len": 1024}
        row |= {p.column: (i + 1) * (j + 1) * scale for i, p in enumerate(COMPARED)}
        rows.append(row)
    return pl.DataFrame(rows)


CELLS = [("m", "single", 2.0), ("m", "single", 4.0)]


# The ratio table -----------------------------------------------------------------------------


def test_ratio_is_simulator_over_measured_per_metric_and_cell():
    table = ratio_table(summary("simulator", CELLS, 1.5), summary("emulator", CELLS))
    assert table.columns == list(compare.RATIO_COLUMNS)
    assert table.height == len(COMPARED) * len(CELLS)
    assert table["ratio"].to_list() == pytest.approx([1.5] * table.height)
    first = table.row(0, named=True)
    assert (first["metric"], first["label"], first["qps"]) == ("mean_ttft_ms", "Mean TTFT (ms)", 2)
    assert (first["simulator"], first["measured"]) == (1.5, 1.0)
    assert table["metric"].unique(maintain_order=True).to_list() == [p.column for p in COMPARED]


def test_no_ratio_without_a_positive_finite_measurement():
    measured = summary("vllm", CELLS).with_columns(
        pl.Series("mean_ttft_ms", [0.0, None]),
        pl.Series("p99_ttft_ms", [math.nan, math.inf]),
    )
    table = ratio_table(summary("simulator", CELLS), measured)
    ttft = table.filter(pl.col("metric").is_in(["mean_ttft_ms", "p99_ttft_ms"]))
    assert ttft["ratio"].to_list() == [None] * 4
    assert table["ratio"].null_count() == 4


@pytest.mark.parametrize(
    ("predicted", "measured", "message"),
    [
        (CELLS, CELLS[:1], r"QPS 4, input 1024 is only in the simulator one"),
        (CELLS[:1], CELLS, r"QPS 4, input 1024 is only in the measured one"),
        (CELLS + CELLS[:1], CELLS, r"predicted summary has several rows for one cell"),
    ],
)
def test_the_summaries_must_hold_the_same_cells(predicted, measured, message):
    with pytest.raises(ValueError, match=message):
        ratio_table(summary("simulator", predicted), summary("emulator", measured))


def test_the_measured_side_is_not_the_simulator():
    with pytest.raises(ValueError, match="the simulator's own"):
        ratio_table(summary("simulator", CELLS), summary("simulator", CELLS))
    with pytest.raises(ValueError, match=r"predicted summary holds backend\(s\) \['vllm'\]"):
        ratio_table(summary("vllm", CELLS), summary("emulator", CELLS))


def test_ratio_summary_and_page_mark_the_cells_outside_the_band():
    measured = summary("emulator", CELLS)
    predicted = summary("simulator", CELLS).with_columns(
        pl.Series("mean_ttft_ms", [2.0, 1.0]),  # measured 1.0 and 2.0: ratios 2.0 and 0.5
    )
    table = ratio_table(predicted, measured)
    first = summarize_ratios(table)[0]
    assert (first.metric, first.cells, first.within_band) == ("mean_ttft_ms", 2, 0)
    assert first.geomean_ratio == pytest.approx(1.0)
    assert (first.min_ratio, first.max_ratio) == (0.5, 2.0)
    assert all(s.within_band == 2 for s in summarize_ratios(table)[1:])
    page = ratios_html(table, "A study", "emulator")
    assert page.count("<tr class=out>") == 2
    assert "simulator / emulator" in page and "0 of 2" in page and "2.00×" in page
    assert "<th>emulator</th>" in page


# The overlaid figures --------------------------------------------------------------------------


def _layers(spec: dict) -> list[list[dict]]:
    return [[panel for panel in row["hconcat"]] for row in spec["vconcat"]]


def test_figure_has_one_row_per_configuration_and_one_line_per_backend():
    cells = [(m, mode, q) for m in ("a", "b") for mode in ("chunked", "nondisagg") for q in (2, 4)]
    panels = COMPARED_FIGURES["ttft"]
    spec = comparison_figure(
        summary("simulator", cells, 2.0), summary("vllm", cells), "T", "qps", panels
    )
    alt.VConcatChart.from_dict(spec)  # a valid Vega-Lite spec (composed as dicts)
    rows = _layers(spec)
    assert len(rows) == 4 and all(len(row) == len(panels) == 2 for row in rows)
    # canonical mode order within each model, both named when both vary
    assert [row["title"]["text"] for row in spec["vconcat"]] == [
        "a · nondisagg",
        "a · chunked",
        "b · nondisagg",
        "b · chunked",
    ]
    names = ["vllm (measured)", "simulator (predicted)"]
    for row in rows:
        for panel, expected in zip(row, panels, strict=True):
            encoding = panel["encoding"]
            assert encoding["y"]["field"] == expected.column
            assert encoding["color"]["field"] == encoding["strokeDash"]["field"] == "source"
            assert encoding["color"]["scale"]["domain"] == names
            assert encoding["strokeDash"]["scale"]["range"] == [[1, 0], [6, 3]]
    values = spec["datasets"][spec["vconcat"][0]["data"]["name"]]  # the row's data: model a
    assert {(v["model"], v["mode"]) for v in values} == {("a", "nondisagg")}
    by_source = {v["source"]: v["mean_ttft_ms"] for v in values if v["qps"] == 2}
    assert by_source == {"vllm (measured)": 3.0, "simulator (predicted)": 6.0}  # cell j = 2


def test_figure_of_one_configuration_has_no_row_title_and_drops_non_finite_points():
    measured = summary("emulator", CELLS).with_columns(pl.Series("p99_ttft_ms", [math.inf, 2.0]))
    spec = comparison_figure(
        summary("simulator", CELLS), measured, "T", "qps", COMPARED_FIGURES["ttft"]
    )
    assert len(spec["vconcat"]) == 1 and spec["vconcat"][0]["title"]["text"] == ""
    values = next(iter(spec["datasets"].values()))
    assert [v["p99_ttft_ms"] for v in values if v["source"] == "emulator (measured)"] == [None, 2.0]
    with pytest.raises(ValueError, match="x must be one of"):
        comparison_figure(summary("simulator", CELLS), measured, "T", "seed", COMPARED)


def test_written_comparison_has_every_file(tmp_path):
    table = compare.write_comparison(
        summary("simulator", CELLS, 1.1), summary("emulator", CELLS), "T", "qps", tmp_path
    )
    assert pl.read_parquet(tmp_path / "ratios.parquet").equals(table)
    assert pl.read_csv(tmp_path / "ratios.csv")["ratio"].to_list() == [1.1] * table.height
    for name in COMPARED_FIGURES:
        assert (tmp_path / f"{name}.svg").stat().st_size > 1000
        assert "vega" in (tmp_path / f"{name}.html").read_text()


# Step-time sources ---------------------------------------------------------------------------


def _cell(gpu: str, mode: str = "single", qps: float = 4.0) -> Cell:
    return Cell(
        backend="simulator",
        recipe="v1",
        model=ModelSpec(MODEL, "Qwen/" + MODEL, "qwen2.5-7b", "gptq-int4", 1, ((0,), (4,))),
        mode=MODES[mode],
        workload=Workload(qps, 256, 4, 4, 0, "random", 1.0, 1),
        serving=Serving(4096, 0.8),
        engine={"gpu": gpu, "jitter_cv": 0.0},
    )


def test_step_time_page_names_the_roofline_cells_and_why(tmp_path):
    paths = []
    for i, (gpu, mode) in enumerate(
        [("A10-24GB", "single"), ("A10-24GB", "chunked"), ("A100-SXM4-80GB", "single")]
    ):
        paths.append(tmp_path / f"{i}.parquet")
        run_cell(_cell(gpu, mode), paths[-1])
    setups = write_step_times(paths, "Study", tmp_path / "st.md", tmp_path / "st.html")
    assert [(s.gpu, s.cells, s.modes) for s in setups] == [
        ("A10-24GB", 2, ("single", "chunked")),
        ("A100-SXM4-80GB", 1, ("single",)),
    ]
    text = (tmp_path / "st.md").read_text()
    assert "2 of 3 cells took their step times from the roofline model" in text
    assert (
        f"{MODEL} on A10-24GB, TP 1, gptq-int4 (2 cells; modes single, chunked): "
        "aiconfigurator has no system file for A10-24GB." in text
    )
    page = (tmp_path / "st.html").read_text()
    assert page.count("<tr class=out>") == 1 and "aiconfigurator-core" in page


def test_step_time_sentences_when_none_or_all_fell_back():
    setup = SetupStepTimes(MODEL, "A100-SXM4-80GB", 1, "bf16", "aiconfigurator", None, ("a",), 3)
    assert step_time_sentences([setup]) == [
        "All 3 cells took their step times from aiconfigurator-core's measured vLLM operator "
        "tables; none fell back to the roofline model."
    ]
    roofline = SetupStepTimes(MODEL, "L40S-48GB", 2, "awq", "roofline (x)", "x", ("a", "b"), 1)
    first, second = step_time_sentences([roofline])
    assert first.startswith("All 1 cell took their step times from the roofline model")
    assert second == f"{MODEL} on L40S-48GB, TP 2, awq (1 cell; modes a, b): x."


def test_a_trace_without_the_fallback_field_says_so_by_its_label(tmp_path):
    path = tmp_path / "old.parquet"
    run_cell(_cell("A10-24GB"), path)
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[trace.METADATA_KEY])
    del meta["deployment"]["engine"]["step_time_fallback"]
    old = table.replace_schema_metadata({trace.METADATA_KEY: json.dumps(meta)})
    pq.write_table(old, path)
    cell = steptimes.cell_step_times(path)
    assert cell.fallback_reason is not None and cell.fallback_reason.startswith("roofline (")


def test_a_trace_of_a_measured_backend_has_no_step_time_source(tmp_path):
    path = tmp_path / "measured.parquet"
    run_cell(_cell("A100-SXM4-80GB"), path)
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[trace.METADATA_KEY])
    meta["deployment"] = {"base_url": "http://127.0.0.1:8000"}
    pq.write_table(table.replace_schema_metadata({trace.METADATA_KEY: json.dumps(meta)}), path)
    with pytest.raises(trace.TraceError, match="records no step-time source"):
        steptimes.cell_step_times(path)


# The workflow's plan -------------------------------------------------------------------------


def test_the_twin_of_a_measured_run_is_the_same_cells_on_the_simulator():
    measured = check_config({**copy.deepcopy(SMALL_CONFIG), "backend": "emulator"})
    twin = predicted_config(measured)
    assert twin is not None and twin.backend == "simulator"
    assert [c.path.replace("/simulator/", "/emulator/", 1) for c in twin.all_cells()] == [
        c.path for c in measured.all_cells()
    ]
    assert all(c.deploy == {} for c in twin.all_cells())
    assert predicted_config(twin) is None


def test_a_config_the_engine_cannot_model_has_no_twin():
    raw = copy.deepcopy(SMALL_CONFIG)
    raw["backend"] = "vllm"
    raw["models"]["Qwen2.5-14B-Instruct"]["quantization"] = "bf16"
    raw["defaults"]["gpu_memory_utilization"] = 0.2  # 14B bf16 weights need more of an A100
    measured = check_config(raw)  # vllm: the engine's fit is not checked
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        predicted_config(measured)


@pytest.fixture
def workdir(tmp_path) -> Path:
    return copy_workflow(tmp_path, copy.deepcopy(SMALL_CONFIG))


def test_plan_per_backend(workdir):
    """The simulator run states its step-time sources and compares nothing; a measured run
    also simulates every cell, summarises them and compares per study; a run the engine cannot
    model says so in one line and measures anyway."""
    simulated = snakemake(workdir, "-n", "--cores", "1", "all")
    assert simulated.returncode == 0, simulated.stderr[-2000:]
    assert planned_jobs(simulated) == {
        "simulate_cell": 8,
        "step_time_sources": 2,
        "summarize": 2,
        "figures": 2,
        "findings": 2,
        "simulate_capacity": 6,
        "capacity_table": 2,
        "answer_figures": 2,
        "overview": 1,
        "all": 1,
    }
    measured = snakemake(workdir, "-n", "--cores", "1", "all", "--config", "backend=emulator")
    assert measured.returncode == 0, measured.stderr[-2000:]
    jobs = planned_jobs(measured)
    counts = ("cell", "simulate_cell", "summarize", "compare", "step_time_sources")
    assert tuple(jobs[rule] for rule in counts) == (8, 8, 4, 2, 2)
    assert "results/simulator/cells/v0/" in measured.stdout
    # Each measured search starts from its simulator twin's capacity: both are planned.
    assert (jobs["capacity"], jobs["simulate_capacity"]) == (6, 6)
    assert "results/simulator/capacity/v0/" in measured.stdout
    assert "results/emulator/compare/disagg/ratios.html" in measured.stdout
    raw = copy.deepcopy(SMALL_CONFIG)
    raw["backend"] = "vllm"
    raw["defaults"]["gpu_memory_utilization"] = 0.2  # too little of an A100 for the 14B
    write_config(workdir, raw)
    unmodelled = snakemake(workdir, "-n", "--cores", "1", "all")
    assert unmodelled.returncode == 0, unmodelled.stderr[-2000:]
    assert "servematrix: no simulator prediction to compare with:" in unmodelled.stderr
    assert "compare" not in planned_jobs(unmodelled)
    assert "step_time_sources" not in planned_jobs(unmodelled)
