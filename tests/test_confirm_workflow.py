"""End to end: a gpu_budget study on the emulator with ``confirm_top`` deploys only the
simulator's top topologies.

Real Snakemake in a scratch copy of the workflow: the simulator twin searches every topology of
a 2-GPU budget, the checkpoint picks the top two by simulated capacity per GPU, and only those
start as real emulator deployments (their study cell and capacity search); the third never
starts. Short probes (3 s, a tail of 2 requests, at most 3 probes) keep it to a minute or two.
"""

from __future__ import annotations

import json
import time

import polars as pl
import pytest

from servematrix.deploy.supervise import port_problem
from tests.workflow_helpers import (
    copy_workflow,
    free_port_base,
    live_processes,
    port_block,
    snakemake,
)

pytestmark = pytest.mark.slow

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"
TOPOLOGIES = {"1x(TP1)", "2x(TP1)", "1P(TP1)+1D(TP1)"}


def _config() -> dict:
    return {
        "backend": "emulator",
        "defaults": {"num_prompts": 8, "output_len": 8, "seed": 0},
        "ports": port_block(free_port_base()),
        "deploy": {"startup_timeout_s": 60, "stop_timeout_s": 10},
        "slo": {"ttft": {"statistic": "p90", "max_ms": 500}},
        "capacity": {"min_duration_s": 3, "tail_requests": 2, "max_probes": 3},
        "models": {
            MODEL: {
                "hf_id": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
                "architecture": "qwen2.5-7b",
                "quantization": "gptq-int4",
                "tensor_parallel": 1,
                "gpus": [[0], [1]],
            }
        },
        "studies": {
            "split": {
                "recipe": "v1",
                "models": [MODEL],
                "gpu_budget": 2,
                "tp": [1],
                "confirm_top": 2,
                "qps": [4],
                "input_len": [128],
            }
        },
    }


def test_only_the_simulator_top_topologies_are_deployed(tmp_path):
    cfg = _config()
    workdir = copy_workflow(tmp_path, cfg)
    run = snakemake(workdir, "--cores", "1", "all", timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = workdir / "results"

    # the twin searched every topology of the budget
    twin = pl.read_parquet(results / "simulator/capacity/split.parquet")
    assert set(twin["topology"]) == TOPOLOGIES
    assert len(list((results / "simulator/cells/v1" / MODEL).iterdir())) == len(TOPOLOGIES)
    ranked = twin.sort(["capacity_per_gpu", "gpus", "topology"], descending=[True, False, False])
    top = ranked["topology"].to_list()[:2]

    picks = json.loads((results / "emulator/confirm/split.json").read_text())
    (comparison,) = picks["comparisons"]
    assert [p["topology"] for p in comparison["picked"]] == top
    assert [p["simulated_rank"] for p in comparison["picked"]] == [1, 2]

    # only the picked topologies were deployed: their traces and searches, nothing of the other
    cells = results / "emulator/cells/v1" / MODEL
    assert {p.name for p in cells.iterdir()} == set(top)
    (left,) = TOPOLOGIES - set(top)
    assert not (results / "emulator/capacity/v1" / MODEL / left).exists()
    assert not list((results / "emulator/logs").rglob(f"*{left}*"))
    measured = pl.read_parquet(results / "emulator/capacity/split.parquet")
    assert measured.height == 2 and set(measured["topology"]) == set(top)
    assert measured["simulated_capacity_per_gpu"].null_count() == 0
    summary = pl.read_parquet(results / "emulator/summary/split.parquet")
    assert set(summary["mode"]) == set(top)
    ratios = pl.read_parquet(results / "emulator/compare/split/ratios.parquet")
    assert set(ratios["mode"]) == set(top)

    findings = (results / "emulator/findings/split.md").read_text()
    assert "the simulator's top 2 of 3 topologies by capacity per GPU" in findings
    assert (
        f"{top[0]} (simulated rank 1, " in findings and "the other one was not deployed" in findings
    )

    # nothing left to do, and nothing left running
    again = snakemake(workdir, "-n", "--cores", "1", "all")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    deadline = time.monotonic() + 15
    while live_processes(workdir, cfg["ports"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes(workdir, cfg["ports"]) == []
    for name, port in cfg["ports"].items():
        assert port_problem("127.0.0.1", port) is None, f"{name} port {port} still bound"
