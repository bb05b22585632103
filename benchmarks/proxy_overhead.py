"""Latency the proxies of ``servematrix.proxy`` add: each proxy against the same requests sent
directly, TTFT and per-chunk delivery, P50 and P99. Prints a table.

    .venv/bin/python benchmarks/proxy_overhead.py [--requests 200] [--concurrency 1,16]
    .venv/bin/python benchmarks/proxy_overhead.py --proxy-command "python other_proxy.py"
    .venv/bin/python benchmarks/proxy_overhead.py --concurrency 1 \
        --proxy-command "old=env PYTHONPATH=/tmp/old/src python -m servematrix.proxy" \
        --proxy-command "new=python -m servematrix.proxy"

Upstreams are two ``benchmarks/fixed_latency_server.py`` processes (first chunk after
``--first-ms``, then one chunk every ``--chunk-ms``); each proxy runs as its own process with
the command line ``servematrix.deploy`` uses (``--proxy-command`` replaces its
``python -m servematrix.proxy`` part, e.g. to measure an older revision of the module). Given
more than once, each as ``LABEL=COMMAND``, every revision's three proxies run side by side
against the same upstreams (their paths named ``KIND:LABEL``), taking turns with the direct
paths, and a last table sets the revisions' added latencies side by side, with the last one's
minus the first one's. Per path and concurrency, ``--requests`` streamed requests of
``--tokens`` chunks are sent, ``--concurrency`` at a time, by one aiohttp client in this
process; the paths take turns in ``--rounds`` rounds (every other one in reverse order) so
that drifts of the machine's load hit them alike.

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
import itertools
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
KINDS = ("round-robin", "disagg-v0", "disagg-v1")
BASELINES = {"round-robin": "direct", "disagg-v0": "direct-v0", "disagg-v1": "direct-v1"}


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


async def measure(
    args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int], labels: list[str]
) -> None:
    a, b = (urls[name] + "/v1/completions" for name in ("a", "b"))
    paths = {
        "direct": Route(a),
        "direct-v0": Route(b, a),
        "direct-v1": Route(b, a, prefill_awaited=False),
    }
    # By kind, the revisions of each next to each other: a burst of load hits them alike.
    for name in sorted(pids, key=lambda name: KINDS.index(name.split(":", 1)[0])):
        kind = name.split(":", 1)[0]
        paths[name] = Route(urls[name] + "/v1/completions", baseline=BASELINES[kind])
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for concurrency in args.concurrency:
            results = {name: Samples() for name in paths}
            per_round = max(args.requests // args.rounds, concurrency)
            # Warm the pools of every hop (client, proxy) before anything is recorded.
            for route in paths.values():
                await run_batch(session, route, concurrency, concurrency, 2, Samples())
            for round_ in range(args.rounds):
                # Every other round in reverse, so that no path always follows the same one.
                order = list(paths.items())
                for name, route in order[::-1] if round_ % 2 else order:
                    before = cpu_s(pids[name]) if name in pids else 0.0
                    await run_batch(
                        session, route, per_round, concurrency, args.tokens, results[name]
                    )
                    if name in pids:
                        results[name].cpu_s += cpu_s(pids[name]) - before
            print_table(concurrency, paths, results)
            if len(labels) > 1:
                print_side_by_side(concurrency, paths, results, labels)


def added(results: dict[str, Samples], name: str, baseline: str, metric: str, q: float) -> float:
    """A path's percentile of ``metric`` minus its direct baseline's."""
    values, base = getattr(results[name], metric), getattr(results[baseline], metric)
    return pct(values, q) - pct(base, q)


def print_side_by_side(
    concurrency: int, paths: dict[str, Route], results: dict[str, Samples], labels: list[str]
) -> None:
    """Each proxy kind's added TTFT and chunk P50/P99 per revision, and last minus first."""
    print(f"\nside by side, concurrency {concurrency}: added over direct, P50 / P99 (ms)")
    columns = " | ".join(f"{label:>15}" for label in labels)
    print(f"{'proxy':<12} {'metric':<6} | {columns} | {labels[-1] + ' - ' + labels[0]:>17}")
    for kind in KINDS:
        for metric, title in (("ttft_ms", "TTFT"), ("chunk_ms", "chunk")):
            cells = []
            for label in labels:
                name = f"{kind}:{label}"
                baseline = paths[name].baseline
                assert baseline is not None
                p50, p99 = (added(results, name, baseline, metric, q) for q in (50, 99))
                cells.append((p50, p99))
            row = f"{kind:<12} {title:<6} | "
            row += " | ".join(f"{p50:>+7.3f} {p99:>+7.3f}" for p50, p99 in cells)
            delta50, delta99 = cells[-1][0] - cells[0][0], cells[-1][1] - cells[0][1]
            print(f"{row} | {delta50:>+8.3f} {delta99:>+8.3f}")


def print_table(concurrency: int, paths: dict[str, Route], results: dict[str, Samples]) -> None:
    width = max(12, *(len(name) for name in paths))
    print(f"\nconcurrency {concurrency}")
    print(
        f"{'path':<{width}} {'n':>5} | {'TTFT P50':>8} {'P99':>7} {'added P50':>9} {'P99':>7}"
        f" | {'chunk P50':>9} {'P99':>7} {'added P50':>9} {'P99':>7}"
        f" | {'proxy CPU/req':>13}   (ms)"
    )
    for name, route in paths.items():
        s, baseline = results[name], route.baseline
        row = f"{name:<{width}} {len(s.ttft_ms):>5}"
        for metric in ("ttft_ms", "chunk_ms"):
            values = getattr(s, metric)
            p50, p99 = pct(values, 50), pct(values, 99)
            row += f" | {p50:>8.3f} {p99:>7.3f}"
            if baseline:
                a50, a99 = (added(results, name, baseline, metric, q) for q in (50, 99))
                row += f" {a50:>+9.3f} {a99:>+7.3f}"
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
        action="append",
        help="what runs a proxy, before its kind and flags (split on spaces); repeated, each "
        "as LABEL=COMMAND, to measure revisions side by side "
        f"(default: {sys.executable} -m servematrix.proxy)",
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    proxies = proxy_commands(args.proxy_command or [f"{sys.executable} -m servematrix.proxy"])

    names = {label: [f"{kind}:{label}" if label else kind for kind in KINDS] for label in proxies}
    ports = {name: free_port() for name in ("a", "b", *itertools.chain(*names.values()))}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    py = sys.executable
    timing = ["--first-ms", str(args.first_ms), "--chunk-ms", str(args.chunk_ms)]
    commands = {
        "a": [py, str(SERVER), "--port", str(ports["a"]), "--name", "a", "--stamp", *timing],
        "b": [py, str(SERVER), "--port", str(ports["b"]), "--name", "b", "--stamp", *timing],
    }
    for label, proxy in proxies.items():
        rr, v0, v1 = names[label]
        commands[rr] = [*proxy, "round-robin", "--port", str(ports[rr]),
                        "--upstream", urls["a"], "--upstream", urls["b"]]  # fmt: skip
        commands[v0] = [*proxy, "disagg-v0", "--port", str(ports[v0]),
                        "--prefill", urls["a"], "--decode", urls["b"]]  # fmt: skip
        commands[v1] = [*proxy, "disagg-v1", "--port", str(ports[v1]),
                        "--prefill", urls["a"], str(ports["a"]), "--decode", urls["b"]]  # fmt: skip
    processes = {}
    try:
        for name, argv in commands.items():
            processes[name] = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.DEVNULL)
        for name, process in processes.items():
            wait_healthy(urls[name], process)
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        described = "; ".join(f"{label or 'proxy'}: {' '.join(p)}" for label, p in proxies.items())
        print(
            f"proxy overhead: {args.requests} requests x {args.tokens} chunks per path, "
            f"first chunk {args.first_ms} ms, then every {args.chunk_ms} ms; "
            f"{described}; {os.cpu_count()} CPUs, load average {load}"
        )
        pids = {name: processes[name].pid for name in itertools.chain(*names.values())}
        asyncio.run(measure(args, urls, pids, list(proxies)))
        print(f"\nload average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=10)


def proxy_commands(given: list[str]) -> dict[str, list[str]]:
    """Each ``--proxy-command`` by its label (``""`` for the only, unlabelled one) as argv."""
    if len(given) == 1 and "=" not in given[0].split()[0]:
        return {"": given[0].split()}
    commands = {}
    for text in given:
        label, sep, command = text.partition("=")
        if not sep or not label or " " in label or label in commands:
            raise SystemExit(f"--proxy-command {text!r}: give each as LABEL=COMMAND, labels apart")
        commands[label] = command.split()
    return commands


if __name__ == "__main__":
    main()
