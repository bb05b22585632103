"""Advisory locks on pinned GPU ids (or CPU cores, on a CPU node), so cells on overlapping
pins never overlap in time.

One lock file per GPU id (``flock``), taken in sorted order so two cells can never hold one
GPU each while waiting for the other's. The kernel drops a lock when its holder dies, so a
killed cell never leaves a GPU locked. A side file names the holder for the error message.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

from servematrix.deploy.supervise import DeployError

POLL_S = 0.2


def flock_before(fd: int, deadline: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, polling until the monotonic ``deadline``; False
    when another process still holds it then."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)


PIN_NAMES = {"gpu": "GPU", "cpu": "CPU core"}


class GpuLocks:
    """Context manager holding the locks of ``gpus`` (waits up to ``timeout_s`` for them);
    ``kind`` ``cpu``: the pins are CPU cores, locked the same way under other file names."""

    def __init__(
        self,
        gpus: tuple[int, ...],
        lock_dir: Path,
        timeout_s: float,
        holder: str,
        kind: str = "gpu",
    ):
        self.gpus = tuple(sorted(set(gpus)))
        self.lock_dir = Path(lock_dir)
        self.timeout_s = timeout_s
        self.holder = holder
        self.kind = kind
        self._fds: list[int] = []

    def __enter__(self) -> GpuLocks:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout_s
        try:
            for gpu in self.gpus:
                self._fds.append(self._take(gpu, deadline))
        except BaseException:
            self.release()
            raise
        return self

    def _take(self, gpu: int, deadline: float) -> int:
        path = self.lock_dir / f"{self.kind}{gpu}.lock"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
        if not flock_before(fd, deadline):
            os.close(fd)
            raise DeployError(
                f"{PIN_NAMES[self.kind]} {gpu} is locked by {self._holder_of(gpu)} ({path}); "
                f"waited {self.timeout_s:g} s (deploy.gpu_lock_timeout_s)"
            )
        holder = self.lock_dir / f"{self.kind}{gpu}.holder"
        holder.write_text(f"pid {os.getpid()}: {self.holder}\n")
        return fd

    def _holder_of(self, gpu: int) -> str:
        try:
            holder = self.lock_dir / f"{self.kind}{gpu}.holder"
            return holder.read_text().strip() or "another process"
        except OSError:
            return "another process"

    def release(self) -> None:
        for fd in reversed(self._fds):
            os.close(fd)  # closing drops the flock
        self._fds = []

    def __exit__(self, *exc: object) -> None:
        self.release()


def visible_gpus() -> set[int]:
    """GPU indices nvidia-smi lists on this host."""
    if shutil.which("nvidia-smi") is None:
        raise DeployError("backend vllm needs nvidia-smi to check the pinned GPUs; none on PATH")
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        raise DeployError(f"nvidia-smi failed: {error}") from error
    return {int(line) for line in out.split() if line.strip().isdigit()}


def check_gpus_exist(model: str, gpus: tuple[int, ...], present: set[int] | None = None) -> None:
    """A pin on a GPU the host does not have is an error, not a server that hangs at start."""
    present = visible_gpus() if present is None else present
    missing = sorted(set(gpus) - present)
    if missing:
        listed = ", ".join(str(g) for g in sorted(present)) or "none"
        raise DeployError(
            f"models.{model}.gpus pins GPU(s) {missing} but nvidia-smi lists GPU(s) {listed}"
        )


def check_cores_allowed(
    field: str, cores: tuple[int, ...], allowed: set[int] | None = None
) -> None:
    """On a CPU node: a pin (config ``field``) on a core this process may not run on
    (``sched_getaffinity``: the cores of its cgroup, taskset or Slurm allocation) is an error
    before any start."""
    allowed = os.sched_getaffinity(0) if allowed is None else allowed
    missing = sorted(set(cores) - allowed)
    if missing:
        listed = ", ".join(str(c) for c in sorted(allowed)) or "none"
        raise DeployError(
            f"{field} pins CPU core(s) {missing} but this process may run only on "
            f"core(s) {listed} (node.kind: cpu)"
        )
