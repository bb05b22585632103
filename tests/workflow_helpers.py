"""Run the real workflow in a scratch copy of the repository (Snakefile, rules, scripts, ...)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from servematrix.deploy.supervise import port_problem

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW_PARTS = (
    "Snakefile",
    "rules",
    "scripts",
    "report",
    "profiles",
    "envs",
    "config/schema.yaml",
)


def copy_workflow(dest: Path, config: dict[str, Any]) -> Path:
    for part in WORKFLOW_PARTS:
        source = ROOT / part
        target = dest / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
    write_config(dest, config)
    return dest


def write_config(workdir: Path, config: dict[str, Any]) -> None:
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def snakemake(workdir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Parse the 'Job stats' table of a dry run into {rule: count}."""
    jobs: dict[str, int] = {}
    lines = result.stdout.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Job stats:"))
    except StopIteration:
        return jobs
    for line in lines[start + 3 :]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        if parts[0] != "total":
            jobs[parts[0]] = int(parts[1])
    return jobs


def cell_job(workdir: Path) -> int:
    """The pid of the Snakemake job running scripts/run_cell.py in ``workdir``."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            if b"run_cell.py" in cmd and Path(os.readlink(proc / "cwd")) == workdir:
                return int(proc.name)
        except (OSError, ValueError):
            continue
    raise AssertionError("no cell job running")


def start_snakemake(
    workdir: Path, target: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``snakemake --cores 1 target`` in the background, in its own process group: a
    "Ctrl-C" (SIGINT to the group) reaches Snakemake and its job only."""
    return subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1", target],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def live_processes(workdir: Path, ports: dict[str, int]) -> list[str]:
    """Command lines of live processes started for this workdir or on its ports."""
    marks = [str(workdir)] + [f"--port {p} " for p in ports.values()]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if state != "Z" and any(mark in cmd + " " for mark in marks):
            found.append(f"{proc.name}: {cmd[:160]}")
    return found


def free_port_base() -> int:
    """A block of 1000 ports whose every port a test deployment may bind is free now (each
    test has its own), below the kernel's ephemeral range (32768+) so no client connection
    can be holding one."""
    for _ in range(100):
        base = random.randrange(10000, 31000, 1000)
        ports = set(port_block(base).values())
        ports |= {port_block(base)["etcd"] + 1}  # etcd's peer port
        ports |= {port_block(base)["mooncake"] + d for d in range(0, 120)}  # transfer engines
        ports |= {port_block(base)["bootstrap"] + d for d in range(8)}
        # xPyD and replicas: instance k of a role listens on the role's port + k
        ports |= {
            port_block(base)[r] + d for r in ("prefill", "decode", "single") for d in range(8)
        }
        if all(port_problem("127.0.0.1", p) is None for p in ports):
            return base
    raise RuntimeError("no free port block")


def port_block(base: int) -> dict[str, int]:
    """The ``ports:`` of a test deployment in the block at ``base``."""
    return {
        "proxy": base + 90,
        "prefill": base + 100,
        "decode": base + 200,
        "single": base + 997,
        "etcd": base + 379,
        "bootstrap": base + 800,
        "mooncake": base + 503,
    }
