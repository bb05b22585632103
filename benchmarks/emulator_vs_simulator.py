"""The emulator against the simulator, same cell: does wall-clock pacing reproduce the engine?

For the mooncake study's single-instance shapes (Qwen2.5-72B-Instruct at TP 4 and
Qwen2.5-7B-Instruct-GPTQ-Int4 at TP 1, A100, recipe v0, input 1024, output 6) and each QPS, this
script

1. simulates the cell (``servematrix.simulate``, mode ``single``: the client talks to one
   instance, no proxy);
2. starts the deployment the ``emulator`` backend would start (``benchmarks/emulator_harness``:
   ``servematrix.deploy.plan(cell, "emulator")``, a fresh ``servematrix-emulator``, so its jitter
   stream starts where the simulator's does: both seed it with (seed, instance 0)), drives the
   same seeded workload through it with ``servematrix.client.loadgen`` (warm-up first, then the
   schedule), and reads the server's own timestamps from ``/servematrix/requests``;
3. prints TTFT / TPOT / ITL mean, median and P99 with the ratio emulator / simulator,
   twice: as the client saw them, and from the emulator's own timestamps (request headers
   read -> chunk written, which leaves out the client and the HTTP path);
4. prints the pacing errors: how late each chunk left the server after its engine step's end
   (``chunk_s - token_due_s``), how much later the client read it, how long a request took from
   the client's send to the server; and replays the engine in virtual time on the arrivals the
   emulator saw, counting the requests whose every token was due exactly when the replay says.

The simulator is the ground truth; the target is ratios within a few percent. Differences come
from the wall clock only: the client's send lag and the HTTP path shift each arrival by a few
milliseconds, which can move a request into a later step than in virtual time (the replay shows
the engine itself is reproduced), and a chunk leaves a millisecond or two after its step ends.

Usage (from the repository root)::

    .venv/bin/python benchmarks/emulator_vs_simulator.py            # 200 prompts, ~8 minutes
    .venv/bin/python benchmarks/emulator_vs_simulator.py --quick    # 40 prompts, QPS 4 and 8
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
from emulator_harness import (
    GPU,
    METRICS,
    STATS,
    cell_for,
    emulate,
    metrics_of,
    ratio_cells,
    retimed,
    table,
)

from servematrix.client import loadgen
from servematrix.engine.scheduler import Request
from servematrix.engine.setup import build_engine_setup
from servematrix.simulate import simulate
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord

MODELS = ("Qwen2.5-72B-Instruct", "Qwen2.5-7B-Instruct-GPTQ-Int4")


@dataclass
class Emulated:
    """One emulated cell: the client's records, the same requests as the server timed them
    (sent = request headers read, chunks = written), and the pacing errors in ms."""

    client: list[RequestRecord]
    server: list[RequestRecord]
    write_lag_ms: np.ndarray  # chunk written - its last token's engine step end
    read_lag_ms: np.ndarray  # chunk received by the client - written
    arrival_ms: np.ndarray  # request headers read by the server - client send
    replay_exact: int  # requests whose every token is due when a virtual-time replay says
    replay_max_ms: float  # largest |due - replayed| over every token


def emulate_single(cell: Cell) -> Emulated:
    run = emulate(cell)
    return emulated(cell, run.result, run.logs["single"])


def replay(cell: Cell, entries: list[dict]) -> list[list[float]]:
    """The engine in virtual time, fed the arrivals the emulator saw (its own timestamps):
    each request joins the first step starting at or after its arrival, as in the emulator's
    loop. Returns every request's token times (monotonic seconds), in ``entries`` order."""
    setup = build_engine_setup(
        cell.model.architecture,
        quantization=cell.model.quantization,
        tensor_parallel=cell.model.tensor_parallel,
        recipe=cell.recipe,
        chunked_prefill=cell.mode.chunked_prefill,
        max_model_len=cell.serving.max_model_len,
        gpu_memory_utilization=cell.serving.gpu_memory_utilization,
        gpu=GPU,
    )
    instance = setup.instance(cell.workload.seed, 0)
    order = sorted(range(len(entries)), key=lambda k: entries[k]["arrival_s"])
    due: list[list[float]] = [[] for _ in entries]
    clock, i = -np.inf, 0
    while i < len(order) or instance.has_work():
        if not instance.has_work():
            clock = max(clock, entries[order[i]]["arrival_s"])
        while i < len(order) and entries[order[i]]["arrival_s"] <= clock:
            entry = entries[order[i]]
            instance.add_request(Request(order[i], entry["prompt_tokens"], entry["max_tokens"]))
            i += 1
        result = instance.step()
        clock += result.duration_s
        for request in result.emitted:
            due[request.request_id].append(clock)
    return due


def emulated(cell: Cell, result: loadgen.RunResult, server_log: dict) -> Emulated:
    origin = result.origin_monotonic_s
    server_records, write, read, arrival, entries = [], [], [], [], []
    for record in result.records:
        entry = server_log[f"{result.request_id_prefix}-{record.request_id}"]
        written = np.array(entry["chunk_s"])
        due = np.array(entry["token_due_s"])[np.cumsum(entry["chunk_tokens"]) - 1]
        write.append(written - due)
        if len(record.chunk_s) == len(written):
            read.append(np.array(record.chunk_s) + origin - written)
        arrival.append(entry["arrival_s"] - (record.sent_s + origin))
        entries.append(entry)
        server_records.append(
            retimed(record, origin, entry["arrival_s"], entry["chunk_s"], entry["chunk_tokens"])
        )
    errors = [
        np.abs(np.array(entry["token_due_s"]) - np.array(replayed))
        for entry, replayed in zip(entries, replay(cell, entries), strict=True)
    ]
    return Emulated(
        result.records,
        server_records,
        np.concatenate(write) * 1e3,
        np.concatenate(read) * 1e3,
        np.array(arrival) * 1e3,
        sum(bool(e.max() < 1e-9) for e in errors),
        max(e.max() for e in errors) * 1e3,
    )


def percentiles(values_ms: np.ndarray) -> str:
    p50, p99 = np.percentile(values_ms, [50, 99])
    return f"{p50:.2f} / {p99:.2f} / {values_ms.max():.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 prompts at QPS 4 and 8")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--qps", default=None, help="comma-separated (default 2,4,6,8)")
    args = parser.parse_args()
    num_prompts = args.num_prompts or (40 if args.quick else 200)
    qps_list = [float(q) for q in (args.qps or ("4,8" if args.quick else "2,4,6,8")).split(",")]
    print(
        f"emulator vs simulator: recipe v0, {GPU}, single instance, input 1024, output 6, "
        f"{num_prompts} prompts (+1 warm-up), seed 0; cells are simulator / emulator / ratio (ms)"
    )
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    header = ["model", "qps"] + [f"{m} {s}" for m in METRICS for s in STATS]
    client_rows, server_rows, pacing_rows = [], [], []
    worst = {"client": 0.0, "server": 0.0}
    for model in MODELS:
        for qps in qps_list:
            cell = cell_for(model, "v0", "single", qps, num_prompts)
            sim = metrics_of(cell, simulate(cell).records)
            started = time.perf_counter()
            run = emulate_single(cell)
            elapsed = time.perf_counter() - started
            label = [model, f"{qps:g}"]
            for name, records, rows in (
                ("client", run.client, client_rows),
                ("server", run.server, server_rows),
            ):
                cells, off = ratio_cells(sim, metrics_of(cell, records))
                rows.append(label + cells)
                worst[name] = max(worst[name], *off.values())
            client = metrics_of(cell, run.client)
            pacing_rows.append(
                [
                    *label,
                    percentiles(run.write_lag_ms),
                    percentiles(run.read_lag_ms),
                    percentiles(run.arrival_ms),
                    f"{client.send_lag_p99_ms:.2f}",
                    f"{run.replay_exact}/{len(run.client)}, {run.replay_max_ms:.2f}",
                    str(client.failed),
                    f"{elapsed:.0f}",
                ]
            )
            print(f"{model} qps {qps:g}: done in {elapsed:.0f} s", flush=True)
    table("client-observed (the load generator's trace) vs simulator", header, client_rows)
    table(
        "server-side (the emulator's own timestamps: request read -> chunk written) vs simulator",
        header,
        server_rows,
    )
    table(
        "pacing, ms as P50 / P99 / max",
        [
            "model",
            "qps",
            "chunk written - step end",
            "chunk received - written",
            "request read - client send",
            "send lag P99",
            "engine replay: exact, max diff ms",
            "failed",
            "wall s",
        ],
        pacing_rows,
    )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(
        f"\nlargest |ratio - 1| over every metric and cell: client-observed "
        f"{worst['client'] * 100:.1f} %, server-side {worst['server'] * 100:.1f} %"
    )


if __name__ == "__main__":
    main()
