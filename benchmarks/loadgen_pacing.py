"""Load generator pacing and cost: does it send on time, and what does a request cost it?

    .venv/bin/python benchmarks/loadgen_pacing.py [--qps 10 100 500] [--duration-s 10]

Runs `servematrix.client.loadgen` in this process against ``benchmarks/fixed_latency_server.py``
(started here on a free port: first chunk after 5 ms, then a chunk every 2 ms) with the random
dataset (1024-token prompts, 6 output tokens), Poisson arrivals, for each QPS, client
(``senders.CLIENTS``: the default aiohttp session, or ``openai.AsyncOpenAI``) and pacing:

* ``timer``: ``asyncio.sleep`` to the send instant alone (``loadgen.SPIN_S = 0``), which
  wakes up to a millisecond late (epoll's timeout is whole milliseconds);
* ``timer+spin`` (the default): the timer ``SPIN_S`` early, then yielding to the loop until
  the instant.

First, how long one full garbage collection takes with a cell's prompts in memory, and once
they are frozen (``gc.freeze``, as the load generator does before the clock starts). Then the
pacing alone on an idle loop: send lag and CPU per send for no spin, the default
``SPIN_S`` and a whole millisecond. Then, per point: achieved QPS (measured requests over the
time from the first send to the last send), send lag (``sent_s - scheduled_s``) P50/P99/max,
the server's arrival time minus the client's ``sent_s`` (P50/P99: what the client's request
path and the loopback add before the server sees the request), and the client's CPU time per
request and as a share of one core over the run (``time.process_time``, all threads). Failed
requests are counted. Timing on a shared machine varies run to run; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from servematrix.client import loadgen
from servematrix.spec.matrix import Workload
from servematrix.workload import build_requests

HERE = Path(__file__).resolve().parent
RUNS = (  # client, pacing label, spin
    ("aiohttp", "timer", False),
    ("aiohttp", "timer+spin", True),
    ("openai", "timer+spin", True),
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_arrivals(url: str) -> dict[str, float]:
    """X-Request-Id -> the server's time.monotonic() when the request arrived."""
    import json

    with urllib.request.urlopen(f"{url}/requests") as response:
        received = json.load(response)
    out = {}
    for entry in received:
        headers = {k.lower(): v for k, v in entry["headers"].items()}
        if "x-request-id" in headers:
            out[headers["x-request-id"]] = entry["received_ns"] / 1e9
    return out


def point(url: str, qps: float, duration_s: float, seed: int, client: str) -> dict[str, float]:
    n = max(20, int(qps * duration_s))
    w = Workload(
        qps=qps,
        input_len=1024,
        output_len=6,
        num_prompts=n,
        seed=seed,
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
    )
    requests = build_requests(w, vocab_size=32000)
    settings = loadgen.ClientSettings(url, "fixed", None, ready_timeout_s=30, client=client)
    cpu = time.process_time()
    result = loadgen.run(settings, requests)
    cpu = time.process_time() - cpu
    measured = [r for r in result.records if not r.warmup]
    sent = np.array([r.sent_s for r in measured])
    lag_ms = (sent - np.array([r.scheduled_s for r in measured])) * 1e3
    arrivals = server_arrivals(url)
    arrive_ms = np.array(
        [
            (arrivals[f"{result.request_id_prefix}-{r.request_id}"] - result.origin_monotonic_s)
            * 1e3
            - r.sent_s * 1e3
            for r in measured
            if f"{result.request_id_prefix}-{r.request_id}" in arrivals
        ]
    )
    span_s = sent.max() - sent.min()
    end_s = max(r.end_s or r.sent_s for r in measured)
    return {
        "n": n,
        "achieved": (n - 1) / span_s if span_s > 0 else float("nan"),
        "lag50": np.percentile(lag_ms, 50),
        "lag99": np.percentile(lag_ms, 99),
        "lagmax": lag_ms.max(),
        "arr50": np.percentile(arrive_ms, 50),
        "arr99": np.percentile(arrive_ms, 99),
        "cpu_ms": cpu / len(result.records) * 1e3,
        "cpu_share": cpu / (end_s - result.records[0].sent_s),
        "failed": sum(not r.success for r in measured),
    }


def pacing_alone(qps: float, n: int, spin_s: float) -> dict[str, float]:
    """`loadgen._sleep_until` on an otherwise idle loop: the timer's own precision and cost."""

    async def go() -> tuple[np.ndarray, float]:
        loadgen.SPIN_S = spin_s
        rng = np.random.default_rng(0)
        targets = time.monotonic() + 0.01 + np.cumsum(rng.exponential(1 / qps, n))
        lags = []
        cpu = time.process_time()
        for target in targets:
            await loadgen._sleep_until(target)
            lags.append(time.monotonic() - target)
        return np.array(lags) * 1e3, (time.process_time() - cpu) / n * 1e3

    lag_ms, cpu_ms = asyncio.run(go())
    return {
        "p50": np.percentile(lag_ms, 50),
        "p99": np.percentile(lag_ms, 99),
        "max": lag_ms.max(),
        "cpu_ms": cpu_ms,
    }


def gc_pause(input_len: int, num_prompts: int) -> tuple[float, float]:
    """A full garbage collection with a cell's prompts and bodies held (ms), and once they are
    frozen as `loadgen.run_requests` does before the clock starts."""
    w = Workload(
        qps=10.0,
        input_len=input_len,
        output_len=16,
        num_prompts=num_prompts,
        seed=0,
        dataset="random",
        burstiness=1.0,
        warmup_requests=0,
    )
    requests = build_requests(w, vocab_size=32000)
    settings = loadgen.ClientSettings("http://127.0.0.1:1", "m", None)
    bodies = [loadgen.encode_body(r, settings) for r in requests]
    started = time.perf_counter()
    gc.collect()
    held = time.perf_counter() - started
    gc.freeze()
    started = time.perf_counter()
    gc.collect()
    frozen = time.perf_counter() - started
    gc.unfreeze()
    del requests, bodies
    return held * 1e3, frozen * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qps", type=float, nargs="+", default=[10.0, 100.0, 500.0])
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("Full garbage collection with the prompts held (ms):")
    for input_len, num_prompts in ((1024, 5000), (32000, 200)):
        held, frozen = gc_pause(input_len, num_prompts)
        print(f"  {num_prompts} x {input_len} tokens: {held:.1f}; frozen: {frozen:.2f}")
    print()
    default_spin = loadgen.SPIN_S
    print("Pacing alone (an idle loop, Poisson send instants at the first QPS):")
    print(f"{'spin ms':>8} {'lag p50':>8} {'lag p99':>8} {'lag max':>8} {'cpu/send':>8}")
    for spin in (0.0, default_spin, 0.0011):
        p = pacing_alone(args.qps[0], 400, spin)
        print(
            f"{spin * 1e3:>8.1f} {p['p50']:>8.3f} {p['p99']:>8.3f} {p['max']:>8.3f} "
            f"{p['cpu_ms']:>8.3f}"
        )
    loadgen.SPIN_S = default_spin
    print()
    port = free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, str(HERE / "fixed_latency_server.py"), "--port", str(port)),
            *("--first-ms", "5", "--chunk-ms", "2"),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    header = (
        f"{'qps':>6} {'client':>7} {'pacing':>10} {'n':>5} {'achieved':>8} {'lag p50':>8} "
        f"{'lag p99':>8} {'lag max':>8} {'arr p50':>8} {'arr p99':>8} {'cpu/req':>8} {'cpu':>5} "
        f"{'failed':>6}"
    )
    print(header)
    print(
        f"{'':>6} {'':>10} {'':>5} {'req/s':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} "
        f"{'ms':>8} {'ms':>8} {'core':>5}"
    )
    try:
        for qps in args.qps:
            for client, pacing, spin in RUNS:
                loadgen.SPIN_S = default_spin if spin else 0.0
                p = point(url, qps, args.duration_s, args.seed, client)
                print(
                    f"{qps:>6g} {client:>7} {pacing:>10} {p['n']:>5} {p['achieved']:>8.1f} "
                    f"{p['lag50']:>8.3f} {p['lag99']:>8.3f} {p['lagmax']:>8.3f} "
                    f"{p['arr50']:>8.3f} {p['arr99']:>8.3f} {p['cpu_ms']:>8.3f} "
                    f"{p['cpu_share']:>5.0%} {p['failed']:>6}",
                    flush=True,
                )
    finally:
        loadgen.SPIN_S = default_spin
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
