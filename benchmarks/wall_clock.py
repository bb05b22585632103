"""The wall-clock claims the tests leave out (a test states what happened, in what order; how
long it took depends on the machine): printed here, never asserted.

- the emulator's chunk write lag: how long after its due time (the engine step's end) each
  chunk is written, one request alone and 24 at once;
- the emulator's exit on SIGTERM with a stream in flight (cut after ``SHUTDOWN_GRACE_S``
  instead of aiohttp's 60 s);
- a deployment's stop: SIGTERM ignored, then SIGKILL after ``stop_timeout_s``.

Run from the repository root: ``.venv/bin/python benchmarks/wall_clock.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from servematrix.deploy.processes import Health, Plan, Process
from servematrix.deploy.supervise import Deployment
from servematrix.emulator.cli import SHUTDOWN_GRACE_S

MODEL = "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_emulator() -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = [sys.executable, "-m", "servematrix.emulator", "serve", MODEL, "--jitter-cv", "0"]
    process = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return f"http://127.0.0.1:{port}", process
        except OSError:
            time.sleep(0.05)


def body(input_len: int, max_tokens: int) -> dict:
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    prompt = list(range(input_len))
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **usage}


async def post_all(url: str, bodies: list[dict], prefix: str) -> None:
    async with aiohttp.ClientSession() as session:

        async def one(i: int, payload: dict) -> None:
            headers = {"X-Request-Id": f"{prefix}-{i}"}
            async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as r:
                await r.read()

        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def write_lag_ms(entry: dict) -> np.ndarray:
    """How long after its last token's due time each chunk was written."""
    last_token = np.cumsum(entry["chunk_tokens"]) - 1
    due = np.array(entry["token_due_s"])[last_token]
    return (np.array(entry["chunk_s"]) - due) * 1e3


def emulator_write_lag() -> None:
    url, process = start_emulator()
    try:
        asyncio.run(post_all(url, [body(1024, 20)], "solo"))
        asyncio.run(post_all(url, [body(512, 30) for _ in range(24)], "load"))
        with urllib.request.urlopen(f"{url}/servematrix/requests") as response:
            log = json.loads(response.read())
    finally:
        process.terminate()
        process.wait()
    solo = write_lag_ms(log["solo-0"])
    loaded = np.concatenate([write_lag_ms(v) for k, v in log.items() if k.startswith("load-")])
    print("emulator chunk write lag (ms)      min    p50    p99    max")
    for name, lags in (("one request", solo), ("24 at once", loaded)):
        stats = (lags.min(), np.median(lags), np.percentile(lags, 99), lags.max())
        print(f"  {name:<30}" + "".join(f"{value:7.2f}" for value in stats))


async def _sigterm_mid_stream(url: str, process: subprocess.Popen) -> float:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body(3, 3000)) as response,
    ):
        await response.content.readany()
        process.terminate()
        began = time.monotonic()
        try:
            async for _ in response.content.iter_any():
                pass
        except aiohttp.ClientError:
            pass
    while process.poll() is None:
        await asyncio.sleep(0.01)
    return time.monotonic() - began


def emulator_sigterm_exit() -> None:
    url, process = start_emulator()
    exit_s = asyncio.run(_sigterm_mid_stream(url, process))
    print(
        f"emulator exit after SIGTERM, a stream in flight: {exit_s:.2f} s "
        f"(grace {SHUTDOWN_GRACE_S:g} s; aiohttp's own: 60 s)"
    )


STUBBORN = """
import http.server, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
handler = http.server.SimpleHTTPRequestHandler
http.server.HTTPServer(("127.0.0.1", {port}), handler).serve_forever()
"""


def deployment_stop(stop_timeout_s: float = 1.0) -> None:
    port = free_port()
    code = STUBBORN.format(port=port)
    process = Process(
        "stubborn", ("python3", "-c", code), {}, port, Health(f"http://127.0.0.1:{port}/")
    )
    plan = Plan("emulator", "v1", "m", "single", (process,), "http://127.0.0.1:1/v1", "bench")
    with tempfile.TemporaryDirectory() as scratch:
        deployment = Deployment(plan, Path(scratch), Path(scratch), "127.0.0.1", 30, stop_timeout_s)
        deployment.start()
        began = time.monotonic()
        deployment.stop()
        stop_s = time.monotonic() - began
    print(f"stop of a process ignoring SIGTERM: {stop_s:.2f} s (stop_timeout_s {stop_timeout_s:g})")


def main() -> None:
    emulator_write_lag()
    emulator_sigterm_exit()
    deployment_stop()


if __name__ == "__main__":
    main()
