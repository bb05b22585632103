"""Warm deployments: started once, reused by every cell with the same fingerprint.

A deployment is owned by a small supervisor process (``python -m servematrix.deploy.warm
DIR``) in its own session, so it outlives the cell that started it. Its directory
``{state_dir}/deployments/{fingerprint}/`` holds ``plan.json`` (what to run), ``state.json``
(starting / ready / failed / stopped, the supervisor's pid, each process group) and
``lease.lock``, an advisory lock held by the cell using the deployment; the lock file's mtime
is the last time a cell released it.

The supervisor stops everything (SIGTERM, then SIGKILL) when a process dies (the next cell
then gets the error with its log tail), when it is told to (SIGTERM/SIGINT/SIGHUP), and by
itself when nobody has held the lease for ``idle_timeout_s``: nothing outlives a killed
workflow for long. Cells take GPU locks first (``gpulock``), then stop any other deployment
that pins one of their GPUs or binds one of their ports, then reuse or start their own.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servematrix.common.signals import ignore_further
from servematrix.common.terminal import TERMINAL, WAIT_REPORT_S
from servematrix.deploy.gpulock import flock_before
from servematrix.deploy.processes import Plan
from servematrix.deploy.recipes import DEFAULT_DEPLOY, RECIPES
from servematrix.deploy.supervise import (
    DeployError,
    Deployment,
    group_alive,
    healthy,
    log_tail,
    reset_prefix_caches,
    stop_groups,
    wait_quiet,
)
from servematrix.spec.matrix import Cell

log = logging.getLogger(__name__)
WATCH_S = 0.5
QUIET_TIMEOUT_S = 60.0
ACTIVE = ("starting", "ready")


@dataclass(frozen=True)
class Settings:
    host: str
    startup_timeout_s: float
    stop_timeout_s: float
    idle_timeout_s: float
    lease_timeout_s: float
    warm: bool


def settings_for(cell: Cell, machine_wide: bool = False) -> tuple[Settings, Path, Path]:
    """A cell's deploy settings, its state directory (GPU locks, registered deployments) and
    the log directory of its deployment. ``machine_wide``: the deployment runs on the node's
    own GPUs, whose locks every workflow on the host shares."""
    deploy = {**DEFAULT_DEPLOY, **dict(cell.deploy)}
    settings = Settings(
        host=deploy["host"],
        startup_timeout_s=float(deploy["startup_timeout_s"]),
        stop_timeout_s=float(deploy["stop_timeout_s"]),
        idle_timeout_s=float(deploy["idle_timeout_s"]),
        lease_timeout_s=float(deploy["gpu_lock_timeout_s"]),
        warm=bool(deploy["warm"]),
    )
    if deploy["state_dir"]:
        state_dir = Path(deploy["state_dir"])
    elif machine_wide:
        # Real GPUs are a machine-wide resource: every workflow on the host shares the locks.
        state_dir = Path(tempfile.gettempdir()) / f"servematrix-{os.getuid()}"
    else:
        # Per host: on a cluster the working directory is shared, GPU ids and pids are not.
        state_dir = Path(".servematrix") / cell.backend / socket.gethostname()
    return settings, state_dir, Path("results") / cell.backend / "logs" / "deployments"


def log_dir_for(plan: Plan, logs: Path) -> Path:
    return logs / plan.recipe / plan.model / f"{plan.mode}-{plan.fingerprint}"


def _write_json(path: Path, document: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)


def read_state(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return {}


_CHILDREN: dict[int, subprocess.Popen] = {}
"""Supervisors this process spawned: polled so an exited one is reaped, not a zombie."""


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie answers kill(0) but runs nothing
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def _groups(state: dict[str, Any]) -> list[tuple[str, int, None]]:
    return [(name, pgid, None) for name, pgid in reversed(state.get("groups", []))]


def is_active(run_dir: Path) -> bool:
    state = read_state(run_dir)
    if state.get("status") in ACTIVE and pid_alive(state.get("supervisor_pid")):
        return True
    return any(group_alive(pgid) for _, pgid, _ in _groups(state))


@contextlib.contextmanager
def lease(run_dir: Path, timeout_s: float, what: str) -> Iterator[int]:
    """Hold the deployment's lease lock (blocking up to ``timeout_s``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / "lease.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        if not flock_before(fd, time.monotonic() + timeout_s):
            raise DeployError(
                f"{what}: deployment {run_dir.name} stayed in use by another cell for "
                f"{timeout_s:g} s"
            )
        yield fd
    finally:
        os.close(fd)


def stop_deployment(run_dir: Path, stop_timeout_s: float) -> None:
    """Stop a deployment whoever started it; returns when its processes are gone."""
    state = read_state(run_dir)
    if state.get("host", socket.gethostname()) != socket.gethostname():
        # Its pids mean nothing here: the node's own job stops it (or its idle watchdog).
        return
    pid = state.get("supervisor_pid")
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        # The supervisor itself waits stop_timeout_s per group before SIGKILL.
        deadline = time.monotonic() + stop_timeout_s * 2 + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # Whatever a dead (or SIGKILLed) supervisor left behind.
    state = read_state(run_dir)
    leftovers = [g for g in _groups(state) if group_alive(g[1])]
    if leftovers:
        stop_groups(leftovers, stop_timeout_s)
    if state and state.get("status") in ACTIVE:
        _write_json(run_dir / "state.json", {**state, "status": "stopped", "reason": "stopped"})


def stop_all(state_dir: Path, stop_timeout_s: float = 30.0) -> list[str]:
    """Stop every deployment registered under ``state_dir`` (the workflow's end)."""
    stopped = []
    for run_dir in sorted((Path(state_dir) / "deployments").glob("*")):
        if run_dir.is_dir() and is_active(run_dir):
            stop_deployment(run_dir, stop_timeout_s)
            stopped.append(run_dir.name)
    return stopped


def _conflicts(plan: Plan, other: Plan) -> bool:
    ports = {p for process in plan.processes for p in process.ports}
    other_ports = {p for process in other.processes for p in process.ports}
    return bool(set(plan.gpus) & set(other.gpus) or ports & other_ports)


@dataclass
class Lease:
    """A cell's use of a running deployment."""

    plan: Plan
    run_dir: Path
    fresh: bool
    startup_s: float
    fd: int
    settings: Settings

    @property
    def base_url(self) -> str:
        return self.plan.base_url

    def problem(self) -> str | None:
        """Why the deployment is no longer serving (a process died), if it is not."""
        # The supervisor notices a dead process within WATCH_S; give it the time to say so.
        time.sleep(WATCH_S * 2)
        state = read_state(self.run_dir)
        if state.get("status") == "ready" and pid_alive(state.get("supervisor_pid")):
            return None
        return state.get("error") or f"deployment {self.run_dir.name} is {state.get('status')}"

    @contextlib.contextmanager
    def watched(self) -> Iterator[None]:
        """Abort the caller (main thread) with DeployError as soon as the supervisor reports
        a dead process, instead of measuring a broken deployment until the schedule ends."""
        stop = threading.Event()
        failure: list[str] = []

        def watch() -> None:
            while not stop.wait(WATCH_S):
                state = read_state(self.run_dir)
                if state.get("status") != "ready" or not pid_alive(state.get("supervisor_pid")):
                    failure.append(state.get("error") or f"deployment {self.run_dir.name} stopped")
                    _thread.interrupt_main(signal.SIGUSR1)
                    return

        def on_failure(signum: int, frame: Any) -> None:
            raise DeployError(failure[0] if failure else "deployment failed")

        previous = signal.signal(signal.SIGUSR1, on_failure)
        thread = threading.Thread(target=watch, name="deployment-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            signal.signal(signal.SIGUSR1, previous)

    def stop(self) -> None:
        stop_deployment(self.run_dir, self.settings.stop_timeout_s)

    def release(self, keep: bool = True) -> None:
        """Hand the deployment back (its idle clock starts now), or stop it."""
        if not keep or not self.settings.warm:
            self.stop()
        os.utime(self.run_dir / "lease.lock")
        os.close(self.fd)
        self.fd = -1


def acquire(plan: Plan, state_dir: Path, log_dir: Path, settings: Settings) -> Lease:
    """The running deployment for ``plan``: reused if one with its fingerprint is ready,
    else started (after stopping deployments that pin the same GPUs or bind the same ports).
    Call with the plan's GPU locks held."""
    state_dir = Path(state_dir).resolve()
    run_dir = state_dir / "deployments" / plan.fingerprint
    for other_dir in sorted((state_dir / "deployments").glob("*")):
        if other_dir == run_dir or not other_dir.is_dir() or not is_active(other_dir):
            continue
        try:
            other = Plan.from_dict(json.loads((other_dir / "plan.json").read_text())["plan"])
        except (OSError, ValueError, KeyError):
            continue
        if _conflicts(plan, other):
            with lease(other_dir, settings.lease_timeout_s, "stopping a conflicting deployment"):
                stop_deployment(other_dir, settings.stop_timeout_s)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / "lease.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        _lock(fd, run_dir, settings.lease_timeout_s)
        state = read_state(run_dir)
        if (
            state.get("status") == "ready"
            and pid_alive(state.get("supervisor_pid"))
            and healthy(plan.processes[-1].health.url)
            # A quiet server with an empty prefix cache starts each cell from the same state;
            # one still busy with a previous cell's requests, or one whose cache cannot be
            # emptied, is restarted.
            and wait_quiet(plan.processes, QUIET_TIMEOUT_S)
            and prefix_cache_empty(plan)
        ):
            return Lease(plan, run_dir, False, float(state["startup_s"]), fd, settings)
        if is_active(run_dir):
            stop_deployment(run_dir, settings.stop_timeout_s)
        startup_s = _start(plan, run_dir, Path(log_dir).resolve(), settings)
        return Lease(plan, run_dir, True, startup_s, fd, settings)
    except BaseException:
        os.close(fd)
        raise


def prefix_cache_empty(plan: Plan) -> bool:
    """Whether a reused deployment's servers hold no prefix of an earlier cell: none cache
    (the default), or each emptied its cache on ``/reset_prefix_cache`` (v1; vLLM 0.6 has no
    such route, so a v0 deployment that caches prefixes is started fresh for every cell)."""
    servers = [process for process in plan.processes if process.gpus]
    if not any("--enable-prefix-caching" in process.argv for process in servers):
        return True
    if RECIPES[plan.recipe].prefix_cache_reset_env is None:
        return False
    return reset_prefix_caches(servers)


def _lock(fd: int, run_dir: Path, timeout_s: float) -> None:
    if not flock_before(fd, time.monotonic() + timeout_s):
        raise DeployError(
            f"deployment {run_dir.name} stayed in use by another cell for {timeout_s:g} s"
        )


def _start(plan: Plan, run_dir: Path, log_dir: Path, settings: Settings) -> float:
    for child in run_dir.iterdir():
        if child.name != "lease.lock":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    resolved = plan.resolve(str(run_dir))
    log_dir.mkdir(parents=True, exist_ok=True)
    _write_json(
        run_dir / "plan.json",
        {
            "plan": resolved.to_dict(),
            "log_dir": str(log_dir),
            "settings": settings.__dict__,
        },
    )
    supervisor_log = log_dir / "supervisor.log"
    with open(supervisor_log, "ab") as out:
        start = out.tell()
        popen = subprocess.Popen(
            [sys.executable, "-m", "servematrix.deploy.warm", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _CHILDREN[popen.pid] = popen
    began = reported = time.monotonic()
    names = ", ".join(p.name for p in plan.processes)
    log.info(
        "starting deployment %s (%s %s: %s): up to %g s for each process to answer its "
        "/health (deploy.startup_timeout_s); logs in %s",
        plan.fingerprint,
        plan.model,
        plan.mode,
        names,
        settings.startup_timeout_s,
        log_dir,
        extra=TERMINAL,
    )
    try:
        while True:
            if time.monotonic() - reported >= WAIT_REPORT_S:
                reported = time.monotonic()
                log.info(
                    "still starting deployment %s: %.0f s (logs in %s)",
                    plan.fingerprint,
                    reported - began,
                    log_dir,
                    extra=TERMINAL,
                )
            state = read_state(run_dir)
            if state.get("supervisor_pid") == popen.pid:
                if state["status"] == "ready":
                    return float(state["startup_s"])
                if state["status"] in ("failed", "stopped"):
                    popen.wait()
                    raise DeployError(state.get("error") or "deployment stopped during start-up")
            if popen.poll() is not None:
                raise DeployError(
                    f"deployment supervisor exited with code {popen.returncode} "
                    f"(log {supervisor_log}):\n{log_tail(supervisor_log, start)}"
                )
            time.sleep(0.1)
    except BaseException:
        # Ctrl-C / SIGTERM while starting: nothing half-started may stay behind.
        if popen.poll() is None:
            stop_deployment(run_dir, settings.stop_timeout_s)
        raise


class _Stop(Exception):
    """Raised in the supervisor by a stop signal."""


def supervise(run_dir: Path) -> int:
    """The supervisor's main loop (see the module docstring)."""
    document = json.loads((run_dir / "plan.json").read_text())
    plan = Plan.from_dict(document["plan"])
    settings = Settings(**document["settings"])
    deployment = Deployment(
        plan,
        run_dir,
        Path(document["log_dir"]),
        settings.host,
        settings.startup_timeout_s,
        settings.stop_timeout_s,
    )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    state: dict[str, Any] = {
        "status": "starting",
        "supervisor_pid": os.getpid(),
        "host": socket.gethostname(),
        "groups": [],
        "started_utc": started,
        "fingerprint": plan.fingerprint,
    }

    def write(**changes: Any) -> None:
        state.update(changes)
        state["groups"] = [[r.process.name, r.pgid] for r in deployment.running] or state["groups"]
        _write_json(run_dir / "state.json", state)

    def on_signal(signum: int, frame: Any) -> None:
        # One stop is enough: further signals must not interrupt the stopping itself.
        ignore_further((signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
        raise _Stop(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    write()
    try:
        startup_s = deployment.start(on_started=lambda _: write())
        write(status="ready", startup_s=round(startup_s, 3))
        print(f"deployment {plan.fingerprint} ready after {startup_s:.1f} s", flush=True)
        return _watch(deployment, run_dir, settings.idle_timeout_s, write)
    except _Stop as stop:
        deployment.stop()
        write(status="stopped", reason=str(stop))
        print(f"deployment {plan.fingerprint} stopped: {stop}", flush=True)
        return 0
    except DeployError as error:
        write(status="failed", error=str(error))
        print(error, flush=True)
        return 1
    except BaseException as error:
        deployment.stop()
        write(status="failed", error=f"supervisor: {type(error).__name__}: {error}")
        raise


def _watch(deployment: Deployment, run_dir: Path, idle_timeout_s: float, write: Any) -> int:
    """Serve until a process dies (1), the directory is removed or the lease idles (0)."""
    fingerprint = deployment.plan.fingerprint
    while True:
        time.sleep(WATCH_S)
        dead = deployment.dead()
        if dead is not None:
            error = (
                f"{dead.process.name} exited with code {dead.popen.returncode} while "
                f"serving (log {dead.log_path}):\n{dead.tail()}"
            )
            deployment.stop()
            write(status="failed", error=error)
            print(error, flush=True)
            return 1
        if not (run_dir / "plan.json").is_file():
            # Its directory was deleted (a scratch workdir removed): nobody can reach or
            # stop this deployment any more, so it stops itself.
            deployment.stop()
            print(f"deployment {fingerprint} stopped: {run_dir} removed", flush=True)
            return 0
        idle_fd = _idle_lease(run_dir, idle_timeout_s)
        if idle_fd is not None:
            # Holding the lease: a cell arriving now waits, then finds it stopped.
            try:
                deployment.stop()
                write(status="stopped", reason="idle")
            finally:
                os.close(idle_fd)
            print(f"deployment {fingerprint} stopped: idle", flush=True)
            return 0


def _idle_lease(run_dir: Path, idle_timeout_s: float) -> int | None:
    """The lease, locked, when nobody has held it for ``idle_timeout_s``; else None."""
    lock = run_dir / "lease.lock"
    try:
        if time.time() - lock.stat().st_mtime < idle_timeout_s:
            return None
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


if __name__ == "__main__":
    sys.exit(supervise(Path(sys.argv[1])))
