"""Where each instance of a deployment runs: its process name, port, pins, TP and KV role.

A named mode keeps the published layout (one ``single`` instance; or ``prefill`` on the
prefill port and ``decode`` on the decode port, the KV producer and consumer when
disaggregated). A topology lays out every instance of its roles in order: aggregated replicas
``instance{k}`` on the prefill port + k; prefill instances ``prefill{k}`` (KV producers) on the
prefill port + k, each with its own Mooncake bootstrap ports (one per TP rank, so prefillers
never share one); decode instances ``decode{k}`` (KV consumers) on the decode port + k.
With ``deploy.nodes``, instance i (in that order) runs on node i mod N
(:mod:`servematrix.deploy.nodes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from servematrix.deploy.nodes import instance_node
from servematrix.spec.matrix import Cell
from servematrix.spec.topology import AGGREGATED, DECODE, PREFILL

KV_ROLES = {AGGREGATED: None, PREFILL: "kv_producer", DECODE: "kv_consumer"}
"""The vLLM ``kv_role`` of each role kind's instances."""
_NAMES = {AGGREGATED: "instance", PREFILL: "prefill", DECODE: "decode"}
_PORTS = {AGGREGATED: "prefill", PREFILL: "prefill", DECODE: "decode"}


@dataclass(frozen=True)
class Slot:
    """One instance: ``bootstrap`` is its first Mooncake bootstrap port (a KV producer's)."""

    name: str
    port: int
    pins: tuple[int, ...]
    tp: int
    kv_role: str | None
    bootstrap: int
    node: int | None = None
    """Index of its node in ``deploy.nodes`` (None: one machine)."""


def decoding_instances(cell: Cell) -> set[str]:
    """The names of the instances that only decode (a prefiller computed their prompts)."""
    anywhere = dict.fromkeys(_PORTS.values(), 0) | {"single": 0, "bootstrap": 0}
    return {slot.name for slot in slots(cell, anywhere) if slot.kv_role == KV_ROLES[DECODE]}


def slots(cell: Cell, ports: Mapping[str, int]) -> list[Slot]:
    """Every instance of the cell's deployment, prefill before decode, each on its node."""
    return [
        dataclasses.replace(slot, node=instance_node(cell.deploy, index))
        for index, slot in enumerate(_slots(cell, ports))
    ]


def _slots(cell: Cell, ports: Mapping[str, int]) -> list[Slot]:
    topology, pins = cell.topology, cell.instance_gpus
    roles = topology.instance_roles
    if topology.instances == 1:
        return [Slot("single", ports["single"], pins[0], roles[0].tp, None, ports["bootstrap"])]
    if cell.mode.topology is None:  # a named two-instance mode, as the published studies ran
        return [
            Slot(name, ports[name], pin, role.tp, KV_ROLES[role.kind], ports["bootstrap"])
            for name, pin, role in zip(("prefill", "decode"), pins, roles, strict=True)
        ]
    found: list[Slot] = []
    bootstrap = ports["bootstrap"]
    for role in topology.roles:
        for k in range(role.count):
            pin = pins[len(found)]
            port = ports[_PORTS[role.kind]] + k
            found.append(
                Slot(f"{_NAMES[role.kind]}{k}", port, pin, role.tp, KV_ROLES[role.kind], bootstrap)
            )
            if role.kind == PREFILL:
                bootstrap += role.tp
    return found
