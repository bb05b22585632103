"""``servematrix-emulator`` as a real process on a free port, spoken to over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from servematrix.engine.scheduler import Request
from servematrix.engine.setup import build_engine_setup
from servematrix.spec.matrix import Workload

EMULATOR = str(Path(sys.executable).with_name("servematrix-emulator"))
MODEL = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def emulator(*flags: str, env: dict | None = None, ready: bool = True) -> Iterator[tuple]:
    """Start the emulator; yield (base URL, process); stop it."""
    port = free_port()
    process = subprocess.Popen(
        [EMULATOR, "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if ready:
            wait_ready(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
        process.communicate(timeout=30)


def wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"emulator exited: {process.communicate()[1]}")
        try:
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("emulator never listened")


async def _post(session, url, body, request_id=None):
    headers = {"X-Request-Id": request_id} if request_id else {}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
        return response.status, await response.read()


def post(url: str, body: dict, request_id: str | None = None) -> tuple[int, bytes]:
    async def go():
        async with aiohttp.ClientSession() as session:
            return await _post(session, url, body, request_id)

    return asyncio.run(go())


def get(url: str) -> tuple[int, bytes]:
    async def go():
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status, await response.read()

    return asyncio.run(go())


def events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert raw.endswith(b"\n\n")
    parts = raw.decode().split("\n\n")[:-1]
    assert all(part.startswith("data: ") and "\n" not in part for part in parts)
    return [part[len("data: ") :] for part in parts]


def stream_body(prompt, max_tokens, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **extra}


USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}

pytestmark = pytest.mark.slow


def test_unknown_flag_and_too_few_visible_gpus_fail_at_start():
    bogus = subprocess.run(
        [EMULATOR, "serve", MODEL, "--bogus-flag", "1"], capture_output=True, text=True
    )
    assert bogus.returncode == 2
    assert "error: unrecognized arguments: --bogus-flag 1" in bogus.stderr
    few = subprocess.run(
        [EMULATOR, "serve", "Qwen/Qwen2.5-72B-Instruct", "-tp", "4", "--port", str(free_port())],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"},
    )
    assert few.returncode == 1
    assert "World size (4) is larger than the number of available GPUs (2) in this node" in (
        few.stderr
    )
    unknown = subprocess.run([EMULATOR, "serve", "./no-such-dir/"], capture_output=True, text=True)
    assert unknown.returncode == 1 and "unknown model './no-such-dir/'" in unknown.stderr


def test_v1_stream_non_stream_errors_and_metrics():
    with emulator("--max-model-len", "2048") as (url, _):
        status, raw = post(url, stream_body(list(range(100)), 4, **USAGE), "req-a")
        assert status == 200
        payloads = events(raw)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        tokens, usage_chunk = chunks[:-1], chunks[-1]
        # Some chunks carry "" (EMPTY_TEXT_FRACTION), as vLLM's special tokens do.
        texts = [c["choices"][0]["text"] for c in tokens]
        assert all(t == "" or re.fullmatch(r"( t\d)+", t) for t in texts), texts
        # One chunk per token, unless the handler fell behind the engine and merged the tokens
        # released meanwhile into one chunk (as vLLM does): counts rise to 4, "length" last.
        counts = [c["usage"]["completion_tokens"] for c in tokens]
        assert counts == sorted(set(counts)) and counts[-1] == 4, counts
        reasons = [c["choices"][0]["finish_reason"] for c in tokens]
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}, reasons
        assert all(c["id"] == "cmpl-req-a" and c["kv_transfer_params"] is None for c in tokens)
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"] == {
            "prompt_tokens": 100,
            "total_tokens": 104,
            "completion_tokens": 4,
        }
        assert usage_chunk["system_fingerprint"].startswith("vllm-0.33.0-")
        # Without stream_options: no usage anywhere, the fingerprint on the last chunk.
        plain = [json.loads(p) for p in events(post(url, stream_body([1, 2], 2))[1])[:-1]]
        # Tokens due together go out in one chunk, as V1's output handler sends them: on a
        # busy machine both tokens may be due by the time the stream wakes.
        assert 1 <= len(plain) <= 2 and all("usage" not in c for c in plain)
        assert "system_fingerprint" in plain[-1]
        assert all("system_fingerprint" not in c for c in plain[:-1])
        # kv_transfer_params come back on the last chunk.
        params = {"do_remote_decode": True, "transfer_id": "xfer-1"}
        last = json.loads(
            events(post(url, stream_body([1, 2], 2, kv_transfer_params=params))[1])[-2]
        )
        assert last["kv_transfer_params"] == params
        # Non-streaming, text prompt.
        status, raw = post(url, {"model": MODEL, "prompt": "Hello there, world", "max_tokens": 3})
        body = json.loads(raw)
        assert status == 200 and body["choices"][0]["text"] == " t0 t1 t2"
        assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] > 0
        # Errors: a too-long prompt, a clamped max_tokens, an unknown model, an unknown route.
        status, raw = post(url, stream_body(list(range(2049)), 4))
        assert status == 400
        error = json.loads(raw)["error"]
        assert error["message"].startswith(
            "This model's maximum context length is 2048 tokens. However, your prompt contains "
            "2049 input tokens"
        )
        assert (error["param"], error["code"]) == ("input_tokens", 400)
        clamped = events(post(url, stream_body(list(range(2046)), 10, **USAGE))[1])
        assert json.loads(clamped[-2])["usage"]["completion_tokens"] == 2  # 2048 - 2046
        status, raw = post(url, {"model": "other", "prompt": [1], "max_tokens": 1})
        assert status == 404
        assert json.loads(raw)["error"]["message"] == (
            f"The model `other` does not exist. Valid aliases: {MODEL}."
        )
        # An id beyond the model's vocabulary (Qwen2.5: 152064): vLLM's 400.
        status, raw = post(url, stream_body([1, 9999999], 4))
        assert status == 400
        assert json.loads(raw)["error"] == {
            "message": "Token id 9999999 is out of vocabulary",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        assert get(f"{url}/nope") == (404, b'{"detail":"Not Found"}')
        assert get(f"{url}/health") == (200, b"")
        assert json.loads(get(f"{url}/version")[1]) == {"version": "0.33.0"}
        models = json.loads(get(f"{url}/v1/models")[1])["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 2048)]
        assert get(f"{url}/reset_prefix_cache")[0] == 404  # 0.33 needs VLLM_SERVER_DEV_MODE=1
        metrics = parse_metrics(get(f"{url}/metrics")[1].decode())
        label = f'{{model_name="{MODEL}",engine="0"}}'
        # Served: 100+4, 2+2, 2+2, text+3, 2046+2 (the rejected ones count nothing).
        assert metrics[f"vllm:generation_tokens_total{label}"] == 4 + 2 + 2 + 3 + 2
        assert metrics[f"vllm:prompt_tokens_total{label}"] >= 100 + 2 + 2 + 2046
        assert metrics[f"vllm:num_requests_running{label}"] == 0
        assert metrics[f"vllm:kv_cache_usage_perc{label}"] == 0
        assert f"vllm:num_preemptions_total{label}" in metrics


def test_streams_carry_empty_text_chunks_at_the_seeded_rate():
    """vLLM streams "" for special tokens and partial characters; so does the emulator, about
    one chunk in 50 (drawn per chunk from the seed and the request id); usage is unchanged."""
    with emulator("--max-model-len", "2048", "--seed", "3") as (url, _):
        raw = post(url, stream_body([1, 2], 400, **USAGE), "r-1")[1]
    chunks = [json.loads(p) for p in events(raw)[:-1]][:-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 400
    empty = sum(c["choices"][0]["text"] == "" for c in chunks)
    assert 2 <= empty <= 20, empty  # 8 expected of 400


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_v0_flavour_flat_errors_and_usage_null_chunks():
    with emulator("--recipe", "v0", "--max-model-len", "64") as (url, _):
        status, raw = post(url, stream_body(list(range(60)), 10))
        assert status == 400
        assert json.loads(raw) == {
            "object": "error",
            "message": "This model's maximum context length is 64 tokens. However, you requested "
            "70 tokens (60 in the messages, 10 in the completion). Please reduce the length of "
            "the messages or completion.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        payloads = events(post(url, stream_body([1, 2, 3], 2))[1])
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert len(chunks) == 2 and all(c["usage"] is None for c in chunks)  # no usage chunk
        assert len(chunks[0]["id"]) == len("cmpl-") + 32
        # stream_options {} means include_usage in 0.6.
        with_usage = [
            json.loads(p) for p in events(post(url, stream_body([1], 2, stream_options={}))[1])[:-1]
        ]
        assert with_usage[-1]["usage"] == {
            "prompt_tokens": 1,
            "total_tokens": 3,
            "completion_tokens": 2,
        }
        metrics = get(f"{url}/metrics")[1].decode()
        assert f'vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.0' in metrics
        assert "kv_cache_usage_perc" not in metrics
        assert json.loads(get(f"{url}/version")[1]) == {"version": "0.6.6.post1"}


def test_startup_delay_keeps_the_port_closed():
    with emulator("--startup-delay-s", "2", ready=False) as (url, process):
        port = int(url.rsplit(":", 1)[1])
        time.sleep(0.5)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), 0.2).close()
        wait_ready(url, process)
        assert get(f"{url}/health")[0] == 200


async def _many(url: str, bodies: list[dict], prefix: str) -> list[tuple[int, bytes | str]]:
    async with aiohttp.ClientSession() as session:

        async def one(k, body):
            try:
                return await _post(session, url, body, f"{prefix}-{k}")
            except aiohttp.ClientError as error:
                return -1, repr(error)

        return await asyncio.gather(*(one(k, b) for k, b in enumerate(bodies)))


def test_fault_injection_fail_fraction_and_dropped_streams():
    body = stream_body([1] * 16, 5)
    with emulator("--fail-fraction", "0.5", "--seed", "1") as (url, _):
        results = asyncio.run(_many(url, [body] * 40, "f"))
    statuses = [status for status, _ in results]
    assert 5 < statuses.count(500) < 35 and statuses.count(200) + statuses.count(500) == 40
    failed = next(raw for status, raw in results if status == 500)
    assert json.loads(failed)["error"]["code"] == 500
    with emulator(env={"SERVEMATRIX_EMULATOR_DROP_AFTER_CHUNKS": "2"}) as (url, _):
        ((status, raw),) = asyncio.run(_many(url, [body], "d"))
        log = json.loads(get(f"{url}/servematrix/requests")[1])["d-0"]
    # The connection is cut after two chunks: no [DONE], the client sees an error or a
    # truncated body.
    assert status == -1 or (status == 200 and b"[DONE]" not in raw)
    assert len(log["chunk_s"]) == 2 and log["outcome"].startswith("dropped")


def test_die_after_requests_exits_the_process():
    with emulator("--die-after-requests", "2") as (url, process):
        for k in range(2):
            assert post(url, stream_body([1, 2], 2), f"ok-{k}")[0] == 200
        with pytest.raises(aiohttp.ClientError):
            post(url, stream_body([1, 2], 2), "dies")
        assert process.wait(timeout=10) == 1
        assert "dying at request 3" in process.stderr.read()


def engine_steps(input_len: int, output_len: int) -> list[float]:
    """The engine's own ends of the steps that give one request alone (no jitter) its tokens,
    from its arrival: the first step may be the API server's handing the request over,
    without a token."""
    setup = build_engine_setup(
        "qwen2.5-7b",
        quantization="gptq-int4",
        tensor_parallel=1,
        recipe="v1",
        chunked_prefill=None,
        max_model_len=32768,
        gpu_memory_utilization=0.9,
        jitter_cv=0.0,
    )
    instance = setup.instance(0)
    instance.add_request(Request(0, input_len, output_len))
    clock, ends = 0.0, []
    while instance.has_work():
        step = instance.step()
        clock += step.duration_s
        if step.emitted:
            ends.append(clock)
    return ends


def test_server_timestamps_follow_the_engine_step_times():
    """One request alone: due times are the engine's step ends, and no chunk leaves before its
    due time; under load too, every chunk of every request is written, in order, none early.
    How long after its due time a chunk leaves is wall-clock time: benchmarks/wall_clock.py
    prints it."""
    with emulator("--jitter-cv", "0") as (url, _):
        post(url, stream_body(list(range(1024)), 20, **USAGE), "solo")
        solo = json.loads(get(f"{url}/servematrix/requests")[1])["solo"]
        bodies = [stream_body(list(range(512)), 30, **USAGE) for _ in range(24)]
        results = asyncio.run(_many(url, bodies, "load"))
        log = json.loads(get(f"{url}/servematrix/requests")[1])
    due = np.array(solo["token_due_s"]) - solo["arrival_s"]
    assert due == pytest.approx(engine_steps(1024, 20), abs=1e-9)
    assert write_lag_s(solo).min() >= 0
    assert all(status == 200 for status, _ in results)
    loaded = [v for k, v in log.items() if k.startswith("load-")]
    assert len(loaded) == 24
    for entry in loaded:
        assert sum(entry["chunk_tokens"]) == len(entry["token_due_s"]) == 30
        assert np.all(np.diff(entry["chunk_s"]) >= 0)
        assert write_lag_s(entry).min() >= 0


def write_lag_s(entry: dict) -> np.ndarray:
    """How long after its last token's due time each chunk was written."""
    last_token = np.cumsum(entry["chunk_tokens"]) - 1
    return np.array(entry["chunk_s"]) - np.array(entry["token_due_s"])[last_token]


def test_loadgen_against_the_emulator():
    from servematrix.client import loadgen
    from servematrix.workload import build_requests

    workload = Workload(
        qps=20.0,
        input_len=256,
        output_len=4,
        num_prompts=12,
        seed=0,
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
        max_concurrency=4,
    )
    requests = build_requests(workload, vocab_size=152064)
    with emulator() as (url, _):
        result = loadgen.run(
            loadgen.ClientSettings(base_url=url, model=MODEL, max_concurrency=4), requests
        )
        log = json.loads(get(f"{url}/servematrix/requests")[1])
    records = result.records
    assert len(records) == 13 and all(r.success for r in records)
    assert [r.prompt_tokens for r in records] == [256] * 13
    assert [r.completion_tokens for r in records] == [4] * 13
    # The server saw every request under its X-Request-Id, with one chunk per token.
    mine = [v for k, v in log.items() if k.startswith(result.request_id_prefix)]
    assert len(mine) == 13 and all(sum(v["chunk_tokens"]) == 4 for v in mine)


def test_client_disconnect_frees_the_request():
    """A client that goes away mid-stream: the engine drops the request (as vLLM aborts it),
    long before its 400 tokens would have been generated."""

    async def read_two_chunks_and_leave(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            body = stream_body(list(range(64)), 400)
            async with session.post(
                f"{url}/v1/completions", json=body, headers={"X-Request-Id": "gone"}
            ) as response:
                await response.content.readuntil(b"\n\n")
                await response.content.readuntil(b"\n\n")

    with emulator() as (url, _):
        asyncio.run(read_two_chunks_and_leave(url))
        running = f'vllm:num_requests_running{{model_name="{MODEL}",engine="0"}}'
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            log = json.loads(get(f"{url}/servematrix/requests")[1])["gone"]
            metrics = parse_metrics(get(f"{url}/metrics")[1].decode())
            if log["outcome"] != "running" and metrics[running] == 0:
                break
            time.sleep(0.05)
    assert log["outcome"] == "aborted" and len(log["chunk_s"]) < 100
    assert metrics[running] == 0


def test_emulator_vs_simulator_benchmark_smoke():
    """The comparison script runs end to end, and the emulator's token due times are exactly
    what the engine gives in virtual time for the arrivals it saw (every request of both
    shapes)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "emulator_vs_simulator.py"
    done = subprocess.run(
        [sys.executable, str(script), "--num-prompts", "6", "--qps", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "server-side (the emulator's own timestamps" in done.stdout
    replay_cells = [line for line in done.stdout.splitlines() if "| 7/7, 0.00 |" in line]
    assert len(replay_cells) == 2


def test_sigterm_with_a_stream_in_flight_cuts_it_and_exits_cleanly():
    """A stopped deployment must not linger: on SIGTERM the emulator cuts the stream still in
    flight (aiohttp would otherwise keep serving it for up to 60 s) and exits with status 0.
    How soon is wall-clock time: benchmarks/wall_clock.py prints it."""

    async def stream_until_cut(url: str, process: subprocess.Popen) -> bytes:
        async with aiohttp.ClientSession() as session:
            body = stream_body([1, 2, 3], 3000)
            async with session.post(f"{url}/v1/completions", json=body) as response:
                received = await response.content.readany()  # the stream has begun
                process.terminate()
                try:
                    async for data in response.content.iter_any():
                        received += data
                except aiohttp.ClientError:
                    pass
                return received

    with emulator() as (url, process):
        received = asyncio.run(stream_until_cut(url, process))
        assert process.wait(timeout=120) == 0  # a hang guard, twice aiohttp's own grace
        output = process.stdout.read()
    assert received.startswith(b"data: ") and b"[DONE]" not in received
    assert "INFO:     Shutting down" in output


SMALL_POOL_UTILIZATION = {"v0": 0.13736, "v1": 0.14368}
"""Where each recipe leaves this model 814 KV blocks (13024 tokens) on an A100 with a
32768-token budget (v1 counts the CUDA graphs, v0 does not: 0.5 GiB apart)."""
SMALL_POOL_BLOCKS = 814


def small_pool(recipe: str) -> tuple[str, ...]:
    return (
        "--recipe", recipe, "--gpu-memory-utilization", str(SMALL_POOL_UTILIZATION[recipe]),
        "--max-num-batched-tokens", "32768",
    )  # fmt: skip


def post_json(url: str) -> dict:
    async def go():
        async with aiohttp.ClientSession() as session, session.post(url) as response:
            assert response.status == 200
            return await response.json()

    return asyncio.run(go())


def test_kv_cache_peak_is_exact_and_restarts_on_reset():
    """``/servematrix/kv_cache`` reports the most blocks ever in use, which a request shorter
    than the sampling interval hides from ``/metrics``; a reset starts a new peak."""
    with emulator("--jitter-cv", "0", "--no-enable-prefix-caching") as (url, _):
        pool = json.loads(get(f"{url}/servematrix/kv_cache")[1])
        assert pool["used_blocks"] == pool["peak_used_blocks"] == 0
        assert pool["block_size_tokens"] == 16 and pool["num_blocks"] > 1000
        # 100 prompt tokens + 19 computed output tokens (the last sampled one has no KV).
        post(url, stream_body(list(range(100)), 20), "one")
        assert json.loads(get(f"{url}/servematrix/kv_cache")[1])["peak_used_blocks"] == 8
        metrics = parse_metrics(get(f"{url}/metrics")[1].decode())
        assert metrics[f'vllm:kv_cache_usage_perc{{model_name="{MODEL}",engine="0"}}'] == 0
        # Two at once: they hold their blocks together.
        asyncio.run(_many(url, [stream_body(list(range(100)), 20)] * 2, "two"))
        assert json.loads(get(f"{url}/servematrix/kv_cache")[1])["peak_used_blocks"] == 16
        reset = post_json(f"{url}/servematrix/kv_cache/reset_peak")
        assert reset["peak_used_blocks"] == reset["used_blocks"] == 0
        post(url, stream_body(list(range(40)), 2), "small")
        assert json.loads(get(f"{url}/servematrix/kv_cache")[1])["peak_used_blocks"] == 3


def test_per_request_preemptions_add_up_to_the_engine_counter():
    """Twelve long requests in a pool that holds about eight: the engine preempts some; each
    request's log counts its own, and together they are ``vllm:num_preemptions_total``."""
    with emulator(
        "--jitter-cv",
        "0",
        "--no-enable-prefix-caching",
        "--max-model-len",
        "4096",
        *small_pool("v1"),
    ) as (url, _):
        post(url, stream_body([7] * 10, 2), "other")
        bodies = [stream_body(list(range(1500)), 200) for _ in range(12)]
        results = asyncio.run(_many(url, bodies, "pre"))
        assert all(status == 200 for status, _ in results)
        log = json.loads(get(f"{url}/servematrix/requests?prefix=pre-")[1])
        metrics = parse_metrics(get(f"{url}/metrics")[1].decode())
    assert sorted(log) == sorted(f"pre-{k}" for k in range(12))  # "other" filtered out
    counts = [entry["preemptions"] for entry in log.values()]
    total = metrics[f'vllm:num_preemptions_total{{model_name="{MODEL}",engine="0"}}']
    assert sum(counts) == total > 0
    assert 0 in counts  # the oldest requests run through


def test_v0_ignores_a_prompt_its_pool_can_never_admit():
    """vLLM 0.6 keeps 1 % of the blocks free when admitting: a prompt needing more than the
    rest is ignored (a warning, a 200 without a token), and the server serves on; one block
    less is served. Before, such a prompt stalled the queue and then crashed the engine."""
    watermark = SMALL_POOL_BLOCKS // 100
    admissible = (SMALL_POOL_BLOCKS - watermark) * 16
    flags = ("--max-model-len", str(SMALL_POOL_BLOCKS * 16), *small_pool("v0"))
    with emulator(*flags) as (url, process):
        too_long = stream_body(list(range(admissible + 1)), 1, stream_options={})
        status, raw = post(url, too_long, "ignored")
        assert status == 200
        payloads = events(raw)
        assert payloads[-1] == "[DONE]"
        (usage,) = [json.loads(p) for p in payloads[:-1]]  # no token chunk, only the usage
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 0
        plain = {"model": MODEL, "prompt": too_long["prompt"], "max_tokens": 1}
        status, raw = post(url, plain, "ignored-plain")
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and (choice["text"], choice["finish_reason"]) == ("", "length")
        status, raw = post(url, stream_body(list(range(admissible)), 2, **USAGE), "fits")
        assert status == 200 and json.loads(events(raw)[-2])["usage"]["completion_tokens"] == 2
        log = json.loads(get(f"{url}/servematrix/requests")[1])
        process.terminate()
        out = process.communicate(timeout=30)[0]
    message = (
        f"Input prompt ({admissible + 1} tokens) + lookahead slots (0) is too long and exceeds "
        "the capacity of block_manager"
    )
    assert out.count(message) == 2
    assert log["ignored"]["outcome"] == f"ignored: {message}"
    assert log["fits"]["outcome"] == "ok"
