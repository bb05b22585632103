"""End to end: real Snakemake on small studies with the simulator backend."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys

import polars as pl
import pytest
import yaml

from servematrix.spec import config, trace
from servematrix.spec.config import load
from tests.workflow_helpers import copy_workflow, planned_jobs, snakemake, write_config

pytestmark = pytest.mark.slow

CELL = (
    "results/simulator/cells/v0/Qwen2.5-7B-Instruct-GPTQ-Int4/nondisagg/"
    "qps2_in1024_out6_n20_s0.parquet"
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One full run of a small config (all + report), shared by the tests that inspect it."""
    from tests.conftest import SMALL_CONFIG

    workdir = copy_workflow(tmp_path_factory.mktemp("run"), copy.deepcopy(SMALL_CONFIG))
    run = snakemake(workdir, "--cores", "1", "all")
    assert run.returncode == 0, run.stderr[-3000:]
    report = snakemake(workdir, "--report", "results/report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    return workdir


def test_all_builds_every_output_of_every_study(finished_run):
    base = finished_run / "results" / "simulator"
    from tests.conftest import SMALL_CONFIG

    configured = [cell.path for cell in config.load(SMALL_CONFIG).all_cells()]
    assert len(configured) == 4 + 4
    assert all((finished_run / path).is_file() for path in configured)
    # Every capacity probe is a cell too, next to the configured ones.
    assert len(list((base / "cells").rglob("*.parquet"))) > len(configured)
    for study, deployments in (("disagg", 2), ("sizes", 4)):
        table = pl.read_parquet(base / "capacity" / f"{study}.parquet")
        assert table.height == deployments and (table["capacity"] > 0).all()
    for study, rows in (("disagg", 4), ("sizes", 4)):
        summary = pl.read_parquet(base / "summary" / f"{study}.parquet")
        assert summary.height == rows
        assert (summary["completed"] == 20).all()
        assert (base / "summary" / f"{study}.csv").is_file()
        for figure in ("ttft", "tpot", "itl", "throughput", "memory"):
            assert (base / "figures" / study / f"{figure}.svg").stat().st_size > 1000
            html = (base / "figures" / study / f"{figure}.html").read_text()
            assert "cdn.jsdelivr" not in html
        assert (base / "findings" / f"{study}.md").read_text().strip()
    table = trace.read(finished_run / CELL)
    assert table.num_rows == 21  # 20 measured + 1 warm-up
    meta = trace.read_metadata(finished_run / CELL)
    assert meta["cell"]["model"]["name"] == "Qwen2.5-7B-Instruct-GPTQ-Int4"
    assert meta["versions"]["servematrix"]


def test_report_is_self_contained(finished_run):
    html = (finished_run / "results" / "report.html").read_text()
    assert not re.search(r"<script[^>]+src=[\"']https?://", html)
    assert "disagg" in html and "sizes" in html


def test_ctrl_c_during_a_report_is_one_line_and_leaves_no_report(finished_run):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while `snakemake --report`
    works: exit status 130, one servematrix line, no traceback, no report, and the earlier
    report left alone. (Sent as the DAG is built, a second or more before the report is done:
    a partly written one is removed too, tests/test_signals.py.)"""
    earlier = (finished_run / "results" / "report.html").read_bytes()
    run = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--report", "results/interrupted.zip"],
        cwd=finished_run,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    for line in run.stdout:
        seen.append(line)
        if line.startswith("Building DAG of jobs"):
            os.killpg(run.pid, signal.SIGINT)
            break
    seen += run.stdout.readlines()
    assert run.wait() == 130, "".join(seen)
    output = "".join(seen)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert [line for line in seen if line.startswith("servematrix")] == [
        "servematrix: interrupted; the report results/interrupted.zip was not written\n"
    ]
    assert not (finished_run / "results" / "interrupted.zip").exists()
    assert (finished_run / "results" / "report.html").read_bytes() == earlier


def test_every_rule_logs(finished_run):
    logs = finished_run / "results" / "simulator" / "logs"
    # cells, five per study, the searches and their tables, the front page
    assert len(list(logs.rglob("*.log"))) == 8 + 5 * 2 + 6 + 2 + 1


def test_deleting_one_cell_replans_only_that_cell_and_its_aggregates(finished_run):
    (finished_run / CELL).unlink()
    try:
        dry = snakemake(finished_run, "-n", "--cores", "1", "all")
        assert dry.returncode == 0, dry.stderr
        assert planned_jobs(dry) == {
            "simulate_cell": 1,
            "step_time_sources": 1,
            "summarize": 1,
            "figures": 1,
            "findings": 1,
            "answer_figures": 1,
            "overview": 1,
            "all": 1,
        }
        assert "output: results/simulator/summary/disagg.parquet" in dry.stdout
        assert "output: results/simulator/summary/sizes.parquet" not in dry.stdout
    finally:
        assert snakemake(finished_run, "--cores", "1", "all").returncode == 0


def test_adding_a_qps_value_plans_only_the_new_cells(finished_run):
    """Only the new cells run, then that study's aggregates; its capacity searches stand (a
    deployment's capacity does not depend on the rates a study lists)."""
    config = yaml.safe_load((finished_run / "config" / "config.yaml").read_text())
    original = copy.deepcopy(config)
    config["studies"]["disagg"]["qps"] = [2, 4, 6]
    write_config(finished_run, config)
    new = [c.path for c in load(config).studies["disagg"].cells if c.workload.qps == 6]
    try:
        dry = snakemake(finished_run, "-n", "--cores", "1", "all")
        assert dry.returncode == 0, dry.stderr
        assert planned_jobs(dry) == {
            "simulate_cell": sum(not (finished_run / path).is_file() for path in new),
            "step_time_sources": 1,
            "summarize": 1,
            "figures": 1,
            "findings": 1,
            "answer_figures": 1,
            "overview": 1,
            "all": 1,
        }
    finally:
        write_config(finished_run, original)


def test_one_cell_target_builds_only_that_cell(tmp_path, small_config):
    workdir = copy_workflow(tmp_path, small_config)
    run = snakemake(workdir, "--cores", "1", CELL)
    assert run.returncode == 0, run.stderr[-3000:]
    cells = list((workdir / "results" / "simulator" / "cells").rglob("*.parquet"))
    assert [p.relative_to(workdir).as_posix() for p in cells] == [CELL]
    assert not (workdir / "results" / "simulator" / "summary").exists()


def test_broken_config_stops_before_any_job(tmp_path, small_config):
    small_config["studies"]["disagg"]["models"] = ["Qwen2.5-7B-Instruct-GPTQ-Int4", "Llama-9"]
    workdir = copy_workflow(tmp_path, small_config)
    run = snakemake(workdir, "--cores", "1", "all")
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "config error" in line]
    assert errors == [
        "servematrix: config error at studies.disagg.models[1]: unknown model 'Llama-9' "
        "(known: Qwen2.5-14B-Instruct, Qwen2.5-7B-Instruct-GPTQ-Int4)"
    ]
    assert "Traceback" not in run.stderr
    assert not (workdir / "results").exists()


def test_default_config_plans_every_study(tmp_path, default_config):
    workdir = copy_workflow(tmp_path, default_config)
    dry = snakemake(workdir, "-n", "--cores", "1", "all")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert planned_jobs(dry) == {
        "simulate_cell": 116,
        "step_time_sources": 6,
        "summarize": 6,
        "figures": 6,
        "findings": 6,
        "simulate_capacity": 32,
        "capacity_table": 6,
        "answer_figures": 6,
        "overview": 1,
        "all": 1,
    }


def test_a_capped_study_at_qps_inf_runs_end_to_end(tmp_path, small_config):
    """A study with max_concurrency and qps .inf: its cells get their own paths and traces
    that honour the cap; summary, figures and findings are built from them, and its capacity
    is in concurrent users."""
    small_config["studies"] = {
        "capped": {
            "recipe": "v0",
            "models": ["Qwen2.5-7B-Instruct-GPTQ-Int4"],
            "modes": ["single"],
            "qps": [4, float("inf")],
            "input_len": [512],
            "workload": {"max_concurrency": 4},
        }
    }
    workdir = copy_workflow(tmp_path, small_config)
    assert "- .inf" in (workdir / "config" / "config.yaml").read_text()
    run = snakemake(workdir, "--cores", "1", "all")
    assert run.returncode == 0, run.stderr[-3000:]
    base = workdir / "results" / "simulator"
    cells = sorted(p.relative_to(base).as_posix() for p in base.glob("cells/**/*_n20_*.parquet"))
    folder = "cells/v0/Qwen2.5-7B-Instruct-GPTQ-Int4/single"
    assert cells == [
        f"{folder}/qps4_in512_out6_n20_s0_c4.parquet",
        f"{folder}/qpsinf_in512_out6_n20_s0_c4.parquet",
    ]
    for cell in cells:
        table = pl.from_arrow(trace.read(base / cell)).filter(~pl.col("warmup"))
        assert table.height == 20 and (table["request_input_len"] == 512).all()
        events = sorted(
            [(t, 1) for t in table["sent_s"].to_list()]
            + [(t, -1) for t in table["end_s"].to_list()]
        )
        in_flight = [sum(change for _, change in events[: i + 1]) for i in range(len(events))]
        assert max(in_flight) == 4
    at_once = pl.from_arrow(trace.read(base / cells[1])).filter(~pl.col("warmup"))
    assert (at_once["scheduled_s"] == 0).all() and (at_once["sent_s"] > 0).sum() == 16
    summary = pl.read_parquet(base / "summary" / "capped.parquet")
    assert sorted(summary["qps"].to_list()) == [4.0, float("inf")]
    assert (summary["completed"] == 20).all()
    assert (base / "figures" / "capped" / "ttft.svg").is_file()
    assert "QPS inf" in (base / "findings" / "capped.md").read_text()
    capacity = pl.read_parquet(base / "capacity" / "capped.parquet")
    assert capacity["capacity_unit"].to_list() == ["users"] and capacity["capacity"][0] >= 1
    assert " users per GPU" in (base / "findings" / "capped.md").read_text()


def test_a_sessions_study_gets_its_capacity_in_concurrent_sessions(tmp_path, small_config):
    """Through Snakemake: the sessions study's search job and table, in sessions."""
    small_config["studies"] = {
        "chat": {
            "recipe": "v1",
            "models": ["Qwen2.5-7B-Instruct-GPTQ-Int4"],
            "modes": ["single"],
            "qps": [1],
            "input_len": [256],
            "workload": {"sessions": {"users": 4, "turns": 3, "think_time_s": 1.0}},
        }
    }
    workdir = copy_workflow(tmp_path, small_config)
    run = snakemake(workdir, "--cores", "1", "all")
    assert run.returncode == 0, run.stderr[-3000:]
    base = workdir / "results" / "simulator"
    assert len(list(base.glob("capacity/v1/*/single/in256_out6_sess3-t1.json"))) == 1
    capacity = pl.read_parquet(base / "capacity" / "chat.parquet")
    assert capacity["capacity_unit"].to_list() == ["sessions"] and capacity["capacity"][0] > 0
    assert " sessions per GPU" in (base / "findings" / "chat.md").read_text()


def budget_study(confirm_top: int | None) -> dict:
    """A gpu_budget study of 2 GPUs on the emulator: 1x(TP1), 2x(TP1), 1P(TP1)+1D(TP1)."""
    model = {
        "hf_id": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
        "architecture": "qwen2.5-7b",
        "quantization": "gptq-int4",
        "tensor_parallel": 1,
        "gpus": [[0], [1]],
    }
    study = {"recipe": "v1", "models": ["m"], "gpu_budget": 2, "tp": [1], "qps": [4]}
    study["input_len"] = [128]
    if confirm_top is not None:
        study["confirm_top"] = confirm_top
    return {
        "backend": "emulator",
        "slo": {"ttft": {"statistic": "p90", "max_ms": 500}},
        "models": {"m": model},
        "studies": {"split": study},
    }


def test_a_confirming_study_plans_the_twin_then_a_checkpoint_not_the_deployments(tmp_path):
    workdir = copy_workflow(tmp_path / "confirm", budget_study(confirm_top=1))
    dry = snakemake(workdir, "-n", "--cores", "1", "all")
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = planned_jobs(dry)
    assert jobs["simulate_cell"] == jobs["simulate_capacity"] == 3  # every topology simulated
    assert jobs["confirm_candidates"] == 1
    assert "cell" not in jobs and "capacity" not in jobs  # known after the checkpoint
    # without confirm_top every topology is deployed, as before
    workdir = copy_workflow(tmp_path / "all", budget_study(confirm_top=None))
    jobs = planned_jobs(snakemake(workdir, "-n", "--cores", "1", "all"))
    assert jobs["cell"] == jobs["capacity"] == 3 and "confirm_candidates" not in jobs
