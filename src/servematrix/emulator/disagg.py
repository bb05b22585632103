"""The emulator in disaggregated modes: the Mooncake connectors' producer and consumer roles,
played for real between two emulator processes, timed by the simulator's KV transfer model.

An instance started with ``--kv-transfer-config`` naming ``MooncakeConnector`` and role
``kv_producer`` or ``kv_consumer`` gets a :class:`KvConnector`; the HTTP server calls it around
:meth:`WallClockEngine.submit` (``before_submit`` on the consumer, ``submitted`` and ``failed``
on the producer). Timing comes from ``servematrix.engine.transfer`` with the bytes the simulator
moves (``servematrix.simulate.disagg``), so the emulator and the simulator agree on a cell.

**v1** (vLLM 0.33 in-tree ``MooncakeConnector``, wire reference §8):

* The producer runs the bootstrap server on ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (default 8998), on
  the instance's ``--host``: ``POST /register`` (``{engine_id, dp_rank, tp_rank, pp_rank,
  addr}``, reply ``{"status":"ok"}``) and ``GET /query`` (``{"<dp>": {"engine_id",
  "worker_addr": {"<tp>": {"<pp>": "tcp://ip:port"}}}}``). Its one worker registers itself
  there over HTTP at start, with the engine id of the config (``engine_id``, else a uuid4) and
  as address the bootstrap server's own port, where the worker's side channel
  ``GET /servematrix/kv/{transfer_id}`` answers once the prefill of that ``transfer_id`` has
  finished (long poll; an error if it failed). The prefill's response carries
  ``kv_transfer_params: null``, as the real connector's does.
* The consumer, for a request with ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_bootstrap_addr`` and ``transfer_id``: reads the producer's worker address from
  ``/query``, pulls by ``transfer_id`` (waiting for the producer's prefill), then moves the KV
  over the modelled link, a :class:`~servematrix.engine.transfer.TransferLink` (setup, then the
  prompt's KV bytes at the link's bandwidth, shared by concurrent transfers) paced by the wall
  clock. The request joins the engine when its transfer completes, with every prompt token
  computed but the last, as in the simulator. Incomplete parameters: vLLM logs ``Got invalid
  KVTransferParams`` and prefills locally, and so does the emulator. A failed pull fails the
  request (policy ``fail``: HTTP 500).

**v0** (vLLM 0.6 ``MooncakeConnector``: ``SimpleBuffer`` over ``MooncakePipe``, §9):

* Both read ``MOONCAKE_CONFIG_PATH`` and register their segment (``prefill_url`` /
  ``decode_url``) in the etcd of ``metadata_server`` (its v3 JSON gateway): keys
  ``mooncake/ram/<url>`` and ``mooncake/rpc_meta/<url>`` = ``{"ip_or_host_name", "rpc_port"}``.
* The producer inserts every finished prefill's KV into its lookup buffer, keyed by the prompt,
  and serves ``POST /servematrix/drop_select`` on ``prefill_url``'s port (pop the first match).
* The consumer finds the producer's address in etcd and ``drop_select``s each request's prompt:
  found, the request joins the engine with the receive inside the forward pass of the step
  that would prefill it (``KvLink.v0_receive_s``: it stalls that whole step, as in the
  simulator); not found, vLLM's ``Failed to receive all KVs and hidden states, redo model
  forwarding`` and a local prefill.

  The producer's share of that receive (``KvLink.v0_producer_s``) is done by the producer,
  and advances only while the producer's engine is between steps (``POST
  /servematrix/copy_chain``, answered when done; the two processes share one host's monotonic
  clock); the consumer's step ends after it, the rest of the receive and its compute.

  The lookup buffer holds ``kv_buffer_size`` bytes (per rank); an insert into a full buffer
  waits, holding the producer's outputs and next step back, until a consumer step that
  received entries ends (``POST /servematrix/release``), as the simulator's producer stalls.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from servematrix.emulator.kvconnector import (
    DEFAULT_ABORT_TIMEOUT_S,
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_KV_BUFFER_BYTES,
    KV_LINK_ENV,
    KvConnector,
    KvTransferError,
)
from servematrix.emulator.mooncake_v0 import MooncakeV0
from servematrix.emulator.mooncake_v1 import MooncakeV1
from servematrix.engine.architecture import Architecture
from servematrix.engine.transfer import KvLink, kv_bytes_per_token_per_rank, kv_link
from servematrix.recipes import recipe_version


def connector(
    kv_transfer_config: Mapping[str, Any] | None,
    recipe: str,
    arch: Architecture,
    tensor_parallel: int,
    host: str | None,
    environ: Mapping[str, str] = os.environ,
) -> KvConnector | None:
    """The connector an instance's ``--kv-transfer-config`` asks for (None: not
    disaggregated); raises :class:`KvTransferError` for what the emulator cannot play.

    The link is the preset of (recipe, protocol), with the overrides of
    ``SERVEMATRIX_EMULATOR_KV_LINK`` (a JSON object with the keys of the config's
    ``engine.kv_link``), so a cell that overrides the simulator's link times the emulator's
    transfers alike."""
    if kv_transfer_config is None:
        return None
    overrides_text = environ.get(KV_LINK_ENV)
    try:
        overrides = json.loads(overrides_text) if overrides_text else None
    except ValueError as error:
        raise KvTransferError(f"{KV_LINK_ENV}: invalid JSON: {error}") from None
    name = kv_transfer_config.get("kv_connector")
    role = kv_transfer_config.get("kv_role")
    if name != "MooncakeConnector" or role not in ("kv_producer", "kv_consumer"):
        raise KvTransferError(
            f"--kv-transfer-config: the emulator plays MooncakeConnector as kv_producer or "
            f"kv_consumer, not {name} as {role}"
        )
    per_token = kv_bytes_per_token_per_rank(arch, tensor_parallel, recipe)

    def link_of(protocol: str) -> KvLink:
        return _link(recipe, protocol, tensor_parallel, overrides)

    build = _CONNECTORS[recipe_version(recipe).kv.name]
    return build(role, kv_transfer_config, link_of, per_token, host, environ)


def _mooncake_v1(
    role: str,
    kv_transfer_config: Mapping[str, Any],
    link_of: Callable[[str], KvLink],
    per_token: float,
    host: str | None,
    environ: Mapping[str, str],
) -> KvConnector:
    """V1's in-tree connector: the protocol from ``kv_connector_extra_config``, the bootstrap
    port from the environment."""
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    protocol = extra.get("mooncake_protocol", "rdma")
    return MooncakeV1(
        role,
        link_of(protocol),
        per_token,
        engine_id=str(kv_transfer_config.get("engine_id") or uuid.uuid4()),
        host=host,
        bootstrap_port=int(
            environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(DEFAULT_BOOTSTRAP_PORT))
        ),
        abort_timeout_s=float(
            environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", str(DEFAULT_ABORT_TIMEOUT_S))
        ),
    )


def _mooncake_v0(
    role: str,
    kv_transfer_config: Mapping[str, Any],
    link_of: Callable[[str], KvLink],
    per_token: float,
    host: str | None,
    environ: Mapping[str, str],
) -> KvConnector:
    """V0's MooncakePipe: the protocol and the peers from ``MOONCAKE_CONFIG_PATH``."""
    path = environ.get("MOONCAKE_CONFIG_PATH", "")
    try:
        with open(path) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise KvTransferError(f"MOONCAKE_CONFIG_PATH {path}: {error}") from None
    missing = [k for k in ("prefill_url", "decode_url", "metadata_server") if k not in config]
    if missing:
        raise KvTransferError(f"{path}: missing {', '.join(missing)}")
    protocol = config.get("protocol", "tcp")
    buffer_bytes = float(kv_transfer_config.get("kv_buffer_size", DEFAULT_KV_BUFFER_BYTES))
    return MooncakeV0(role, link_of(protocol), per_token, config, path, buffer_bytes)


_CONNECTORS = {"mooncake-v0": _mooncake_v0, "mooncake-v1": _mooncake_v1}
"""Each ``KvConnector.name`` of ``servematrix.recipes``, played by the emulator."""


def _link(recipe: str, protocol: str, tp: int, overrides: Any) -> KvLink:
    if overrides is not None and not isinstance(overrides, dict):
        raise KvTransferError(f"{KV_LINK_ENV}: expected a JSON object, got {overrides!r}")
    try:
        return kv_link(recipe, protocol, tp, overrides)
    except KeyError as error:
        raise KvTransferError(str(error).strip('"')) from None
