"""The workflow on backend emulator: real deployments, warm reuse and every fault ending clean.

Each test runs `snakemake` in a scratch copy of the workflow with its own ports, and checks at
the end that no process of ours is alive, every port is free and no half-written trace is left.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from servematrix.deploy.recipes import plan
from servematrix.deploy.supervise import port_problem
from servematrix.engine.hardware import gpu_spec
from servematrix.spec import config
from tests.workflow_helpers import (
    cell_job,
    copy_workflow,
    free_port_base,
    live_processes,
    port_block,
    start_snakemake,
)

pytestmark = pytest.mark.slow

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


A100_MIB = gpu_spec("A100-SXM4-80GB").memory_gib * 1024


def _config(
    modes: list[str], qps: list[float], num_prompts: int = 6, recipe: str = "v0", **deploy: Any
) -> dict[str, Any]:
    return {
        "backend": "emulator",
        "defaults": {"num_prompts": num_prompts, "output_len": 4, "seed": 0},
        "ports": port_block(free_port_base()),
        "deploy": {"startup_timeout_s": 120, "stop_timeout_s": 10, **deploy},
        "models": {
            MODEL: {
                "hf_id": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
                "architecture": "qwen2.5-7b",
                "quantization": "gptq-int4",
                "tensor_parallel": 1,
                "gpus": [[0], [4]],
            }
        },
        "studies": {
            "mooncake": {
                "recipe": recipe,
                "models": [MODEL],
                "modes": modes,
                "qps": qps,
                "input_len": [128],
            }
        },
    }


def _snakemake(
    workdir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _assert_clean(workdir: Path, cfg: dict[str, Any]) -> None:
    deadline = time.monotonic() + 15
    while live_processes(workdir, cfg["ports"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes(workdir, cfg["ports"]) == []
    for name, port in cfg["ports"].items():
        assert port_problem("127.0.0.1", port) is None, f"{name} port {port} still bound"
    leftovers = [p for p in (workdir / "results").rglob("*") if p.name.startswith(".")]
    assert leftovers == [], "no half-written file"


def _traces(workdir: Path) -> dict[str, tuple[Any, dict[str, Any]]]:
    out = {}
    for path in sorted((workdir / "results" / "emulator" / "cells").rglob("*.parquet")):
        table = pq.read_table(path)
        meta = json.loads(next(iter(table.schema.metadata.values())))
        out[str(path.relative_to(workdir))] = (table, meta)
    return out


def test_study_runs_every_mode_and_starts_each_deployment_once(tmp_path):
    cfg = _config(["single", "nondisagg", "chunked"], [2, 4, 6, 8])
    workdir = copy_workflow(tmp_path, cfg)
    result = _snakemake(workdir, "all")
    assert result.returncode == 0, result.stderr[-3000:]
    traces = _traces(workdir)
    assert len(traces) == 12
    cells = {c.path: c for c in config.load(cfg).all_cells()}
    started: dict[str, list[str]] = {}
    for path, (table, meta) in traces.items():
        deployment = meta["deployment"]
        assert table.column("success").to_pylist() == [True] * table.num_rows
        started.setdefault(deployment["fingerprint"], []).append(deployment["started"])
        assert deployment["startup_s"] > 0
        # exactly the argv, environment and ports the vllm backend would use, bar the executable
        real = plan(cells[path], "vllm").resolve(".")
        for emulated, vllm in zip(deployment["processes"], real.processes, strict=True):
            assert emulated["env"] == dict(vllm.env) and emulated["port"] == vllm.port
            if vllm.name == "proxy":
                assert emulated["argv"] == list(vllm.argv)
            else:
                assert emulated["argv"][:2] == ["servematrix-emulator", "serve"]
                assert emulated["argv"][2 : len(vllm.argv) - 1] == list(vllm.argv[3:])
    assert len(started) == 3
    for fingerprint, kinds in started.items():
        assert sorted(kinds) == ["fresh", "reused", "reused", "reused"], fingerprint
    for _, meta in traces.values():
        memory_use = meta["memory"]
        assert memory_use["peak_gpu_memory_mib"] == pytest.approx(A100_MIB * 0.8, abs=0.1)
        # sampled from every instance's /metrics (a short cell may find its cache empty)
        assert all(memory_use["kv_cache_usage"].values())
        assert 0 <= memory_use["peak_kv_cache_usage"] < 1
        # the modelled weights and KV pool of the engine the emulator runs
        assert 0 < memory_use["weights_mib_per_gpu"] < memory_use["peak_gpu_memory_mib"]
        assert memory_use["kv_pool_blocks"] > 0 and memory_use["kv_pool_mib_per_gpu"] > 0
    summary = pq.read_table(workdir / "results/emulator/summary/mooncake.parquet")
    assert None not in summary.column("peak_kv_cache_usage").to_pylist()
    assert None not in summary.column("peak_gpu_memory_mib").to_pylist()
    assert "servematrix: stopped deployment" in result.stdout + result.stderr
    _assert_clean(workdir, cfg)


def test_disaggregated_modes_on_both_recipes_with_a_real_etcd(tmp_path):
    cfg = _config(["mooncake-rdma", "mooncake-tcp"], [4, 8])
    cfg["studies"]["mooncake-v1"] = {**cfg["studies"]["mooncake"], "recipe": "v1"}
    workdir = copy_workflow(tmp_path, cfg)
    result = _snakemake(workdir, "all")
    assert result.returncode == 0, result.stderr[-3000:]
    traces = _traces(workdir)
    assert len(traces) == 8
    started: dict[str, list[str]] = {}
    for path, (table, meta) in traces.items():
        deployment = meta["deployment"]
        assert all(table.column("success").to_pylist()), path
        names = [p["name"] for p in deployment["processes"]]
        if "/v0/" in path:
            assert names == ["etcd", "prefill", "decode", "proxy"]
            assert json.loads(deployment["files"]["mooncake.json"])["protocol"] in path
        else:
            assert names == ["prefill", "decode", "proxy"]
        started.setdefault(deployment["fingerprint"], []).append(deployment["started"])
    assert sorted(map(sorted, started.values())) == [["fresh", "reused"]] * 4
    # the v0 instances registered their transfer-engine segments in the deployment's etcd
    logs = workdir / "results/emulator/logs/deployments/v0"
    for role in ("prefill", "decode"):
        for log in logs.glob(f"*/mooncake-*/{role}.log"):
            assert "registered at etcd http://127.0.0.1:" in log.read_text(), log
    _assert_clean(workdir, cfg)


def test_a_single_requested_cell_starts_measures_and_stops(tmp_path):
    cfg = _config(["chunked"], [4, 8])
    workdir = copy_workflow(tmp_path, cfg)
    cell = next(c for c in config.load(cfg).all_cells() if c.workload.qps == 8)
    result = _snakemake(workdir, cell.path)
    assert result.returncode == 0, result.stderr[-3000:]
    ((table, meta),) = _traces(workdir).values()
    assert meta["deployment"]["started"] == "fresh"
    assert table.num_rows == 7  # one warm-up + six measured
    _assert_clean(workdir, cfg)


def _one_cell(tmp_path: Path, mode: str = "single", **deploy: Any) -> tuple[Path, dict, str]:
    cfg = _config([mode], [4], **deploy)
    workdir = copy_workflow(tmp_path, cfg)
    return workdir, cfg, config.load(cfg).all_cells()[0].path


def _assert_failed(result, workdir, cfg, cell_path, *messages: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for message in messages:
        assert message in output, output[-3000:]
    assert not (workdir / cell_path).exists()
    _assert_clean(workdir, cfg)


def test_a_server_that_dies_at_start_up(tmp_path):
    cfg = _config(["single"], [4])
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0].path
    # A setting the server refuses: it exits at start (argparse's status 2), as vLLM would.
    result = _snakemake(workdir, cell, env={"SERVEMATRIX_EMULATOR_FAIL_FRACTION": "2"})
    _assert_failed(
        result,
        workdir,
        cfg,
        cell,
        "single exited with code 2 during start-up",
        "--fail-fraction and --drop-fraction must be in [0, 1]",
    )


def test_a_server_that_never_becomes_healthy(tmp_path):
    workdir, cfg, cell = _one_cell(tmp_path, startup_timeout_s=3)
    env = {"SERVEMATRIX_EMULATOR_STARTUP_DELAY_S": "300"}
    result = _snakemake(workdir, cell, env=env)
    _assert_failed(result, workdir, cfg, cell, "single did not become healthy at", "within 3 s")


def test_a_port_already_taken(tmp_path):
    workdir, cfg, cell = _one_cell(tmp_path, "nondisagg")
    port = cfg["ports"]["decode"]
    with socket.socket() as holder:
        # As a server binds: the port may still be in TIME_WAIT from an earlier test's block.
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = _snakemake(workdir, cell)
    _assert_failed(result, workdir, cfg, cell, f"port {port} (needed by decode)", "in use")


def test_a_gpu_lock_held_by_another_cell(tmp_path):
    workdir, cfg, cell = _one_cell(tmp_path, gpu_lock_timeout_s=2)
    locks = workdir / ".servematrix" / "emulator" / socket.gethostname() / "gpu-locks"
    locks.mkdir(parents=True)
    (locks / "gpu0.holder").write_text("pid 99: results/emulator/cells/other.parquet\n")
    fd = os.open(locks / "gpu0.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        result = _snakemake(workdir, cell)
    finally:
        os.close(fd)
    _assert_failed(
        result, workdir, cfg, cell, "GPU 0 is locked by pid 99: results/emulator/cells/other"
    )


def test_an_instance_crashing_in_the_middle_of_a_cell(tmp_path):
    workdir, cfg, cell = _one_cell(tmp_path)
    result = _snakemake(workdir, cell, env={"SERVEMATRIX_EMULATOR_DIE_AFTER_REQUESTS": "3"})
    _assert_failed(result, workdir, cfg, cell, "single exited with code", "while serving")


def test_a_request_failure_inside_a_cell_is_a_row(tmp_path):
    workdir, cfg, cell = _one_cell(tmp_path)
    result = _snakemake(workdir, cell, env={"SERVEMATRIX_EMULATOR_FAIL_FRACTION": "0.5"})
    assert result.returncode == 0, result.stderr[-3000:]
    ((table, _),) = _traces(workdir).values()
    rows = table.to_pylist()
    failed = [r for r in rows if not r["success"]]
    assert 0 < len(failed) < len(rows)
    assert all(r["error"] for r in failed)
    _assert_clean(workdir, cfg)


def _pid_with(text: str) -> int:
    """The pid of the live process whose command line contains ``text``."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmd + " ":
            return int(proc.name)
    raise AssertionError(f"no process with {text!r}")


@pytest.mark.parametrize(
    "how", ["SIGTERM", "Ctrl-C", "SIGINT to Snakemake", "decode crash", "etcd death"]
)
def test_interrupted_in_the_middle_of_a_cell(tmp_path, how):
    mode = "mooncake-tcp" if how in ("decode crash", "etcd death") else "nondisagg"
    cfg = _config([mode], [2], num_prompts=400)  # ~200 s of requests
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0].path
    run = start_snakemake(workdir, cell)
    log = workdir / cell.replace("/cells/", "/logs/").replace(".parquet", ".log")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if log.is_file() and "fresh" in log.read_text():
            break
        assert run.poll() is None, run.stdout.read()[-3000:]
        time.sleep(0.5)
    else:
        pytest.fail("the deployment never started")
    time.sleep(3)  # requests in flight
    if how == "SIGTERM":
        # What Snakemake (or SLURM) does to a job it cancels: SIGTERM to the cell's process.
        # (SIGTERM to Snakemake itself only makes it wait for the running job to finish.)
        os.kill(cell_job(workdir), signal.SIGTERM)
    elif how == "Ctrl-C":
        os.killpg(run.pid, signal.SIGINT)
    elif how == "SIGINT to Snakemake":  # kill -INT: Snakemake alone, not its jobs
        os.kill(run.pid, signal.SIGINT)
    elif how == "decode crash":
        os.kill(_pid_with(f"--port {cfg['ports']['decode']} "), signal.SIGKILL)
    else:
        os.kill(_pid_with(f"http://127.0.0.1:{cfg['ports']['etcd']} "), signal.SIGKILL)
    try:
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0
    assert not (workdir / cell).exists(), output[-3000:]
    if how in ("SIGTERM", "Ctrl-C", "SIGINT to Snakemake"):
        line = r"interrupted \(signal SIG(TERM|INT)\); nothing was written"
        assert re.search(line, output), output[-4000:]
        assert "ignored due to race condition" not in output, output[-4000:]
    if how == "decode crash":
        assert "decode exited with code -9 while serving" in output, output[-3000:]
    if how == "etcd death":
        assert "etcd exited with code -9 while serving" in output, output[-3000:]
    _assert_clean(workdir, cfg)


def test_backend_external_measures_a_running_server_and_starts_nothing(tmp_path):
    port = free_port_base() + 10
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servematrix.emulator",
            "serve",
            "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        cfg = _config(["single"], [4])
        cfg.update(backend="external", base_url=f"http://127.0.0.1:{port}/v1")
        workdir = copy_workflow(tmp_path, cfg)
        cell = config.load(cfg).all_cells()[0].path
        assert cell.startswith("results/external/")
        result = _snakemake(workdir, cell)
        assert result.returncode == 0, result.stderr[-3000:]
        table = pq.read_table(workdir / cell)
        meta = json.loads(next(iter(table.schema.metadata.values())))
        assert meta["deployment"]["started"] == "external"
        assert all(table.column("success").to_pylist())
        assert not (workdir / ".servematrix").exists(), "no deployment, no GPU lock"
        assert server.poll() is None, "the user's server is left alone"
    finally:
        server.terminate()
        server.wait()


def test_backend_external_on_a_closed_port_says_what_it_waits_for(tmp_path):
    """First, on the terminal: what is waited for, where and how long; a port that refuses
    every connection ends the cell after deploy.refused_timeout_s, not startup_timeout_s (the
    line that ends it says which)."""
    port = free_port_base() + 10
    cfg = _config(["single"], [4], refused_timeout_s=3)
    cfg.update(backend="external", base_url=f"http://127.0.0.1:{port}/v1")
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0].path
    result = _snakemake(workdir, cell)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("servematrix:")]
    url = f"http://127.0.0.1:{port}"
    assert lines[0] == (
        f"servematrix: waiting up to 120 s (3 s if its port refuses connections) for GET "
        f"{url}/health to answer"
    )
    assert lines[1].startswith(
        f"servematrix: cell {cell}: nothing listens at {url}: every connection refused for 3 s"
    )
    assert not (workdir / cell).exists()


def test_backend_vllm_checks_the_pins_against_nvidia_smi(tmp_path):
    cfg = _config(["single"], [4], state_dir=str(tmp_path / "state"))
    cfg["backend"] = "vllm"
    has_gpus = shutil.which("nvidia-smi") is not None
    if has_gpus:  # a GPU machine: pin one that no node has
        cfg["models"][MODEL]["gpus"] = [[63]]
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0].path
    result = _snakemake(workdir, cell)
    assert result.returncode != 0
    expected = (
        f"models.{MODEL}.gpus pins GPU(s) [63] but nvidia-smi lists"
        if has_gpus
        else "backend vllm needs nvidia-smi to check the pinned GPUs"
    )
    assert expected in result.stderr, result.stderr[-3000:]
    assert not (workdir / cell).exists()
    assert not (tmp_path / "state" / "deployments").exists(), "nothing was started"
