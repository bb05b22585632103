"""A deployment as data: its processes (argv, environment, ports, health URL) and its plan.

What :mod:`servematrix.deploy.recipes` renders and :mod:`servematrix.deploy.supervise` starts.
Two kinds of placeholder are filled in only after the fingerprint is taken, so that the
fingerprint depends on the commands, not on where they run: the deployment's own directory
(:data:`DEPLOYMENT_DIR`) and, for a deployment spread over a SLURM allocation, each node's
address (:func:`node_placeholder`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from servematrix.recipes.base import DEPLOYMENT_DIR


def node_placeholder(index: int) -> str:
    """Placeholder for the address of the allocation's node ``index`` (0: the cell's own)."""
    return f"@NODE{index}@"


@dataclass(frozen=True)
class Health:
    """How to tell a process is ready: GET ``url`` answers 200 (etcd: its own /health)."""

    url: str


@dataclass(frozen=True)
class Process:
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    """Variables set on top of the caller's environment, in display order."""
    port: int
    health: Health
    gpus: tuple[int, ...] = ()
    extra_ports: tuple[int, ...] = ()
    """Other ports it binds (bootstrap server, transfer engine): checked free before start."""
    host: str | None = None
    """The address it binds when that is its node's (a multi-node deployment); None: the
    deployment's ``deploy.host``."""
    node: int | None = None
    """Index of its node in the deployment's node list; None: a one-machine deployment."""
    api_server_cores: tuple[int, ...] = ()
    """A CPU node's vLLM instance: the cores its API server moves to once it is healthy
    (``node.api_server_cores``, `servematrix.deploy.cpupins`); empty: left where it starts."""

    @property
    def ports(self) -> tuple[int, ...]:
        return (self.port, *self.extra_ports)

    def to_dict(self) -> dict[str, Any]:
        document = {
            "name": self.name,
            "argv": list(self.argv),
            "env": dict(self.env),
            "port": self.port,
            "health": self.health.url,
            "gpus": list(self.gpus),
            "extra_ports": list(self.extra_ports),
        }
        # Only when set: a one-machine deployment keeps the fingerprint it always had.
        if self.host is not None:
            document["host"] = self.host
        if self.node is not None:
            document["node"] = self.node
        if self.api_server_cores:
            document["api_server_cores"] = list(self.api_server_cores)
        return document

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Process:
        return cls(
            name=data["name"],
            argv=tuple(data["argv"]),
            env=dict(data["env"]),
            port=data["port"],
            health=Health(data["health"]),
            gpus=tuple(data["gpus"]),
            extra_ports=tuple(data["extra_ports"]),
            host=data.get("host"),
            node=data.get("node"),
            api_server_cores=tuple(data.get("api_server_cores", ())),
        )

    def filled(self, values: Mapping[str, str]) -> Process:
        """The process with every placeholder in ``values`` replaced by its value."""
        return Process(
            self.name,
            tuple(_fill(a, values) for a in self.argv),
            {k: _fill(v, values) for k, v in self.env.items()},
            self.port,
            Health(_fill(self.health.url, values)),
            self.gpus,
            self.extra_ports,
            None if self.host is None else _fill(self.host, values),
            self.node,
            self.api_server_cores,
        )


def _fill(text: str, values: Mapping[str, str]) -> str:
    for placeholder, value in values.items():
        text = text.replace(placeholder, value)
    return text


@dataclass(frozen=True)
class Plan:
    """A deployment: its processes in start order, and where a client sends requests."""

    backend: str
    recipe: str
    model: str
    mode: str
    processes: tuple[Process, ...]
    base_url: str
    fingerprint: str
    files: Mapping[str, str] = field(default_factory=dict)
    """Files written into the deployment directory before start (name -> content)."""
    slurm_nodes: tuple[str, ...] = ()
    """The SLURM node name of each node index, once placed on an allocation: a process on a
    node other than the cell's own is started there with ``srun``. Empty: every process
    starts on this machine."""

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted({g for p in self.processes for g in p.gpus}))

    def to_dict(self) -> dict[str, Any]:
        document = {
            "backend": self.backend,
            "recipe": self.recipe,
            "model": self.model,
            "mode": self.mode,
            "processes": [p.to_dict() for p in self.processes],
            "base_url": self.base_url,
            "fingerprint": self.fingerprint,
            "files": dict(self.files),
        }
        if self.slurm_nodes:
            document["slurm_nodes"] = list(self.slurm_nodes)
        return document

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        return cls(
            backend=data["backend"],
            recipe=data["recipe"],
            model=data["model"],
            mode=data["mode"],
            processes=tuple(Process.from_dict(p) for p in data["processes"]),
            base_url=data["base_url"],
            fingerprint=data["fingerprint"],
            files=dict(data["files"]),
            slurm_nodes=tuple(data.get("slurm_nodes", ())),
        )

    def filled(self, values: Mapping[str, str], slurm_nodes: tuple[str, ...] = ()) -> Plan:
        """The plan with every placeholder in ``values`` replaced (argv, environment, health
        and base URLs, bind addresses, file contents); the fingerprint is kept."""
        return Plan(
            self.backend,
            self.recipe,
            self.model,
            self.mode,
            tuple(p.filled(values) for p in self.processes),
            _fill(self.base_url, values),
            self.fingerprint,
            {k: _fill(v, values) for k, v in self.files.items()},
            slurm_nodes or self.slurm_nodes,
        )

    def resolve(self, deployment_dir: str) -> Plan:
        """The plan with its directory placeholder replaced (argv, env and file contents)."""
        return self.filled({DEPLOYMENT_DIR: deployment_dir})


def fingerprint(
    backend: str, recipe: str, processes: list[Process], files: Mapping[str, str]
) -> str:
    """Same fingerprint = same recipe and command lines: a running deployment may be reused."""
    document = {
        "backend": backend,
        "recipe": recipe,
        "processes": [p.to_dict() for p in processes],
        "files": dict(files),
    }
    digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()
    return digest[:16]
