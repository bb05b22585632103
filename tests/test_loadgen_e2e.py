"""The load generator against real servers: the emulator as a subprocess on a free port, a
socket that never answers, a port with nothing, and a server that hangs mid-request."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from servematrix.client import loadgen
from servematrix.spec import trace
from servematrix.spec.matrix import Workload
from servematrix.workload import build_requests

BIN = Path(sys.executable).parent
MODEL = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"
VOCAB = 152064

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def emulator(*flags: str) -> Iterator[str]:
    """The emulator on a free port (not waited for: the load generator's readiness check is
    under test); yields its URL, stops it."""
    port = free_port()
    process = subprocess.Popen(
        [
            *(str(BIN / "servematrix-emulator"), "serve", MODEL, "--host", "127.0.0.1"),
            *("--port", str(port), "--jitter-cv", "0", "--straggler-probability", "0", *flags),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.terminate()
        process.communicate(timeout=30)


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "servematrix"), "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def max_in_flight(records) -> int:
    """Most requests open at once according to the trace (send to last token)."""
    events = sorted(
        [(r.sent_s, 1) for r in records] + [(r.end_s or r.sent_s, -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )
    return int(np.max(np.cumsum([step for _, step in events])))


def workload(**overrides) -> Workload:
    values = dict(
        qps=30.0,
        input_len=300,
        output_len=5,
        num_prompts=40,
        seed=1,
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
    )
    return Workload(**{**values, **overrides})


def run(url: str, w: Workload, **settings) -> loadgen.RunResult:
    client = loadgen.ClientSettings(
        base_url=url, model=MODEL, max_concurrency=w.max_concurrency, **settings
    )
    return loadgen.run(client, build_requests(w, VOCAB))


def test_bench_writes_a_trace_that_metrics_reads(tmp_path):
    output = tmp_path / "trace.parquet"
    with emulator() as url:
        done = bench(
            *["--base-url", url, "--model", MODEL, "--qps", "20", "--num-prompts", "30"],
            *["--input-len", "300", "--output-len", "5", "--range-ratio", "0.5"],
            *["--max-concurrency", "3", "--warmup-requests", "2", "--seed", "4"],
            *["-o", str(output)],
        )
    assert done.returncode == 0, done.stderr
    table = trace.read(output)
    rows = table.to_pylist()
    assert len(rows) == 32 and [r["request_id"] for r in rows] == list(range(32))
    assert [r["warmup"] for r in rows] == [True, True] + [False] * 30
    assert all(r["success"] and r["error"] is None for r in rows)
    assert all(r["backend"] == "external" for r in rows)
    # Exact token-id prompts: the server counted exactly the planned (spread) lengths.
    inputs = [r["request_input_len"] for r in rows]
    assert [r["prompt_tokens"] for r in rows] == inputs and len(set(inputs)) > 5
    assert min(inputs) >= 150 and max(inputs) <= 450
    assert all(r["completion_tokens"] == r["request_output_len"] for r in rows)
    assert all(sum(r["chunk_tokens"]) == r["completion_tokens"] for r in rows)
    # Warm-ups before t = 0, one at a time; measured sends never before their schedule.
    warm, measured = rows[:2], rows[2:]
    assert warm[0]["end_s"] <= warm[1]["sent_s"] and warm[1]["end_s"] < 0
    assert all(r["sent_s"] >= r["scheduled_s"] >= 0 for r in measured)
    assert all(
        r["first_token_s"] == r["chunk_s"][0] and r["end_s"] == r["chunk_s"][-1] for r in rows
    )
    records = [trace.RequestRecord(**{k: r[k] for k in trace.REQUEST_COLUMNS}) for r in measured]
    assert max_in_flight(records) <= 3
    meta = trace.read_metadata(output)
    assert meta["clock"]["origin_monotonic_s"] > 0
    assert meta["workload"]["max_concurrency"] == 3 and meta["bench"]["vocab_size"] == VOCAB
    assert pq.read_schema(output).metadata is not None
    shown = subprocess.run(
        [str(BIN / "servematrix"), "metrics", str(output)], capture_output=True, text=True
    )
    assert shown.returncode == 0 and "Successful requests:                    30" in shown.stdout


def test_qps_inf_with_a_concurrency_cap_and_injected_failures():
    """Every request at t = 0, at most 4 in flight; HTTP 500s and streams cut mid-way are rows
    with their error, and every other row is intact."""
    w = workload(qps=float("inf"), num_prompts=60, max_concurrency=4, output_len=4)
    flags = ("--fail-fraction", "0.2", "--drop-after-chunks", "2", "--drop-fraction", "0.2")
    with emulator(*flags) as url:
        result = run(url, w)
    records = [r for r in result.records if not r.warmup]
    assert gc.get_freeze_count() == 0  # the run froze the prompts and let them go again
    assert len(result.records) == 61 and len(records) == 60
    assert all(r.scheduled_s == 0.0 for r in records)
    assert max_in_flight(records) <= 4
    failed = [r for r in records if not r.success]
    http = [r for r in failed if r.error.startswith("HTTP 500")]
    cut = [r for r in failed if not r.error.startswith("HTTP 500")]
    assert http and cut and len(failed) < 40
    assert all(not r.chunk_s and r.first_token_s is None for r in http)
    # What arrived before the cut is kept (the second chunk may still be in the server's
    # buffer when it aborts the connection).
    assert all(len(r.chunk_s) <= 2 for r in cut) and any(len(r.chunk_s) == 2 for r in cut)
    ok = [r for r in records if r.success]
    assert all(r.completion_tokens == 4 and r.prompt_tokens == 300 for r in ok)
    assert all(sum(r.chunk_tokens) == 4 and len(r.chunk_s) == len(r.chunk_tokens) for r in ok)


def test_the_openai_client_sends_the_same_requests():
    """``client="openai"`` (AsyncOpenAI) against the same server: same rows, same usage, and
    the server saw the same bodies."""
    w = workload(num_prompts=8, max_concurrency=2)
    with emulator("--fail-fraction", "0.3") as url:
        ours = run(url, w)
        sdk = run(url, w, client="openai")
    for result in (ours, sdk):
        assert [r.request_id for r in result.records] == list(range(9))
    assert sdk.client == "openai" and sdk.metadata()["client"]["client"] == "openai"
    for a, b in zip(ours.records, sdk.records, strict=True):
        assert (a.prompt_tokens, a.request_input_len) == (b.prompt_tokens, b.request_input_len)
    failed = [r for r in sdk.records if not r.success]
    assert all(r.error.startswith("HTTP 500: ") for r in failed)
    assert all(r.completion_tokens == 5 for r in sdk.records if r.success)


def test_a_server_that_dies_mid_run_fails_the_rest_and_the_run_ends():
    """Constant 4 QPS: each request is done before the next, so the first 10 (the warm-up and
    9 measured) succeed and the 11th kills the server; every later one is a refused row."""
    w = workload(qps=4.0, burstiness=float("inf"), num_prompts=16)
    with emulator("--die-after-requests", "10") as url:
        started = time.monotonic()
        result = run(url, w, request_timeout_s=60)
        took = time.monotonic() - started
    assert [r.request_id for r in result.records] == list(range(17)) and took < 60
    ok = [r.request_id for r in result.records if r.success]
    assert set(ok) <= set(range(10)) and len(ok) >= 8  # a loaded machine may overlap two
    failed = [r for r in result.records if not r.success]
    assert all(r.error.startswith("connection error: ") for r in failed)
    assert all("\n" not in r.error for r in failed)
    after = [r for r in result.records if r.request_id >= 11]
    assert all("ConnectionRefusedError" in r.error for r in after)


def _bench_against(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    output = tmp_path / "trace.parquet"
    done = bench(
        "--base-url", url, "--model", MODEL, "--num-prompts", "3", "-o", str(output), *extra
    )
    assert not output.exists() and list(tmp_path.iterdir()) == []
    return done


def test_a_socket_that_never_answers_is_one_error_line_and_no_trace(tmp_path):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)  # accepted by the kernel, never read, never answered
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        started = time.monotonic()
        done = _bench_against(url, tmp_path, "--ready-timeout-s", "2")
        took = time.monotonic() - started
    waiting, error = _wait_and_error(done)
    assert waiting.endswith(
        f"waiting up to 2 s (30 s if its port refuses connections) for GET {url}/health to answer"
    )
    assert error.startswith(f"servematrix bench: server at {url} never became ready within 2 s")
    assert "no answer" in error
    assert took < 60


def test_a_port_with_nothing_is_one_error_line_and_no_trace(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    done = _bench_against(url, tmp_path, "--ready-timeout-s", "1")
    _, error = _wait_and_error(done)
    assert f"server at {url} never became ready within 1 s" in error
    assert "ConnectionRefusedError" in error  # the last probe's failure is named


def test_a_closed_port_is_given_up_after_the_refused_timeout(tmp_path):
    """What is waited for, where and how long at once, then every 15 s; a port that refuses
    every connection ends the wait after --refused-timeout-s, not the 600 s of a load."""
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = _bench_against(url, tmp_path, "--refused-timeout-s", "17")
    took = time.monotonic() - started
    lines = [
        line.split(" ", 2)[2] if line[:2] == "20" else line for line in done.stderr.splitlines()
    ]
    assert done.returncode == 1 and 17 <= took < 40
    sooner = "(17 s if its port refuses connections)"
    assert lines[0] == f"waiting up to 600 s {sooner} for GET {url}/health to answer"
    assert lines[1].startswith(
        f"still waiting for {url}/health: 15 s of 600 s (last probe: ConnectionRefusedError"
    )
    # the seconds it waited: 17 or a little more on a loaded machine, never fewer
    given_up = re.match(
        rf"servematrix bench: nothing listens at {re.escape(url)}: every connection refused "
        r"for (\d+) s",
        lines[2],
    )
    assert given_up is not None and int(given_up.group(1)) >= 17, lines[2]
    assert len(lines) == 3


def _wait_and_error(done: subprocess.CompletedProcess) -> tuple[str, str]:
    """A bench that could not start: the line of what it waited for, then one error line."""
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) == 2, done.stderr
    return lines[0], lines[1]


@pytest.mark.parametrize(
    ("flags", "bench_flags", "status", "last"),
    [
        ((), (), 0, ": 6 requests, 0 failed"),
        (("--fail-fraction", "0.5"), (), 3, ": the run partly failed (first error: HTTP 500"),
        (("--die-after-requests", "3"), (), 1, "stopped answering (first error: connection error"),
    ],
    ids=["all ok", "partly failed", "server died"],
)
def test_bench_exit_status_says_how_the_run_went(tmp_path, flags, bench_flags, status, last):
    output = tmp_path / "trace.parquet"
    with emulator(*flags) as url:
        done = bench(
            *["--base-url", url, "--model", MODEL, "--num-prompts", "6", "--qps", "4"],
            *["--burstiness", "inf", "--output-len", "3", "--input-len", "100", *bench_flags],
            *["-o", str(output)],
        )
    assert done.returncode == status, done.stderr
    assert last in done.stderr.splitlines()[-1]
    assert output.is_file()  # the run ended: its rows say what failed


def test_bench_whose_every_request_failed_writes_no_trace(tmp_path):
    """Inputs beyond the server's context, no warm-up (a refused warm-up stops first)."""
    output = tmp_path / "trace.parquet"
    with emulator("--max-model-len", "512") as url:
        done = bench(
            *["--base-url", url, "--model", MODEL, "--num-prompts", "6", "--qps", "4"],
            *["--input-len", "600", "--output-len", "3", "--warmup-requests", "0"],
            *["-o", str(output)],
        )
    assert done.returncode == 1, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(
        f"servematrix bench: all 6 requests to {url}/v1/completions failed; first: HTTP 400"
    )
    assert last.endswith("; no trace written") and list(tmp_path.iterdir()) == []


def test_jsonl_lengths_per_request_and_a_wrong_model_name(tmp_path):
    """A jsonl file of per-request lengths is sent as exactly those lengths, cycling through the
    file; a model the server does not serve is one line and no trace."""
    data = tmp_path / "lengths.jsonl"
    data.write_text(
        "".join(
            f'{{"input_len": {n}, "output_len": {m}}}\n' for n, m in [(50, 2), (700, 7), (123, 1)]
        )
    )
    output = tmp_path / "trace.parquet"
    wrong = tmp_path / "wrong.parquet"
    with emulator() as url:
        done = bench(
            *["--base-url", url, "--model", MODEL, "--qps", "inf", "--num-prompts", "7"],
            *["--dataset", "jsonl", "--dataset-path", str(data), "--warmup-requests", "0"],
            *["-o", str(output)],
        )
        refused = bench("--base-url", url, "--model", "other/model", "-o", str(wrong))
    assert done.returncode == 0, done.stderr
    rows = trace.read(output).to_pylist()
    assert [r["prompt_tokens"] for r in rows] == [50, 700, 123, 50, 700, 123, 50]
    assert [r["completion_tokens"] for r in rows] == [2, 7, 1, 2, 7, 1, 2]
    assert [r["request_output_len"] for r in rows] == [2, 7, 1, 2, 7, 1, 2]
    _, error = _wait_and_error(refused)
    assert f"does not serve model 'other/model' (it serves: {MODEL})" in error
    assert not wrong.exists()


@contextmanager
def hanging_server(health_ports: list | None = None) -> Iterator[str]:
    """Ready (/health 200) but never answers a completion: for the per-request timeout.
    The client port of every /health request goes into ``health_ports``."""

    async def health(request):
        if health_ports is not None:
            health_ports.append(request.transport.get_extra_info("peername")[1])
        return web.Response()

    async def hang(request):
        await asyncio.sleep(3600)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", hang)
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_a_request_that_never_ends_times_out_as_a_failed_row():
    """Also: before the clock, one connection per request that can be in flight was opened."""
    ports: list[int] = []
    with hanging_server(ports) as url:
        result = run(url, workload(num_prompts=3, warmup_requests=0), request_timeout_s=1)
    assert [r.success for r in result.records] == [False] * 3
    assert all(r.error == "timed out after 1 s" for r in result.records)
    assert len(ports) == 1 + 3 and len(set(ports[1:])) == 3  # readiness, then 3 connections


def test_environment_proxies_are_ignored():
    """A benchmark talks to its server: an HTTP proxy in the environment must not intercept."""
    with hanging_server() as url:
        env = {**os.environ, "HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
        code = (
            "import asyncio, sys; from servematrix.client import loadgen; "
            f"s = loadgen.ClientSettings({url!r}, 'm', None, ready_timeout_s=5); "
            "asyncio.run(loadgen.wait_ready(s)); print('ready')"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    assert done.stdout.strip() == "ready", done.stderr
    assert json.dumps(None) == "null"


def test_a_warm_up_the_server_refuses_stops_the_run_with_its_reason(tmp_path):
    """A warm-up refused with a 4xx would be the fate of every request: one line, no trace."""
    with emulator("--max-model-len", "2048") as url:
        done = _bench_against(url, tmp_path, "--input-len", "3000", "--output-len", "4")
    waiting, refusal = done.stderr.splitlines()  # what it waited for, then the one error line
    assert done.returncode == 1 and "waiting up to" in waiting, done.stderr
    assert refusal.startswith(
        f"servematrix bench: the server at {url} refused the warm-up request (HTTP 400: This "
        "model's maximum context length is 2048 tokens. However, your prompt contains 3000 input "
        "tokens"
    ), done.stderr
    assert done.stderr.rstrip().endswith("no measured request was sent")
