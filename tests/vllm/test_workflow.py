"""The workflow with ``backend: vllm`` on a CPU node: single, nondisagg (two instances behind the
round-robin proxy, one core each) and chunked, each deployment serving two QPS values."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from servematrix.spec import config
from tests.vllm.conftest import (
    MARK,
    marked_env,
    marked_processes,
    ports_in_use,
    vllm_config,
)
from tests.workflow_helpers import copy_workflow

MODES = ["single", "nondisagg", "chunked"]


@pytest.fixture(scope="module")
def workflow(vllm_cpu, tmp_path_factory) -> dict[str, Any]:
    """One Snakemake run of the three modes at QPS 4 and 8 (8 prompts each)."""
    _, model = vllm_cpu
    workdir = tmp_path_factory.mktemp("vllm-workflow")
    cfg = vllm_config(model, MODES, [4, 8], state_dir=workdir / "state")
    copy_workflow(workdir, cfg)
    env = marked_env()
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "results/vllm/summary/cpu.parquet"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    elapsed_s = time.monotonic() - began
    left = marked_processes(env[MARK])
    cells = [c.path for c in config.load(cfg).all_cells()]
    return {
        "result": result,
        "workdir": workdir,
        "cfg": cfg,
        "cells": cells,
        "left": left,
        "elapsed_s": elapsed_s,
    }


def _trace(workdir: Path, cell: str) -> tuple[Any, dict[str, Any]]:
    table = pq.read_table(workdir / cell)
    return table, json.loads(next(iter(table.schema.metadata.values())))


def test_every_cell_completes_with_no_failed_row(workflow):
    result = workflow["result"]
    assert result.returncode == 0, result.stderr[-4000:]
    for cell in workflow["cells"]:
        table, _ = _trace(workflow["workdir"], cell)
        assert table.num_rows == 9  # one warm-up + 8
        assert all(table.column("success").to_pylist()), cell
        assert table.column("completion_tokens").to_pylist() == [16] * 9, cell


def test_trace_tokens_equal_the_servers_own_counters(workflow):
    for cell in workflow["cells"]:
        table, meta = _trace(workflow["workdir"], cell)
        served = meta["memory"]["server_tokens"]
        assert sum(s["generation_tokens"] for s in served.values()) == sum(
            table.column("completion_tokens").to_pylist()
        ), cell
        assert sum(s["prompt_tokens"] for s in served.values()) == sum(
            table.column("prompt_tokens").to_pylist()
        ), cell
        if "nondisagg" in cell or "chunked" in cell:  # round robin: both instances served
            assert all(s["generation_tokens"] > 0 for s in served.values()), served


def test_one_start_per_deployment_on_its_cores(workflow):
    started: dict[str, list[str]] = {}
    for cell in workflow["cells"]:
        _, meta = _trace(workflow["workdir"], cell)
        deployment = meta["deployment"]
        started.setdefault(deployment["fingerprint"], []).append(deployment["started"])
        servers = [p for p in deployment["processes"] if p["name"] != "proxy"]
        binds = [p["env"]["VLLM_CPU_OMP_THREADS_BIND"] for p in servers]
        assert binds == (["0"] if "/single/" in cell else ["0", "1"])
        assert all("CUDA_VISIBLE_DEVICES" not in p["env"] for p in servers)
        assert all(p["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1" for p in servers)
        chunked = "/chunked/" in cell
        assert ("--enable-chunked-prefill" in servers[0]["argv"]) == chunked
        memory = meta["memory"]
        assert memory["peak_gpu_memory_mib"] is None
        for name in (p["name"] for p in servers):  # API server + EngineCore + Worker: > 1 GiB
            assert memory["instances_rss"][name]["peak_rss_mib"] > 1024
        assert 0 <= memory["peak_kv_cache_usage"] <= 1
    assert sorted(sorted(s) for s in started.values()) == [["fresh", "reused"]] * 3


def test_nothing_is_left_running(workflow):
    assert workflow["left"] == []
    assert ports_in_use(workflow["cfg"]) == []
    print(f"\nworkflow of 6 cells on real vLLM: {workflow['elapsed_s']:.0f} s")
