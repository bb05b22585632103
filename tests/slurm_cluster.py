"""A real SLURM cluster for a test (shared/reference/slurm-local.md), in a scratch dir: one node,
or two nodes on this one machine, each with a slurmd of its own (``slurmd -N``; Debian's
22.05 build runs several) and a loopback address of its own (:data:`NODE_ADDRESSES`), so a
job's steps run "on" either node and its processes reach each other on the nodes' addresses.

Needs root and Debian's ``slurm-wlm`` and ``munge`` packages. Everything it starts (munged if
it was not running, slurmctld, slurmd) is stopped by pid at the end; its config, state and
logs live in the given directory, on ports of its own, so a site's cluster is not touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue")
NODE_ADDRESSES = {"n1": "127.0.0.2", "n2": "127.0.0.3"}
"""The two-node cluster's node names and NodeAddr (all of 127.0.0.0/8 routes to lo)."""


def unavailable() -> str | None:
    """Why no cluster can be stood up here (None: it can). As root on Debian, missing packages
    are installed first, as the reference recipe does, so a fresh machine runs the test too."""
    if os.geteuid() != 0:
        return "SLURM test needs root (slurmd runs jobs as any user)"
    missing = _missing()
    if missing and shutil.which("apt-get"):
        _install_packages()
        missing = _missing()
    if missing:
        names = ", ".join(missing)
        return f"SLURM cannot be set up: {names} missing after apt-get install slurm-wlm munge"
    return None


def _missing() -> list[str]:
    return [
        name
        for name in DAEMONS
        if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()
    ]


def _install_packages() -> None:
    """``apt-get install slurm-wlm munge``; a failure shows as the daemons still missing."""
    quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"],
    ):
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(command, env=quiet, capture_output=True, timeout=600)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _munge_ok() -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True)
    if encoded.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True).returncode == 0


def _pid(path: Path, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        time.sleep(0.1)
    raise RuntimeError(f"no pid file {path}")


def _nodes_conf(host: str, two_nodes: bool) -> str:
    """The node and partition lines, and where each slurmd keeps its state (``%n``: per node)."""
    if not two_nodes:
        return f"""NodeName={host} CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    lines = [
        f"NodeName={name} NodeAddr={address} NodeHostname={host} Port={_free_port()} "
        f"CPUs={os.cpu_count()} RealMemory=4000 State=UNKNOWN"
        for name, address in NODE_ADDRESSES.items()
    ]
    names = ",".join(NODE_ADDRESSES)
    return "\n".join([*lines, f"PartitionName=debug Nodes={names} Default=YES State=UP", ""])


@contextlib.contextmanager
def cluster(root: Path, two_nodes: bool = False) -> Iterator[dict[str, str]]:
    """Start munged (if needed), slurmctld and slurmd (one per node); yield the environment
    for clients."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("spool/ctld", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    slurmds = list(NODE_ADDRESSES) if two_nodes else [None]
    for name in slurmds:
        (root / "spool" / f"d-{name or 'host'}").mkdir(parents=True, exist_ok=True)
    per_node = "%n" if two_nodes else "host"
    host = socket.gethostname()
    # The default path: srun inside a job finds no other (SLURM_CONF is not passed on).
    conf = Path("/etc/slurm/slurm.conf")
    if conf.exists():
        raise RuntimeError(f"{conf} exists: a cluster is configured here; not touching it")
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(
        f"""ClusterName=servematrixtest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/spool/ctld
SlurmdSpoolDir={root}/spool/d-{per_node}
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-{per_node}.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-{per_node}.log
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
{_nodes_conf(host, two_nodes)}"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[int] = []
    try:
        if not _munge_ok():
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["/usr/sbin/munged", "--force"], check=True)
            started.append(_pid(Path("/run/munge/munged.pid")))
            deadline = time.monotonic() + 10
            while not _munge_ok() and time.monotonic() < deadline:
                time.sleep(0.2)
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(conf)], check=True, env=env)
        started.append(_pid(root / "slurmctld.pid"))
        for name in slurmds:
            named = ["-N", name] if name else []
            subprocess.run(["/usr/sbin/slurmd", "-f", str(conf), *named], check=True, env=env)
            started.append(_pid(root / f"slurmd-{name or 'host'}.pid"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=env
            )
            states = out.stdout.split()
            if len(states) == len(slurmds) and set(states) <= {"idle", "mix", "alloc"}:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"SLURM node never became idle: {out.stdout} {out.stderr}")
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        conf.unlink(missing_ok=True)
        for pid in reversed(started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in reversed(started):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
