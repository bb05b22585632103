"""A deployment's topology: its roles, each an instance count at one tensor-parallel size.

Aggregated replicas are one role (N instances at TPt behind the round-robin proxy), spelled
``4x(TP2)``; a disaggregated xPyD deployment is a prefill role and a decode role (P instances
at TPp, D at TPd, the proxy spreading requests over both sides), spelled ``2P(TP2)+1D(TP4)``.
The spelling is the one name a topology has in paths, summaries, capacity tables and
findings, and `parse` reads it back. GPU pins are carved from a model's GPU list per role, in
role order (prefill before decode), each instance taking the next ``tp`` GPUs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGGREGATED, PREFILL, DECODE = "aggregated", "prefill", "decode"
ROLE_LETTERS = {AGGREGATED: "x", PREFILL: "P", DECODE: "D"}
"""Each role kind and the letter after its count in a topology's spelling."""

_ROLE = re.compile(r"(\d+)([xPD])\(TP(\d+)\)")
_KIND_OF_LETTER = {letter: kind for kind, letter in ROLE_LETTERS.items()}
TOPOLOGY_PATTERN = r"\d+x\(TP\d+\)|\d+P\(TP\d+\)\+\d+D\(TP\d+\)"
"""Every spelling `parse` accepts (a path's mode wildcard matches topologies with it)."""


class TopologyError(ValueError):
    """A topology that cannot be spelled, parsed or pinned."""


@dataclass(frozen=True)
class Role:
    kind: str
    count: int
    tp: int

    @property
    def spelling(self) -> str:
        return f"{self.count}{ROLE_LETTERS[self.kind]}(TP{self.tp})"

    @property
    def gpus(self) -> int:
        return self.count * self.tp


@dataclass(frozen=True)
class Topology:
    """Roles in order: one aggregated role, or a prefill role then a decode role."""

    roles: tuple[Role, ...]

    def __post_init__(self) -> None:
        kinds = tuple(role.kind for role in self.roles)
        if kinds not in ((AGGREGATED,), (PREFILL, DECODE)):
            raise TopologyError(f"roles {kinds} are neither aggregated nor prefill then decode")
        for role in self.roles:
            if role.count < 1 or role.tp < 1:
                raise TopologyError(f"{role.spelling}: counts and TP sizes must be at least 1")

    @classmethod
    def aggregated(cls, count: int, tp: int) -> Topology:
        return cls((Role(AGGREGATED, count, tp),))

    @classmethod
    def xpyd(cls, prefill: int, tp_prefill: int, decode: int, tp_decode: int) -> Topology:
        return cls((Role(PREFILL, prefill, tp_prefill), Role(DECODE, decode, tp_decode)))

    @property
    def spelling(self) -> str:
        return "+".join(role.spelling for role in self.roles)

    def __str__(self) -> str:
        return self.spelling

    @property
    def disaggregated(self) -> bool:
        return self.roles[0].kind == PREFILL

    @property
    def instances(self) -> int:
        return sum(role.count for role in self.roles)

    @property
    def gpus(self) -> int:
        return sum(role.gpus for role in self.roles)

    def role(self, kind: str) -> Role:
        for role in self.roles:
            if role.kind == kind:
                return role
        raise TopologyError(f"{self.spelling} has no {kind} role")

    @property
    def instance_roles(self) -> tuple[Role, ...]:
        """The role of each instance, in instance order (prefill instances first)."""
        return tuple(role for role in self.roles for _ in range(role.count))

    def pins(self, gpus: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Each instance's GPU ids, carved in order from ``gpus`` (a model's GPU list)."""
        if len(gpus) < self.gpus:
            raise TopologyError(f"{self.spelling} needs {self.gpus} GPUs, {len(gpus)} are pinned")
        pins, start = [], 0
        for role in self.instance_roles:
            pins.append(tuple(gpus[start : start + role.tp]))
            start += role.tp
        return tuple(pins)


def within_budget(gpu_budget: int, tps: tuple[int, ...]) -> list[Topology]:
    """Every topology on at most ``gpu_budget`` GPUs whose roles run at one of the ``tps``
    sizes: N aggregated replicas at TPt, and P prefill at TPp + D decode instances at TPd;
    aggregated first, each kind by TP sizes, then by counts."""
    found = [Topology.aggregated(n, tp) for tp in tps for n in range(1, gpu_budget // tp + 1)]
    for tp_prefill in tps:
        for tp_decode in tps:
            for prefill in range(1, gpu_budget // tp_prefill + 1):
                left = gpu_budget - prefill * tp_prefill
                found.extend(
                    Topology.xpyd(prefill, tp_prefill, decode, tp_decode)
                    for decode in range(1, left // tp_decode + 1)
                )
    return found


def parse(spelling: str) -> Topology:
    """The topology a spelling (``4x(TP2)``, ``2P(TP2)+1D(TP4)``) names."""
    if not re.fullmatch(TOPOLOGY_PATTERN, spelling):
        raise TopologyError(f"{spelling!r} is not a topology (e.g. 4x(TP2) or 2P(TP2)+1D(TP4))")
    roles = tuple(
        Role(_KIND_OF_LETTER[letter], int(count), int(tp))
        for count, letter, tp in _ROLE.findall(spelling)
    )
    return Topology(roles)
