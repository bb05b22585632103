"""Faults on real vLLM, each ending with one clear line, no process of vLLM's tree alive (API
server, EngineCore, Worker), every port free and no half-written file."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from servematrix.spec import config
from tests.vllm.conftest import (
    MARK,
    marked_env,
    marked_processes,
    ports_in_use,
    run_cell,
    vllm_config,
)
from tests.workflow_helpers import cell_job, copy_workflow, start_snakemake

PROGRESS = re.compile(r": \d+/\d+ done, \d+ failed, ")
"""A measured cell's progress line (servematrix.client.progress), printed every few seconds."""


def _cell_lines(output: str) -> list[str]:
    """The cell's own lines on the terminal, its progress lines left out."""
    return [
        line
        for line in output.splitlines()
        if "servematrix: cell" in line and not PROGRESS.search(line)
    ]


def _error_line(output: str) -> str:
    """The cell's one line: what run_cell.py prints for a failed cell."""
    lines = _cell_lines(output)
    assert lines, output[-3000:]
    return lines[0]


def _assert_clean(workdir: Path, cfg: dict[str, Any], cell: str, mark: str) -> None:
    deadline = time.monotonic() + 20
    while marked_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(mark) == []
    assert ports_in_use(cfg) == []
    assert not (workdir / cell).exists()
    leftovers = [p for p in (workdir / "results").rglob("*") if p.name.startswith(".")]
    assert leftovers == [], "no half-written file"


def test_a_flag_vllm_refuses_carries_vllms_own_error(vllm_cpu, tmp_path):
    _, model = vllm_cpu
    cfg = vllm_config(model, ["single"], [4], state_dir=tmp_path / "state")
    # A pair servematrix's check leaves to the server, which refuses it at start-up (a
    # max_model_len beyond the model's context no longer gets that far: check refuses it).
    cfg["defaults"].update(max_num_batched_tokens=2048, max_num_seqs=4096)
    workdir = copy_workflow(tmp_path, cfg)
    cell, result, mark = run_cell(workdir, cfg)
    assert result.returncode != 0
    line = _error_line(result.stdout + result.stderr)
    print(f"\n{line}")
    assert "single exited with code 1 during start-up: " in line
    assert "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs" in line
    _assert_clean(workdir, cfg, cell, mark)


def test_a_model_directory_that_does_not_exist(vllm_cpu, tmp_path):
    _, model = vllm_cpu
    cfg = vllm_config(model, ["single"], [4], state_dir=tmp_path / "state")
    missing = tmp_path / "no-such-model"
    cfg["models"]["tiny-qwen2"]["hf_id"] = str(missing)
    workdir = copy_workflow(tmp_path, cfg)
    cell, result, mark = run_cell(workdir, cfg)
    assert result.returncode != 0
    line = _error_line(result.stdout + result.stderr)
    print(f"\n{line}")
    assert "single exited with code 1 during start-up: " in line and str(missing) in line
    _assert_clean(workdir, cfg, cell, mark)


def test_a_port_already_taken(vllm_cpu, tmp_path):
    _, model = vllm_cpu
    cfg = vllm_config(model, ["nondisagg"], [4], state_dir=tmp_path / "state")
    port = cfg["ports"]["decode"]
    workdir = copy_workflow(tmp_path, cfg)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        cell, result, mark = run_cell(workdir, cfg)
    assert result.returncode != 0
    line = _error_line(result.stdout + result.stderr)
    print(f"\n{line}")
    assert f"port {port} (needed by decode) on 127.0.0.1 is already in use" in line
    logs = workdir / "results" / "vllm" / "logs" / "deployments"
    assert not list(logs.rglob("prefill.log")), "nothing was started"
    _assert_clean(workdir, cfg, cell, mark)


def _state(workdir: Path) -> dict[str, Any]:
    states = list((workdir / "state" / "deployments").glob("*/state.json"))
    return json.loads(states[0].read_text()) if states else {}


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "server killed"])
def test_interrupted_in_the_middle_of_a_cell(vllm_cpu, tmp_path, how):
    _, model = vllm_cpu
    cfg = vllm_config(model, ["single"], [2], num_prompts=400, state_dir=tmp_path / "state")
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0].path
    env = marked_env()
    run = start_snakemake(workdir, cell, env)
    try:
        deadline = time.monotonic() + 300
        while _state(workdir).get("status") != "ready":
            assert run.poll() is None, run.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the deployment never became ready"
            time.sleep(0.5)
        time.sleep(5)  # requests in flight
        if how == "SIGTERM":  # what Snakemake or SLURM sends a job it cancels
            os.kill(cell_job(workdir), signal.SIGTERM)
        elif how == "Ctrl-C":
            os.killpg(run.pid, signal.SIGINT)
        else:  # the API server dies (its EngineCore and Worker are left to the supervisor)
            os.kill(dict(_state(workdir)["groups"])["single"], signal.SIGKILL)
        output, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0
    if how == "server killed":
        line = _error_line(output)
        print(f"\n{line}")
        assert "single exited with code -9 while serving" in line
    else:
        lines = _cell_lines(output)
        assert lines and "interrupted" in lines[0], output[-3000:]
        print(f"\n{how}: {lines[0]}")
    _assert_clean(workdir, cfg, cell, env[MARK])
