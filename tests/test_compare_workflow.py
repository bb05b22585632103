"""End to end: a measured (emulator) run also simulates its cells and reports the two side by side.

Real Snakemake, real emulator deployments, real Parquet and the real report, in a scratch copy
of the workflow with its own port.
"""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import polars as pl
import pytest

from servematrix.deploy.supervise import port_problem
from servematrix.reporting.compare import COMPARED, COMPARED_FIGURES
from tests.workflow_helpers import copy_workflow, snakemake

pytestmark = pytest.mark.slow

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


def _free_port() -> int:
    """A free port below the kernel's ephemeral range, so no client connection holds it."""
    for _ in range(100):
        port = random.randrange(10000, 31000)
        if port_problem("127.0.0.1", port) is None:
            return port
    raise RuntimeError("no free port")


def _config() -> dict:
    return {
        "backend": "emulator",
        "defaults": {"num_prompts": 12, "output_len": 8, "seed": 0},
        "ports": {"single": _free_port()},
        "deploy": {"startup_timeout_s": 60, "stop_timeout_s": 10},
        "models": {
            MODEL: {
                "hf_id": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
                "architecture": "qwen2.5-7b",
                "quantization": "gptq-int4",
                "tensor_parallel": 1,
                "gpus": [[0]],
            }
        },
        "studies": {
            "small": {
                "recipe": "v1",
                "models": [MODEL],
                "modes": ["single"],
                "qps": [2, 8],
                "input_len": [256],
            }
        },
    }


def test_an_emulator_run_reports_the_simulator_beside_it(tmp_path):
    workdir = copy_workflow(tmp_path, _config())
    run = snakemake(workdir, "--cores", "1", "all", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = workdir / "results"

    # the simulator ran the same cells, under its own backend directory
    predicted = pl.read_parquet(results / "simulator/summary/small.parquet")
    measured = pl.read_parquet(results / "emulator/summary/small.parquet")
    assert predicted["backend"].to_list() == ["simulator"] * 2
    assert predicted.select("model", "mode", "qps").equals(measured.select("model", "mode", "qps"))

    ratios = pl.read_parquet(results / "emulator/compare/small/ratios.parquet")
    assert ratios.height == len(COMPARED) * 2
    assert ratios["ratio"].null_count() == 0
    by_metric = {
        m: ratios.filter(pl.col("metric") == m)["ratio"].to_list() for m in ratios["metric"]
    }
    # Throughput follows the arrivals at these loads; the emulator serves the simulator's own
    # engine, so latencies agree within the HTTP path's cost (client, server, streaming).
    for metric in ("request_throughput", "output_throughput"):
        assert all(0.9 < r < 1.1 for r in by_metric[metric]), (metric, by_metric[metric])
    for metric in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms"):
        assert all(0.5 < r < 2.0 for r in by_metric[metric]), (metric, by_metric[metric])
    page = (results / "emulator/compare/small/ratios.html").read_text()
    assert "simulator / emulator" in page and "Mean TTFT (ms)" in page
    for figure in COMPARED_FIGURES:
        svg = results / f"emulator/compare/small/{figure}.svg"
        assert svg.stat().st_size > 1000
        assert "simulator (predicted)" in svg.read_text()

    steps = (results / "simulator/step_times/small.md").read_text()
    assert "none fell back to the roofline" in steps

    report = snakemake(workdir, "--report", "results/report.zip", timeout=120)
    assert report.returncode == 0, report.stderr[-3000:]
    with zipfile.ZipFile(workdir / "results/report.zip") as packed:
        names = [Path(name).name for name in packed.namelist()]
        page = packed.read("report/report.html").decode()
    assert "ratios.html" in names
    for figure in COMPARED_FIGURES:  # the study's own figure and the overlaid one
        assert names.count(f"{figure}.svg") == 2, figure
    assert "Predicted vs measured" in page and "step-time sources" in page
    assert not list(Path(results).rglob(".*.tmp")), "no half-written file"
