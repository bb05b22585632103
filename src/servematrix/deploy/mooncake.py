"""The v0 recipe's Mooncake side: its etcd server, ``mooncake.json`` and transfer-engine ports
(``shared/reference/vllm-mooncake-spec.md`` §4; vLLM 0.6's ``MooncakePipe``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from servematrix.deploy.nodes import LOOPBACK, Place
from servematrix.deploy.processes import DEPLOYMENT_DIR, Health, Process

MOONCAKE_DECODE_OFFSET = 100
"""Decode transfer-engine base port = prefill's + 100 (what vLLM 0.6 does for equal URLs)."""


def mooncake_json(
    protocol: str,
    ports: Mapping[str, int],
    deploy: Mapping[str, Any],
    places: Mapping[str, Place],
) -> str:
    """The v0 connector's config file (spec §4): transfer-engine URLs, etcd, protocol, NIC.
    ``places``: where ``prefill``, ``decode`` and ``etcd`` run; on one machine all three are
    named by ``deploy.kv_host``, on several nodes each by its own node's address."""

    def address(name: str) -> str:
        return deploy["kv_host"] if places[name].node is None else places[name].reach

    document = {
        "prefill_url": f"{address('prefill')}:{ports['mooncake']}",
        "decode_url": f"{address('decode')}:{ports['mooncake'] + MOONCAKE_DECODE_OFFSET}",
        "metadata_server": f"etcd://{address('etcd')}:{ports['etcd']}",
        "protocol": protocol,
        "device_name": deploy["rdma_device"] if protocol == "rdma" else "",
    }
    return json.dumps(document, indent=2) + "\n"


def mooncake_ports(base: int, tp: int) -> tuple[int, ...]:
    """The ports one side's ``MooncakePipe`` binds, from its base port."""
    # vLLM 0.6 MooncakePipe: transfer engine on base + rank, ZMQ on base + 8 + 2*rank + {1, 2}.
    engine = [base + rank for rank in range(tp)]
    zmq = [base + 8 + 2 * rank + k for rank in range(tp) for k in (1, 2)]
    return tuple(engine + zmq)


def etcd(where: Place, port: int) -> Process:
    """A one-member etcd on ``where``: its peer URL is its own node's address (loopback on
    one machine)."""
    peer = port + 1
    host = where.bind
    if where.node is None:
        advertised = "localhost" if host in ("0.0.0.0", LOOPBACK) else host
        peer_host = LOOPBACK
    else:
        advertised = peer_host = where.reach
    argv = (
        "etcd",
        "--listen-client-urls",
        f"http://{host}:{port}",
        "--advertise-client-urls",
        f"http://{advertised}:{port}",
        # A private data directory and peer port: a default etcd writes ./default.etcd and
        # listens on 2380, which would collide with any other etcd on the host.
        "--name",
        "servematrix",
        "--data-dir",
        f"{DEPLOYMENT_DIR}/etcd-data",
        "--listen-peer-urls",
        f"http://{peer_host}:{peer}",
        "--initial-advertise-peer-urls",
        f"http://{peer_host}:{peer}",
        "--initial-cluster",
        f"servematrix=http://{peer_host}:{peer}",
    )
    bind = None if where.node is None else host
    health = Health(where.url(port) + "/health")
    return Process("etcd", argv, {}, port, health, (), (peer,), bind, where.node)
