"""Which node each process of a deployment runs on, and the address its peers reach it on.

* ``deploy.nodes`` unset: one machine. Every process binds ``deploy.host`` and is reached on
  it (on 127.0.0.1 when it binds every interface); ``kv_host`` names the transfer engines
  and etcd in the v0 ``mooncake.json``.
* ``deploy.nodes: [A, B, ...]``: the addresses of the nodes, all of this machine (several
  NICs, or loopback aliases such as 127.0.0.2 and 127.0.0.3); every process starts here.
* ``deploy.nodes: N``: the first N nodes of the SLURM job's allocation, the cell's own node
  first. The plan names them by placeholders (its fingerprint does not depend on which nodes
  a job is given); :func:`on_allocation` fills in each node's ``NodeAddr`` in the job, and a
  process on another node is started there through ``srun``.

With nodes, instance k runs on node k mod N, and the proxy and etcd on node 0, where the
cell's client runs; each process binds its node's address (or every interface, with
``deploy.host: 0.0.0.0``) and every URL that names a peer names the peer's node.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servematrix.deploy.processes import Plan, Process, node_placeholder

EVERY_INTERFACE = ("0.0.0.0", "::")
LOOPBACK = "127.0.0.1"


class NodeError(RuntimeError):
    """The nodes a deployment needs cannot be found (one line)."""


@dataclass(frozen=True)
class Place:
    """Where one process runs: ``bind`` is the address it listens on, ``reach`` the one its
    peers and the client use; ``node`` its index in the node list (None: one machine)."""

    bind: str
    reach: str
    node: int | None

    def url(self, port: int) -> str:
        return f"http://{self.reach}:{port}"


def addresses(deploy: Mapping[str, Any]) -> tuple[str, ...]:
    """Each node's address, or its placeholder on a SLURM allocation; () for one machine."""
    nodes = deploy.get("nodes")
    if nodes is None:
        return ()
    if isinstance(nodes, int):
        return tuple(node_placeholder(k) for k in range(nodes))
    return tuple(nodes)


def slurm_node_count(deploy: Mapping[str, Any]) -> int | None:
    """How many nodes of its SLURM job a deployment spreads over (None: not a count)."""
    nodes = deploy.get("nodes")
    return nodes if isinstance(nodes, int) else None


def instance_node(deploy: Mapping[str, Any], index: int) -> int | None:
    """The node of the deployment's instance ``index`` (None: one machine)."""
    count = len(addresses(deploy))
    return index % count if count else None


def place(deploy: Mapping[str, Any], node: int | None) -> Place:
    """Where a process on ``node`` binds and is reached (``deploy`` with its defaults)."""
    host = str(deploy["host"])
    if node is None:
        return Place(host, LOOPBACK if host in EVERY_INTERFACE else host, None)
    address = addresses(deploy)[node]
    return Place(host if host in EVERY_INTERFACE else address, address, node)


def entry(deploy: Mapping[str, Any]) -> Place:
    """Where the proxy (or the one instance) and etcd run: node 0, the cell's own."""
    return place(deploy, 0 if addresses(deploy) else None)


def on_allocation(plan: Plan, deploy: Mapping[str, Any]) -> Plan:
    """``plan`` with its node placeholders filled from the SLURM job's allocation (unchanged
    unless ``deploy.nodes`` is a count)."""
    count = slurm_node_count(deploy)
    if count is None:
        return plan
    found = allocation(count)
    values = {node_placeholder(k): address for k, (_, address) in enumerate(found)}
    return plan.filled(values, tuple(name for name, _ in found))


def allocation(count: int) -> list[tuple[str, str]]:
    """(name, NodeAddr) of the first ``count`` nodes of this SLURM job, its own node first."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        raise NodeError(
            f"deploy.nodes: {count} places the deployment on {count} nodes of a SLURM "
            "allocation, but this is not a SLURM job (no SLURM_JOB_ID)"
        )
    # The job's own node list: inside a job step (Snakemake's jobstep executor runs a cell
    # in one) the environment's node list is the step's, one node.
    nodelist = _field(_scontrol("show", "job", "--oneliner", job), "NodeList")
    names = _scontrol("show", "hostnames", nodelist).split()
    own = os.environ.get("SLURMD_NODENAME")
    if own in names:
        names.remove(own)
        names.insert(0, own)
    if len(names) < count:
        raise NodeError(
            f"deploy.nodes: {count} needs {count} nodes; the job has {len(names)} ({nodelist})"
        )
    return [(name, _node_address(name)) for name in names[:count]]


def _node_address(name: str) -> str:
    """A node's ``NodeAddr`` (its name when the cluster sets none)."""
    return _field(_scontrol("show", "node", "--oneliner", name), "NodeAddr") or name


def _field(record: str, key: str) -> str:
    """The value of ``key=value`` in one line of ``scontrol show ... --oneliner``."""
    for token in record.split():
        name, _, value = token.partition("=")
        if name == key:
            return value
    return ""


def _scontrol(*args: str) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NodeError(f"scontrol {' '.join(args)}: {error}") from None
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise NodeError(f"scontrol {' '.join(args)} failed: {reason[-1] if reason else ''}")
    return done.stdout


def launcher(plan: Plan, process: Process) -> list[str]:
    """What runs before the process's own argv: ``srun`` onto its node when that is another
    node of the allocation (sharing the job's resources with ``--overlap``); nothing when it
    starts on this machine."""
    if not plan.slurm_nodes or process.node is None:
        return []
    name = plan.slurm_nodes[process.node]
    if name == os.environ.get("SLURMD_NODENAME", plan.slurm_nodes[0]):
        return []
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={name}", "--quiet"]
