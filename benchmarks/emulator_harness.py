"""Shared by the emulator-vs-simulator benchmarks: a cell on free loopback ports, the deployment
the ``emulator`` backend would start for it, a seeded run through it, and the comparison table.

The deployment is ``servematrix.deploy.plan(cell, "emulator")`` started by
``servematrix.deploy.supervise.Deployment``: the workflow's own argv, environment, files
(``mooncake.json``), etcd and proxy, only on ports picked free here (the config's defaults
may be taken on a shared machine) and in a throwaway directory. Not a warm deployment: every
cell starts fresh, so each instance's jitter stream starts where the simulator's does.
"""

from __future__ import annotations

import json
import socket
import tempfile
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from servematrix.backends.cell import identity
from servematrix.client import loadgen
from servematrix.deploy import plan
from servematrix.deploy.supervise import Deployment, port_problem
from servematrix.engine.architecture import load_architecture
from servematrix.results.metrics import CellMetrics, compute
from servematrix.spec.config import load_file
from servematrix.spec.matrix import MODES, Cell, Serving, Workload
from servematrix.spec.trace import RequestRecord, to_table
from servematrix.workload import build_requests

ROOT = Path(__file__).resolve().parents[1]
GPU = "A100-SXM4-80GB"
HOST = "127.0.0.1"
METRICS = ("ttft", "tpot", "itl")
STATS = ("mean", "median", "p99")
PORT_NAMES = ("proxy", "prefill", "decode", "single", "etcd", "bootstrap", "mooncake")
SERVERS = ("single", "prefill", "decode")
"""Plan process names of the emulator instances (the others are etcd and the proxy)."""


@dataclass
class Emulation:
    """One run on a fresh deployment: the client's result, and per emulator instance (plan
    process name) its ``GET /servematrix/requests`` log keyed by X-Request-Id."""

    result: loadgen.RunResult
    logs: dict[str, dict]
    startup_s: float


def cell_for(model_name: str, recipe: str, mode: str, qps: float, num_prompts: int) -> Cell:
    """The cell (config defaults for serving; input 1024, output 6, seed 0, one warm-up) with
    every port its emulator deployment binds free on loopback and distinct."""
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
    for _ in range(50):
        cell = Cell(
            backend="emulator",
            recipe=recipe,
            model=config.models[model_name],
            mode=MODES[mode],
            workload=workload,
            serving=Serving(defaults["max_model_len"], defaults["gpu_memory_utilization"]),
            engine={"gpu": GPU},
            deploy={"ports": {name: _free_port() for name in PORT_NAMES}},
        )
        # The plan derives more ports (etcd peer, transfer engines, ZMQ): check all of them.
        ports = [port for process in plan(cell, "emulator").processes for port in process.ports]
        if len(set(ports)) == len(ports) and not any(port_problem(HOST, p) for p in ports):
            return cell
    raise SystemExit(f"no free set of loopback ports for {recipe} {mode} after 50 tries")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def emulate(cell: Cell) -> Emulation:
    """Start the cell's emulator deployment, drive the cell's seeded requests through its entry
    point (the proxy, or the single instance) with ``servematrix.client.loadgen``, read every
    instance's request log, stop everything."""
    deployment_plan = plan(cell, "emulator")
    with tempfile.TemporaryDirectory(prefix="servematrix-emu-") as tmp:
        where = Path(tmp)
        deployment = Deployment(
            deployment_plan.resolve(str(where)),
            where,
            where / "logs",
            HOST,
            startup_timeout_s=120.0,
            stop_timeout_s=15.0,
        )
        startup_s = deployment.start()
        try:
            settings = loadgen.ClientSettings(
                base_url=deployment_plan.base_url,
                model=cell.model.hf_id,
                max_concurrency=None,
                ready_timeout_s=60.0,
            )
            vocab = load_architecture(cell.model.architecture).vocab_size
            result = loadgen.run(settings, build_requests(cell.workload, vocab), progress=None)
            logs = {}
            for process in deployment_plan.processes:
                if process.name in SERVERS:
                    root = process.health.url.removesuffix("/health")
                    with urllib.request.urlopen(f"{root}/servematrix/requests") as response:
                        logs[process.name] = json.load(response)
        finally:
            deployment.stop()
    return Emulation(result, logs, startup_s)


def retimed(
    record: RequestRecord,
    origin_s: float,
    arrival_s: float,
    chunks_s: list[float],
    chunk_tokens: list[int],
) -> RequestRecord:
    """A client record timed by a server instead: sent at ``arrival_s``, chunks at ``chunks_s``
    (``time.monotonic()`` values; records count from the run's ``origin_s``)."""
    chunks = [t - origin_s for t in chunks_s]
    return replace(
        record,
        sent_s=arrival_s - origin_s,
        first_token_s=chunks[0],
        end_s=chunks[-1],
        chunk_s=chunks,
        chunk_tokens=list(chunk_tokens),
    )


def metrics_of(cell: Cell, records: list[RequestRecord]) -> CellMetrics:
    return compute(to_table(identity(cell), records, {}))


def ratio_cells(sim: CellMetrics, emu: CellMetrics) -> tuple[list[str], dict[str, float]]:
    """Table cells "sim / emu / ratio" per metric and statistic, and per statistic the largest
    |ratio - 1| over the metrics."""
    cells, worst = [], dict.fromkeys(STATS, 0.0)
    for metric in METRICS:
        for stat in STATS:
            s = getattr(sim, f"{stat}_{metric}_ms")
            e = getattr(emu, f"{stat}_{metric}_ms")
            cells.append(f"{s:.1f} / {e:.1f} / {e / s:.3f}")
            worst[stat] = max(worst[stat], abs(e / s - 1))
    return cells, worst


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")
