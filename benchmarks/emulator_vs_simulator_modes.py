"""The emulator against the simulator, one cell per mode and recipe, on the real deployments.

For every mode (``single``, ``nondisagg``, ``chunked``, ``mooncake-rdma``, ``mooncake-tcp``) ×
recipe (``v0``, ``v1``), Qwen2.5-7B-Instruct-GPTQ-Int4 TP 1 on an A100, input 1024, output 6,
Poisson arrivals, seed 0, this script

1. simulates the cell (``servematrix.simulate``: one instance; two behind the round-robin
   proxy; or prefill instance, proxy, KV transfer and decode instance, on one virtual clock);
2. starts the deployment the ``emulator`` backend would start (``benchmarks/emulator_harness``:
   ``servematrix.deploy.plan(cell, "emulator")`` run by ``servematrix.deploy.supervise``, every
   port free) and drives the same seeded requests through its entry point with
   ``servematrix.client.loadgen``;
3. prints TTFT / TPOT / ITL mean, median and P99 as simulator / emulator / ratio, twice:
   client-observed (the load generator's records through the real HTTP hops and proxy), and
   engine-side (from the first instance reading the request to the engine producing each token:
   the emulators' own timestamps) against the simulator's records less its modelled proxy hops
   (``engine.transfer.ProxyHop``: 1.5 ms in, 0.2 ms per chunk out; none for ``single``);
4. prints the HTTP path as measured beside what the simulator models, and for the
   disaggregated modes the emulated KV path.

The simulator is the ground truth; the target is means and medians within a few percent.
Known differences: the HTTP hops are real on one side and modelled on the other (the
engine-side view leaves them out); every emulator instance seeds its jitter stream with
(seed, 0), the simulator's second instance with (seed, 1) (vLLM has no flag telling an instance
its index), so the decode or second round-robin instance draws other step-time jitter
(3 % CV) and stragglers; for v1 the simulator starts the KV transfer a modelled proxy round
trip after the prefill, the emulator when the producer answers the consumer's pull.

    .venv/bin/python benchmarks/emulator_vs_simulator_modes.py            # 100 prompts, ~9 min
    .venv/bin/python benchmarks/emulator_vs_simulator_modes.py --quick    # 30 prompts, ~4 min
    .venv/bin/python benchmarks/emulator_vs_simulator_modes.py --recipes v1 \\
        --modes chunked,mooncake-rdma --num-prompts 4 --qps 8             # the smoke test
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import numpy as np
from emulator_harness import (
    GPU,
    METRICS,
    STATS,
    Emulation,
    cell_for,
    emulate,
    metrics_of,
    ratio_cells,
    retimed,
    table,
)

from servematrix.engine.transfer import ProxyHop
from servematrix.simulate import simulate
from servematrix.spec.matrix import MODES
from servematrix.spec.trace import RequestRecord

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"
RECIPES = ("v0", "v1")
MODE_ORDER = ("single", "nondisagg", "chunked", "mooncake-rdma", "mooncake-tcp")
VIEWS = ("client-observed", "engine-side")
"""A cell seen by the load generator's records, and by the engines' own clocks."""


def entries(run: Emulation, disaggregated: bool) -> list[tuple[dict, dict] | None]:
    """Per client record: the log entry of the instance that read the request first and of the
    one whose engine produced its tokens (the same instance unless disaggregated); None when a
    log lacks it or the request failed."""
    prefix, found = run.result.request_id_prefix, []
    for record in run.result.records:
        key = f"{prefix}-{record.request_id}"
        if disaggregated:
            first, last = run.logs["prefill"].get(key), run.logs["decode"].get(key)
        else:
            first = last = next((log[key] for log in run.logs.values() if key in log), None)
        ok = record.success and first and last and last["token_due_s"]
        found.append((first, last) if ok else None)
    return found


def engine_side(run: Emulation, disaggregated: bool) -> list[RequestRecord]:
    """The client's records retimed by the emulators: sent = the first instance read the
    request, one chunk per token at the instant its engine step ended."""
    origin, records = run.result.origin_monotonic_s, []
    for record, pair in zip(run.result.records, entries(run, disaggregated), strict=True):
        if pair is None:
            records.append(record)
            continue
        first, last = pair
        due = last["token_due_s"]
        records.append(retimed(record, origin, first["arrival_s"], due, [1] * len(due)))
    return records


def without_hops(records: list[RequestRecord], hop: ProxyHop) -> list[RequestRecord]:
    """Simulated records less the modelled proxy hops (in on the request, out on each chunk;
    a disaggregated cell's hops between prefill and decode stay: the emulator's are in too)."""
    hop_in, hop_out = hop.request_ms * 1e-3, hop.chunk_ms * 1e-3
    return [
        replace(
            r,
            sent_s=r.sent_s + hop_in,
            first_token_s=r.first_token_s - hop_out,
            end_s=r.end_s - hop_out,
            chunk_s=[c - hop_out for c in r.chunk_s],
        )
        for r in records
    ]


def p50_p99(values_s: list[float]) -> str:
    if not values_s:
        return "n/a"
    p50, p99 = np.percentile(np.array(values_s) * 1e3, [50, 99])
    return f"{p50:.1f} / {p99:.1f}"


def paths(run: Emulation, disaggregated: bool) -> list[str]:
    """Per measured request, P50 / P99 ms: the HTTP path in (client send -> the first instance
    read the request) and out (the engine's first token -> the instance wrote its chunk -> the
    client read it), and for the disaggregated modes the decode instance's read -> its first
    token and the prefill's first token -> the decode's."""
    origin = run.result.origin_monotonic_s
    spans: list[list[float]] = [[], [], [], [], []]
    for record, pair in zip(run.result.records, entries(run, disaggregated), strict=True):
        if record.warmup or pair is None:
            continue
        first, last = pair
        spans[0].append(first["arrival_s"] - origin - record.sent_s)
        spans[1].append(last["chunk_s"][0] - last["token_due_s"][0])
        spans[2].append(record.first_token_s + origin - last["chunk_s"][0])
        if disaggregated:
            spans[3].append(last["token_due_s"][0] - last["arrival_s"])
            spans[4].append(last["token_due_s"][0] - first["token_due_s"][0])
    return [p50_p99(values) for values in spans]


def central(deviations: dict[str, float]) -> float:
    """The largest deviation of a mean or median (what the few-percent target is about)."""
    return max(deviations["mean"], deviations["median"])


def _arguments() -> tuple[argparse.Namespace, list[str], list[str]]:
    """The command line, and the modes and recipes it names (an unknown one is an error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 prompts")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--qps", type=float, default=2.0)
    parser.add_argument("--modes", default=",".join(MODE_ORDER), help="comma-separated")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated")
    args = parser.parse_args()
    modes, recipes = args.modes.split(","), args.recipes.split(",")
    for name, given, known in (("--modes", modes, MODES), ("--recipes", recipes, RECIPES)):
        unknown = [value for value in given if value not in known]
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return args, modes, recipes


def _tables(
    label_header: list[str],
    header: list[str],
    rows: dict[str, list[list[str]]],
    summary_rows: list[list[str]],
    path_rows: list[list[str]],
) -> None:
    """The four tables: both views of the metrics, the summary per cell, the HTTP and KV path."""
    table("client-observed (the load generator's records) vs simulator", header, rows[VIEWS[0]])
    table(
        "engine-side (first instance reads the request -> engine step produces the token; "
        "the emulators' own clocks) vs simulator less its modelled proxy hops",
        header,
        rows[VIEWS[1]],
    )
    table(
        "largest |ratio - 1| per cell, over TTFT/TPOT/ITL: means and medians / P99",
        [
            *label_header,
            "client-observed",
            "engine-side",
            "failed",
            "wall s",
            "start-up s",
            "load avg",
        ],
        summary_rows,
    )
    table(
        "HTTP and KV path, ms: simulator's modelled hop, then P50 / P99 of the emulated cell",
        [
            *label_header,
            "modelled in / out per chunk",
            "client send -> instance read",
            "1st token -> chunk written",
            "written -> client read",
            "decode read -> 1st token",
            "prefill 1st token -> decode 1st",
        ],
        path_rows,
    )


def main() -> None:
    args, modes, recipes = _arguments()
    num_prompts = args.num_prompts or (30 if args.quick else 100)
    print(
        f"emulator vs simulator per mode: {MODEL}, TP 1, {GPU}, input 1024, output 6, "
        f"QPS {args.qps:g}, {num_prompts} prompts (+1 warm-up), seed 0; "
        "cells are simulator / emulator / ratio (ms)"
    )
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    label_header = ["recipe", "mode"]
    header = label_header + [f"{m} {s}" for m in METRICS for s in STATS]
    rows: dict[str, list[list[str]]] = {view: [] for view in VIEWS}
    summary_rows, path_rows = [], []
    worst = {view: dict.fromkeys(STATS, 0.0) for view in VIEWS}
    for recipe in recipes:
        for mode in modes:
            disaggregated = MODES[mode].disaggregated
            cell = cell_for(MODEL, recipe, mode, args.qps, num_prompts)
            simulation = simulate(cell)
            hop = ProxyHop(**simulation.engine_parameters["proxy_hop"])
            started = time.perf_counter()
            run = emulate(cell)
            elapsed = time.perf_counter() - started
            pairs = {
                "client-observed": (simulation.records, run.result.records),
                "engine-side": (
                    without_hops(simulation.records, hop),
                    engine_side(run, disaggregated),
                ),
            }
            label = [recipe, mode]
            summary = []
            for view, (sim_records, emu_records) in pairs.items():
                sim, emu = metrics_of(cell, sim_records), metrics_of(cell, emu_records)
                cells, off = ratio_cells(sim, emu)
                rows[view].append(label + cells)
                summary.append(f"{central(off) * 100:.1f} % / {off['p99'] * 100:.1f} %")
                for stat in STATS:
                    worst[view][stat] = max(worst[view][stat], off[stat])
            failed = metrics_of(cell, run.result.records).failed
            summary += [str(failed), f"{elapsed:.0f}", f"{run.startup_s:.1f}"]
            summary_rows.append([*label, *summary, f"{os.getloadavg()[0]:.1f}"])
            modelled = f"{hop.request_ms:g} / {hop.chunk_ms:g}"
            path_rows.append([*label, modelled, *paths(run, disaggregated)])
            print(f"{recipe} {mode}: done in {elapsed:.0f} s", flush=True)
    _tables(label_header, header, rows, summary_rows, path_rows)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    print(
        "largest |ratio - 1| over every cell: "
        + "; ".join(
            f"{view} {central(worst[view]) * 100:.1f} % "
            f"(means, medians), {worst[view]['p99'] * 100:.1f} % (P99)"
            for view in VIEWS
        )
    )


if __name__ == "__main__":
    main()
