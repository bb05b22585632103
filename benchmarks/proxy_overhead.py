"""Latency the proxies of ``servematrix.proxy`` add: each proxy against the same requests sent
directly, TTFT and per-chunk delivery, P50 and P99. Prints a table.

    .venv/bin/python benchmarks/proxy_overhead.py [--requests 200] [--concurrency 1,16]
    .venv/bin/python benchmarks/proxy_overhead.py --proxy-command "python other_proxy.py"

Upstreams are two ``benchmarks/fixed_latency_server.py`` processes (first chunk after
``--first-ms``, then one chunk every ``--chunk-ms``); each proxy runs as its own process with
the command line ``servematrix.deploy`` uses (``--proxy-command`` replaces its
``python -m servematrix.proxy`` part, e.g. to measure an older revision of the module run as a
script). Per path and concurrency, ``--requests`` streamed requests of ``--tokens`` chunks are
sent, ``--concurrency`` at a time, by one aiohttp client in this process; the paths take turns
in ``--rounds`` rounds so that drifts of the machine's load hit them alike.

* TTFT: from sending the request to receiving its first chunk. The direct baseline of each
  proxy is what the proxy does, done by the client itself: ``round-robin`` against one
  streamed request to an upstream (``direct``); ``disagg-v0`` against the prefill copy
  (``max_tokens`` 1, drained) followed by the streamed request (``direct-v0``); ``disagg-v1``
  against the prefill copy (``max_tokens`` 1, not streamed) sent without waiting for it and
  the streamed request at once (``direct-v1``). So the prefill's own time, and for v1 the
  prefill server's work on the same cores, are on both sides of a difference and only the
  proxy's overhead remains: the hop to it and back, plus what its upstream requests cost beyond
  the client's. The second term can be negative (the proxy's requests are cheaper than the
  aiohttp client's), so a disaggregated row can come out below ``round-robin``, even below
  zero; the ``round-robin`` row is the plain cost of the hop.
* chunk: each chunk's delivery time, from the server writing it (``server_ns`` in the chunk,
  ``time.monotonic_ns()`` on the same host) to the client reading it.
* added: proxy percentile minus direct percentile (the target is < 1 ms at P99).
* proxy CPU: the proxy process's user + system CPU time (``/proc``, in 10 ms ticks) over all
  its measured requests, per request: its own work, syscalls included, for one request and
  its ``--tokens`` chunks.

The machine is shared (the client, the proxy and both servers are separate processes on the
same cores), so P99 includes scheduling noise; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "benchmarks" / "fixed_latency_server.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{process.args} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} never became healthy")


@dataclass(frozen=True)
class Route:
    """How the client sends a path's request: the URL it streams from; the prefill copy it
    sends first, if any, awaited (v0) or not (v1); the path its figures are compared with."""

    url: str
    prefill_url: str | None = None
    prefill_awaited: bool = True
    baseline: str | None = None


@dataclass
class Samples:
    ttft_ms: list[float] = field(default_factory=list)
    chunk_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # the proxy's CPU time over these requests


def cpu_s(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drain(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> None:
    async with session.post(url, json=body) as response:
        await response.read()


async def one_request(
    session: aiohttp.ClientSession, route: Route, body: dict[str, object], samples: Samples
) -> None:
    sent = time.monotonic_ns()
    prefill = None
    if route.prefill_url is not None and route.prefill_awaited:
        await drain(session, route.prefill_url, {**body, "max_tokens": 1})
    elif route.prefill_url is not None:
        copy = {**body, "max_tokens": 1, "stream": False}
        prefill = asyncio.create_task(drain(session, route.prefill_url, copy))
    first = True
    buffer = b""
    url = route.url
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise SystemExit(f"{url}: HTTP {response.status}: {await response.text()}")
        async for data in response.content.iter_any():
            now = time.monotonic_ns()
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                if first:
                    samples.ttft_ms.append((now - sent) / 1e6)
                    first = False
                samples.chunk_ms.append((now - json.loads(event[6:])["server_ns"]) / 1e6)
    if prefill is not None:
        await prefill


async def run_batch(
    session: aiohttp.ClientSession,
    route: Route,
    requests: int,
    concurrency: int,
    tokens: int,
    samples: Samples,
) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": tokens, "stream": True}
    queue = iter(range(requests))

    async def worker() -> None:
        for _ in queue:
            await one_request(session, route, body, samples)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def measure(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]) -> None:
    a, b = (urls[name] + "/v1/completions" for name in ("a", "b"))
    paths = {
        "direct": Route(a),
        "direct-v0": Route(b, a),
        "direct-v1": Route(b, a, prefill_awaited=False),
        "round-robin": Route(urls["round-robin"] + "/v1/completions", baseline="direct"),
        "disagg-v0": Route(urls["disagg-v0"] + "/v1/completions", baseline="direct-v0"),
        "disagg-v1": Route(urls["disagg-v1"] + "/v1/completions", baseline="direct-v1"),
    }
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for concurrency in args.concurrency:
            results = {name: Samples() for name in paths}
            per_round = max(args.requests // args.rounds, concurrency)
            # Warm the pools of every hop (client, proxy) before anything is recorded.
            for route in paths.values():
                await run_batch(session, route, concurrency, concurrency, 2, Samples())
            for _ in range(args.rounds):
                for name, route in paths.items():
                    before = cpu_s(pids[name]) if name in pids else 0.0
                    await run_batch(
                        session, route, per_round, concurrency, args.tokens, results[name]
                    )
                    if name in pids:
                        results[name].cpu_s += cpu_s(pids[name]) - before
            print_table(concurrency, paths, results)


def print_table(concurrency: int, paths: dict[str, Route], results: dict[str, Samples]) -> None:
    print(f"\nconcurrency {concurrency}")
    print(
        f"{'path':<12} {'n':>5} | {'TTFT P50':>8} {'P99':>7} {'added P50':>9} {'P99':>7}"
        f" | {'chunk P50':>9} {'P99':>7} {'added P50':>9} {'P99':>7}"
        f" | {'proxy CPU/req':>13}   (ms)"
    )
    for name, route in paths.items():
        s, baseline = results[name], route.baseline
        row = f"{name:<12} {len(s.ttft_ms):>5}"
        for metric in ("ttft_ms", "chunk_ms"):
            values = getattr(s, metric)
            p50, p99 = pct(values, 50), pct(values, 99)
            row += f" | {p50:>8.3f} {p99:>7.3f}"
            if baseline:
                base = getattr(results[baseline], metric)
                row += f" {p50 - pct(base, 50):>+9.3f} {p99 - pct(base, 99):>+7.3f}"
            else:
                row += f" {'':>9} {'':>7}"
        if baseline:
            row += f" | {s.cpu_s * 1e3 / len(s.ttft_ms):>13.3f}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--requests", type=int, default=200, help="per path and concurrency")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--tokens", type=int, default=16, help="chunks per request")
    parser.add_argument("--first-ms", type=float, default=5.0)
    parser.add_argument("--chunk-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--proxy-command",
        default=f"{sys.executable} -m servematrix.proxy",
        help="what runs a proxy, before its kind and flags (split on spaces)",
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    ports = {name: free_port() for name in ("a", "b", "round-robin", "disagg-v0", "disagg-v1")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    py = sys.executable
    timing = ["--first-ms", str(args.first_ms), "--chunk-ms", str(args.chunk_ms)]
    proxy = args.proxy_command.split()
    commands = {
        "a": [py, str(SERVER), "--port", str(ports["a"]), "--name", "a", "--stamp", *timing],
        "b": [py, str(SERVER), "--port", str(ports["b"]), "--name", "b", "--stamp", *timing],
        "round-robin": [*proxy, "round-robin", "--port", str(ports["round-robin"]),
                        "--upstream", urls["a"], "--upstream", urls["b"]],
        "disagg-v0": [*proxy, "disagg-v0", "--port", str(ports["disagg-v0"]),
                      "--prefill", urls["a"], "--decode", urls["b"]],
        "disagg-v1": [*proxy, "disagg-v1", "--port", str(ports["disagg-v1"]),
                      "--prefill", urls["a"], str(ports["a"]), "--decode", urls["b"]],
    }  # fmt: skip
    processes = {}
    try:
        for name, argv in commands.items():
            processes[name] = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.DEVNULL)
        for name, process in processes.items():
            wait_healthy(urls[name], process)
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"proxy overhead: {args.requests} requests x {args.tokens} chunks per path, "
            f"first chunk {args.first_ms} ms, then every {args.chunk_ms} ms; "
            f"proxy: {args.proxy_command}; "
            f"{os.cpu_count()} CPUs, load average {load}"
        )
        pids = {name: processes[name].pid for name in ("round-robin", "disagg-v0", "disagg-v1")}
        asyncio.run(measure(args, urls, pids))
        print(f"\nload average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=10)


if __name__ == "__main__":
    main()
