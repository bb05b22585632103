"""The emulator's disaggregated roles in pieces: connector configuration, the producer's
gated copy chain, the wall-clock link (the processes are in test_proxy_emulator.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from servematrix.emulator.disagg import connector
from servematrix.emulator.kvconnector import KV_LINK_ENV, KvTransferError, WallClockLink, prompt_key
from servematrix.emulator.mooncake_v0 import MooncakeV0
from servematrix.emulator.mooncake_v1 import MooncakeV1
from servematrix.engine.architecture import load_architecture
from servematrix.engine.transfer import TransferLink

ARCH = load_architecture("qwen2.5-7b")
V1 = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"}


def test_v1_link_is_the_preset_with_the_cells_overrides() -> None:
    kv = {**V1, "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    plain = connector(kv, "v1", ARCH, 2, None, {})
    assert isinstance(plain, MooncakeV1)
    assert (plain.link.preset, plain.link.nic_gb_s, plain.link.tp) == ("v1-tcp", 1.0, 2)
    tuned = connector(kv, "v1", ARCH, 2, None, {KV_LINK_ENV: '{"nic_gb_s": 4.5}'})
    assert tuned is not None and tuned.link.nic_gb_s == 4.5


@pytest.mark.parametrize(
    ("kv", "env", "message"),
    [
        ({**V1, "kv_connector": "NixlConnector"}, {}, "not NixlConnector as kv_consumer"),
        ({**V1, "kv_role": "kv_both"}, {}, "not MooncakeConnector as kv_both"),
        (V1, {KV_LINK_ENV: "{"}, f"{KV_LINK_ENV}: invalid JSON"),
        (V1, {KV_LINK_ENV: '{"speed": 1}'}, "unknown engine.kv_link key 'speed'"),
        (
            {**V1, "kv_connector_extra_config": {"mooncake_protocol": "efa"}},
            {},
            "no KV link preset for recipe 'v1' and protocol 'efa'",
        ),
    ],
)
def test_v1_configuration_errors_name_the_setting(kv: dict, env: dict, message: str) -> None:
    with pytest.raises(KvTransferError, match=message):
        connector(kv, "v1", ARCH, 1, None, env)


def test_v0_reads_mooncake_json_and_names_what_is_wrong(tmp_path: Path) -> None:
    kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "kv_buffer_size": 2e9}
    path = tmp_path / "mooncake.json"
    with pytest.raises(KvTransferError, match=f"MOONCAKE_CONFIG_PATH {path}"):
        connector(kv, "v0", ARCH, 1, None, {"MOONCAKE_CONFIG_PATH": str(path)})
    path.write_text(json.dumps({"prefill_url": "127.0.0.1:13003"}))
    with pytest.raises(KvTransferError, match="missing decode_url, metadata_server"):
        connector(kv, "v0", ARCH, 1, None, {"MOONCAKE_CONFIG_PATH": str(path)})
    document = {
        "prefill_url": "127.0.0.1:13003",
        "decode_url": "127.0.0.1:13103",
        "metadata_server": "redis://127.0.0.1:6379",
    }
    path.write_text(json.dumps(document))
    with pytest.raises(KvTransferError, match="the emulator speaks to etcd only"):
        connector(kv, "v0", ARCH, 1, None, {"MOONCAKE_CONFIG_PATH": str(path)})
    path.write_text(json.dumps({**document, "metadata_server": "etcd://127.0.0.1:2379"}))
    producer = connector(kv, "v0", ARCH, 1, None, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert isinstance(producer, MooncakeV0)
    assert (producer.etcd, producer.own_url) == ("http://127.0.0.1:2379", "127.0.0.1:13003")
    assert (producer.link.preset, producer.lookup.capacity_bytes) == ("v0-tcp", 2e9)
    # V0 moves the last hidden state from every rank too (as the simulator does).
    v1 = connector(V1, "v1", ARCH, 1, None, {})
    assert producer.bytes_per_token_per_rank - v1.bytes_per_token_per_rank == ARCH.hidden_size * 2


def test_prompt_key_tells_prompts_apart() -> None:
    assert prompt_key([1, 2, 3]) == prompt_key([1, 2, 3])
    assert len({prompt_key([1, 2, 3]), prompt_key([1, 2, 4]), prompt_key("1 2 3")}) == 3
    assert prompt_key([[1, 2]]) != prompt_key([1, 2])


def test_producer_share_advances_only_between_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps({"prefill_url": "h:1", "decode_url": "h:2", "metadata_server": "h:3"})
    )
    kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}
    producer = connector(kv, "v0", ARCH, 1, None, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert isinstance(producer, MooncakeV0)
    producer.engine = SimpleNamespace(recent_steps=deque([(0.0, 1.0), (2.0, 3.0), (3.5, 4.0)]))
    assert producer._idle_finish_s(1.0, 0.5) == 1.5  # idle from 1 to 2
    assert producer._idle_finish_s(0.5, 1.0) == 2.0  # waits for the step to end at 1
    assert producer._idle_finish_s(1.5, 1.0) == 3.5  # 0.5 before the step at 2, 0.5 after it
    assert producer._idle_finish_s(1.0, 2.0) == 4.5  # 1 + 0.5 between steps, 0.5 after 4
    assert producer._idle_finish_s(5.0, 1.0) == 6.0  # after every known step


def test_wall_clock_link_gives_the_modelled_instants_of_shared_transfers() -> None:
    async def run() -> tuple[list[float], float]:
        link = WallClockLink(TransferLink(1e9, 0.01))  # 1 GB/s, 10 ms setup
        start = time.monotonic()
        done = await asyncio.gather(link.transfer(20e6), link.transfer(20e6))
        return [d - start for d in done], time.monotonic() - start

    (first, second), waited = asyncio.run(run())
    # Both share the link: 10 ms setup, then 40 MB at 1 GB/s; each ends at ~50 ms.
    assert first == pytest.approx(0.05, abs=0.005)
    assert second == pytest.approx(0.05, abs=0.005)
    assert waited >= 0.045  # it really waited for them
