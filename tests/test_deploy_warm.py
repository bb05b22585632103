"""Warm deployments: reuse by fingerprint, stop on conflict, idle watchdog, dead processes."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from servematrix.deploy import warm
from servematrix.deploy.processes import Plan, Process
from servematrix.deploy.supervise import DeployError, port_problem
from servematrix.engine.hardware import gpu_spec
from tests.test_deploy_supervise import _server, free_port

A100_MIB = gpu_spec("A100-SXM4-80GB").memory_gib * 1024


def _plan(fingerprint: str, port: int, gpus: tuple[int, ...]) -> Plan:
    server = _server("single", port)
    process = Process(server.name, server.argv, server.env, port, server.health, gpus)
    return Plan(
        "emulator", "v1", "m", "single", (process,), f"http://127.0.0.1:{port}/v1", fingerprint
    )


def _settings(idle_timeout_s: float = 600) -> warm.Settings:
    return warm.Settings("127.0.0.1", 20, 3, idle_timeout_s, 5, True)


def _wait(predicate, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def state_dir(tmp_path):
    yield tmp_path / "state"
    warm.stop_all(tmp_path / "state", 3)


def test_same_fingerprint_is_reused_and_a_conflicting_one_stopped(state_dir, tmp_path):
    port_a, port_b = free_port(), free_port()
    a = _plan("aaaa", port_a, (0,))
    lease = warm.acquire(a, state_dir, tmp_path / "logs-a", _settings())
    assert lease.fresh and lease.startup_s > 0
    lease.release()
    assert port_problem("127.0.0.1", port_a), "kept running for the next cell"
    again = warm.acquire(a, state_dir, tmp_path / "logs-a", _settings())
    assert not again.fresh and again.startup_s == lease.startup_s
    again.release()
    b = _plan("bbbb", port_b, (0, 1))  # shares GPU 0 with a
    other = warm.acquire(b, state_dir, tmp_path / "logs-b", _settings())
    assert other.fresh
    assert port_problem("127.0.0.1", port_a) is None, "a was stopped to free GPU 0"
    assert warm.read_state(state_dir / "deployments" / "aaaa")["status"] == "stopped"
    other.release(keep=False)
    assert port_problem("127.0.0.1", port_b) is None


def test_idle_watchdog_stops_an_unused_deployment(state_dir, tmp_path):
    port = free_port()
    lease = warm.acquire(_plan("idle", port, (3,)), state_dir, tmp_path / "logs", _settings(1))
    time.sleep(2)
    assert port_problem("127.0.0.1", port), "held by a cell: never idle"
    lease.release()
    run_dir = state_dir / "deployments" / "idle"
    assert _wait(lambda: warm.read_state(run_dir).get("status") == "stopped")
    assert warm.read_state(run_dir)["reason"] == "idle"
    assert _wait(lambda: port_problem("127.0.0.1", port) is None)


def test_a_deleted_deployment_directory_stops_the_deployment(state_dir, tmp_path):
    port = free_port()
    lease = warm.acquire(_plan("gone", port, (5,)), state_dir, tmp_path / "logs", _settings())
    pid = warm.read_state(lease.run_dir)["supervisor_pid"]
    lease.release()
    shutil.rmtree(state_dir)
    assert _wait(lambda: not warm.pid_alive(pid))
    assert _wait(lambda: port_problem("127.0.0.1", port) is None)


def test_a_process_dying_while_warm_is_reported_to_the_next_cell(state_dir, tmp_path):
    port = free_port()
    plan = _plan("dies", port, (6,))
    lease = warm.acquire(plan, state_dir, tmp_path / "logs", _settings())
    pgid = warm.read_state(lease.run_dir)["groups"][0][1]
    os.killpg(pgid, signal.SIGKILL)
    problem = lease.problem()
    assert problem.startswith("single exited with code -9 while serving")
    lease.release(keep=False)
    # the next cell starts it afresh
    again = warm.acquire(plan, state_dir, tmp_path / "logs", _settings())
    assert again.fresh
    again.release(keep=False)


def test_a_failed_start_raises_and_leaves_nothing(state_dir, tmp_path):
    port = free_port()
    plan = _plan("bad", port, (7,))
    broken = Process(
        "single", ("python3", "-c", "raise SystemExit(4)"), {}, port, plan.processes[0].health
    )
    plan = Plan("emulator", "v1", "m", "single", (broken,), plan.base_url, "bad")
    with pytest.raises(DeployError, match="single exited with code 4 during start-up"):
        warm.acquire(plan, state_dir, tmp_path / "logs", _settings())
    state = warm.read_state(state_dir / "deployments" / "bad")
    assert state["status"] == "failed"
    assert not warm.pid_alive(state["supervisor_pid"])
    assert Path(tmp_path / "logs" / "supervisor.log").is_file()


def test_memory_is_modelled_on_the_emulator_and_measured_or_explained_on_vllm(tmp_path):
    from servematrix.deploy import memory

    plan = _plan("mem", free_port(), (2, 3))
    with memory.sampled(
        plan, real_gpus=False, modelled_gpu="A100-SXM4-80GB", gpu_memory_utilization=0.8
    ) as modelled:
        pass
    assert modelled["peak_gpu_memory_mib"] == pytest.approx(A100_MIB * 0.8, abs=0.1)
    assert set(modelled["gpus"]) == {"2", "3"}
    with memory.sampled(
        plan, real_gpus=True, modelled_gpu="A100-SXM4-80GB", gpu_memory_utilization=0.8
    ) as measured:
        time.sleep(0.6)
    assert measured["gpu_memory_source"] == "nvml"
    if "gpu_memory_error" in measured:  # no NVML on this host: why, and no invented number
        assert measured["peak_gpu_memory_mib"] is None
    else:
        assert measured["peak_gpu_memory_mib"] > 0
