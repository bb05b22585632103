"""The emulator against the simulator in the disaggregated modes: one cell per recipe.

For ``v1`` × ``mooncake-rdma`` and ``v0`` × ``mooncake-tcp`` (Qwen2.5-7B-Instruct-GPTQ-Int4,
TP 1, A100, input 1024, output 6, Poisson arrivals, seed 0), this script

1. simulates the cell (``servematrix.simulate``: prefill instance, proxy, KV transfer, decode
   instance on one virtual clock);
2. starts the deployment the ``emulator`` backend would start, from
   ``servematrix.deploy.plan(cell, "emulator")`` (etcd for v0, the prefill and decode
   ``servematrix-emulator`` processes with their ``--kv-transfer-config``, the proxy of
   ``servematrix.proxy``), each on a free port, and drives the same seeded requests through
   the proxy with ``servematrix.loadgen``;
3. prints TTFT / TPOT / ITL mean, median and P99 as simulator / emulator / ratio, twice:
   client-observed (the load generator's records through the real proxy), and engine-side,
   without the HTTP hops: from the prefill instance reading the request to the decode
   instance's engine producing each token (the emulators' own timestamps), against the
   simulator's records less its modelled proxy hops; then the emulated KV path.

The emulator's consumer accounts each KV transfer with the simulator's model
(``servematrix.emulator.disagg``), so the ratios should be within a few percent. Known
differences: the simulator's proxy hops are modelled (1.5 ms per request, 0.2 ms per chunk),
the emulator's are real; for v1 the simulator starts the transfer after a proxy round trip
following the prefill, the emulator when the producer answers the consumer's pull (vLLM 0.33's
proxy sends both requests at once); for v0 the emulator does not hold the producer's share of
the copy chain back while the producer runs a step.

    .venv/bin/python benchmarks/emulator_vs_simulator_disagg.py            # 100 prompts, QPS 2
    .venv/bin/python benchmarks/emulator_vs_simulator_disagg.py --quick    # 30 prompts
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np

from servematrix import loadgen
from servematrix.cell import identity
from servematrix.config import MODES, Cell, Serving, Workload, load_file
from servematrix.deploy import Plan, plan
from servematrix.deploy.recipes import DEPLOYMENT_DIR, MOONCAKE_DECODE_OFFSET
from servematrix.engine.architecture import load_architecture
from servematrix.engine.transfer import ProxyHop
from servematrix.metrics import CellMetrics, compute
from servematrix.simulate import simulate
from servematrix.trace import RequestRecord, to_table
from servematrix.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"
GPU = "A100-SXM4-80GB"
CELLS = (("v1", "mooncake-rdma"), ("v0", "mooncake-tcp"))
METRICS = ("ttft", "tpot", "itl")
STATS = ("mean", "median", "p99")


def free_port(avoid: set[int]) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid and port + 1 not in avoid:
            avoid.update((port, port + 1))
            return port


def cell_for(recipe: str, mode: str, qps: float, num_prompts: int) -> Cell:
    config = load_file(ROOT / "config" / "config.yaml")
    defaults = config.raw["defaults"]
    workload = Workload(
        qps=qps,
        input_len=1024,
        output_len=6,
        num_prompts=num_prompts,
        seed=0,
        dataset="random",
        burstiness=1.0,
        warmup_requests=1,
    )
    taken: set[int] = set()
    mooncake = free_port(taken)
    while True:  # the decode side's transfer engine listens MOONCAKE_DECODE_OFFSET higher
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", mooncake + MOONCAKE_DECODE_OFFSET))
                break
            except OSError:
                mooncake = free_port(taken)
    ports = {name: free_port(taken) for name in ("proxy", "prefill", "decode", "etcd", "bootstrap")}
    ports["mooncake"] = mooncake
    return Cell(
        backend="emulator",
        recipe=recipe,
        model=config.models[MODEL],
        mode=MODES[mode],
        workload=workload,
        serving=Serving(defaults["max_model_len"], defaults["gpu_memory_utilization"]),
        engine={"gpu": GPU},
        deploy={"ports": ports},
    )


def executable(argv: tuple[str, ...], where: Path) -> list[str]:
    """An argv of the plan as run here: the placeholder filled, programs from this venv."""
    argv = tuple(token.replace(DEPLOYMENT_DIR, str(where)) for token in argv)
    name, rest = argv[0], list(argv[1:])
    if name == "python3":
        return [sys.executable, *rest]
    local = Path(sys.executable).with_name(name)
    return [str(local) if local.exists() else (shutil.which(name) or name), *rest]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(
                f"{process.args[0]} exited during start-up:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} never became healthy:\n{log.read_text()[-3000:]}")


def start(deployment: Plan, where: Path) -> list[subprocess.Popen]:
    for name, content in deployment.files.items():
        (where / name).write_text(content)
    started = []
    try:
        for process in deployment.processes:
            env = {k: v.replace(DEPLOYMENT_DIR, str(where)) for k, v in process.env.items()}
            log = where / f"{process.name}.log"
            with open(log, "wb") as out:
                popen = subprocess.Popen(
                    executable(process.argv, where),
                    env={**os.environ, **env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append(popen)
            wait_healthy(process.health.url, popen, log)
    except BaseException:
        stop(started)
        raise
    return started


def stop(started: list[subprocess.Popen]) -> None:
    for popen in reversed(started):
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGTERM)
    for popen in started:
        try:
            popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def emulate(cell: Cell) -> tuple[loadgen.RunResult, dict, dict]:
    deployment = plan(cell, "emulator")
    ports = dict(cell.deploy["ports"])
    with tempfile.TemporaryDirectory(prefix="servematrix-disagg-") as tmp:
        started = start(deployment, Path(tmp))
        try:
            settings = loadgen.ClientSettings(
                base_url=deployment.base_url,
                model=cell.model.hf_id,
                max_concurrency=None,
                ready_timeout_s=60.0,
            )
            vocab = load_architecture(cell.model.architecture).vocab_size
            result = loadgen.run(settings, build_requests(cell.workload, vocab), progress=None)
            logs = []
            for name in ("prefill", "decode"):
                url = f"http://127.0.0.1:{ports[name]}/servematrix/requests"
                with urllib.request.urlopen(url) as response:
                    logs.append(json.load(response))
        finally:
            stop(started)
    return result, logs[0], logs[1]


def metrics_of(cell: Cell, records: list[RequestRecord]) -> CellMetrics:
    return compute(to_table(identity(cell), records, {}))


def engine_side(result: loadgen.RunResult, prefill: dict, decode: dict) -> list[RequestRecord]:
    """The client's records retimed by the emulators: sent = the prefill instance read the
    request, chunks = the decode engine's token instants."""
    origin, records = result.origin_monotonic_s, []
    for record in result.records:
        key = f"{result.request_id_prefix}-{record.request_id}"
        p, d = prefill.get(key), decode.get(key)
        if not (record.success and p and d and d["token_due_s"]):
            records.append(record)
            continue
        chunks = [t - origin for t in d["token_due_s"]]
        records.append(
            replace(
                record,
                sent_s=p["arrival_s"] - origin,
                first_token_s=chunks[0],
                end_s=chunks[-1],
                chunk_s=chunks,
                chunk_tokens=[1] * len(chunks),
            )
        )
    return records


def without_hops(records: list[RequestRecord]) -> list[RequestRecord]:
    """Simulated records less the modelled proxy hops (in on the request, out on each chunk)."""
    hop = ProxyHop()
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


def kv_path_ms(result: loadgen.RunResult, prefill: dict, decode: dict) -> str:
    """Per measured request (P50 / P99, ms): the HTTP hops in (client send to the prefill
    instance reading the request; the simulator models 1.5 ms) and out (the decode engine's
    first token to the client reading it; modelled 0.2 ms), the decode instance's arrival to
    its first token, and the prefill's first token to the decode's."""
    origin = result.origin_monotonic_s
    spans: dict[str, list[float]] = {
        "client send -> prefill read": [],
        "decode 1st token -> client": [],
        "decode read -> 1st token": [],
        "prefill 1st -> decode 1st": [],
    }
    for record in result.records:
        key = f"{result.request_id_prefix}-{record.request_id}"
        p, d = prefill.get(key), decode.get(key)
        if record.warmup or not (record.success and p and d and d["token_due_s"]):
            continue
        spans["client send -> prefill read"].append(p["arrival_s"] - origin - record.sent_s)
        spans["decode 1st token -> client"].append(
            record.first_token_s + origin - d["token_due_s"][0]
        )
        spans["decode read -> 1st token"].append(d["token_due_s"][0] - d["arrival_s"])
        spans["prefill 1st -> decode 1st"].append(d["token_due_s"][0] - p["token_due_s"][0])
    parts = []
    for name, values in spans.items():
        if values:
            p50, p99 = np.percentile(np.array(values) * 1e3, [50, 99])
            parts.append(f"{name} {p50:.1f} / {p99:.1f}")
    return "; ".join(parts) or "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 prompts")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--qps", type=float, default=2.0)
    args = parser.parse_args()
    num_prompts = args.num_prompts or (30 if args.quick else 100)
    print(
        f"emulator vs simulator, disaggregated: {MODEL}, TP 1, {GPU}, input 1024, output 6, "
        f"QPS {args.qps:g}, {num_prompts} prompts (+1 warm-up), seed 0"
    )
    header = ["recipe", "mode"] + [f"{m} {s}" for m in METRICS for s in STATS] + ["failed"]
    tables: dict[str, list[str]] = {"client-observed": [], "engine-side": []}
    worst = dict.fromkeys(tables, 0.0)
    notes = []
    for recipe, mode in CELLS:
        cell = cell_for(recipe, mode, args.qps, num_prompts)
        simulated = simulate(cell).records
        result, prefill_log, decode_log = emulate(cell)
        pairs = {
            "client-observed": (simulated, result.records),
            "engine-side": (
                without_hops(simulated),
                engine_side(result, prefill_log, decode_log),
            ),
        }
        for name, (sim_records, emu_records) in pairs.items():
            sim, emu = metrics_of(cell, sim_records), metrics_of(cell, emu_records)
            cells = []
            for metric in METRICS:
                for stat in STATS:
                    s = getattr(sim, f"{stat}_{metric}_ms")
                    e = getattr(emu, f"{stat}_{metric}_ms")
                    cells.append(f"{s:.1f} / {e:.1f} / {e / s:.3f}")
                    worst[name] = max(worst[name], abs(e / s - 1))
            tables[name].append(
                f"| {recipe} | {mode} | " + " | ".join(cells) + f" | {emu.failed} |"
            )
        notes.append(f"{recipe} {mode}: {kv_path_ms(result, prefill_log, decode_log)}")
        print(f"{recipe} {mode}: done", flush=True)
    for name, rows in tables.items():
        print(f"\n{name}: simulator / emulator / ratio (ms)\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        print("\n".join(rows))
    print("\nemulated KV path, P50 / P99 ms (the emulators' own timestamps):")
    for note in notes:
        print("  " + note)
    print(
        "\nlargest |ratio - 1| over every metric and cell: "
        + ", ".join(f"{name} {value * 100:.1f} %" for name, value in worst.items())
    )


if __name__ == "__main__":
    main()
