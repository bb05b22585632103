"""The fidelity benchmark's H100 calibration runs: the serving experiments BLIS fitted its latency
model on (``benchmarks/data/calibration_blis_h100.csv``).

The V1 host constants (``servematrix.engine.host``) are BLIS's, fitted on these 15 runs together
with BLIS's own GPU terms; servematrix uses them with aiconfigurator's measured step tables
instead. Simulating the runs they came from checks that pairing on the data it was fitted on, so
the runs are calibration, never validation. `blis_points` simulates each run as it was driven:
inference-perf's ``shared_prefix`` workload in Poisson stages one after the other
(`stage_sends`), ``/v1/completions`` streams, the published ``--max-num-seqs``,
``--max-num-batched-tokens``, KV block count and CPU KV offloading.

Every request is one of ``system_prompts`` system prompts, then a question of its own, at fixed
lengths (the published input totals are exactly system + question tokens per request), so only
the system prompt hits the prefix cache. That is how BLIS replays them
(``sim/workload/inference_perf.go``, "fixed-length: matches real inference-perf behavior").
inference-perf itself cycles through ``system_prompts x users`` prompts, so read literally a
whole prompt would recur and be cached; simulated that way six runs' mean TTFTs fall to
0.48-0.65x of the published and the 70B runs' P99 TTFTs (128 and 158 ms, prefills queueing) to
0.3-0.4x, so the published runs prefilled their questions. Left out: the multi-turn mode sends
a user's next question only after its last answer; a user's questions are ``system_prompts x
users`` arrivals apart (18-23 s at the published rates), against mean E2E latencies of 1.6-4.6
s (9.9 and 17 s in the two 1,448-token runs simulated).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from fidelity_points import Point, predict

from servematrix.engine.setup import EngineFlags, plan_engine
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload

CSV_PATH = Path(__file__).resolve().parent / "data" / "calibration_blis_h100.csv"
SOURCE = "blis-h100"
GPU = "H100-SXM5-80GB"
REGIME = "moderate"
"""Every run is Poisson load below the engine's capacity: the published mean TTFTs are 26-67 ms
and no stage left a queue (mean E2E within 1.1x of TTFT plus the output's ITLs)."""
MAX_MODEL_LEN = 4096
"""Not published; the longest request is 2,482 tokens and Llama-2-7B and Yi-34B hold 4,096. The
KV pool is set from the published block count (`memory_utilization`), not from this."""
METRICS = ("mean_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
           "mean_e2el_ms", "p90_e2el_ms", "p99_e2el_ms")  # fmt: skip
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class BlisRun:
    """One experiment: its server settings, workload and published metrics."""

    run: str
    model: str
    architecture: str  # "" where servematrix ships none
    tp: int
    max_num_seqs: int
    max_num_batched_tokens: int
    total_kv_blocks: int
    cpu_kv_blocks: int
    system_prompt_len: int
    question_len: int
    output_len: int
    system_prompts: int
    stages: tuple[tuple[float, float], ...]  # (duration_s, rate_per_s)
    published: dict[str, float]

    @property
    def label(self) -> str:
        return f"{SOURCE} {self.run} {self.model.split('/')[-1]} tp{self.tp}"

    @property
    def num_requests(self) -> int:
        return sum(round(duration * rate) for duration, rate in self.stages)


INT_COLUMNS = (
    "tp", "max_num_seqs", "max_num_batched_tokens", "total_kv_blocks", "cpu_kv_blocks",
    "system_prompt_len", "question_len", "output_len", "system_prompts",
)  # fmt: skip


def load_blis_runs(path: Path = CSV_PATH) -> list[BlisRun]:
    """Parse the calibration file (``#`` lines are its provenance header)."""
    with path.open(newline="") as handle:
        records = list(csv.DictReader(line for line in handle if not line.startswith("#")))
    return [
        BlisRun(
            run=r["run"],
            model=r["model"],
            architecture=r["architecture"],
            stages=tuple(
                (float(d), float(q)) for d, q in (s.split("@") for s in r["stages"].split(";"))
            ),
            published={metric: float(r[metric]) for metric in METRICS},
            **{key: int(r[key]) for key in INT_COLUMNS},
        )
        for r in records
    ]


def unsupported(run: BlisRun) -> str | None:
    if not run.architecture:
        return f"{run.model}: mixture-of-experts with FP8 weights, not a shipped architecture"
    return None


def stage_sends(run: BlisRun, seed: int) -> list[float]:
    """inference-perf's Poisson timer (``inference_perf/loadgen/load_timer.py``
    ``PoissonLoadTimer``, kubernetes-sigs/inference-perf @ 0949afc8): each second of a stage
    sends a Poisson(rate) count of requests, spread over that second by exponential gaps scaled
    to sum to it; the stage ends after its duration."""
    rng = np.random.default_rng(seed)
    sends: list[float] = []
    start = 0.0
    for duration, rate in run.stages:
        for second in range(int(duration)):
            count = int(rng.poisson(rate))
            if count:
                gaps = rng.exponential(1 / rate, count)
                sends += (start + second + np.cumsum(gaps / gaps.sum())).tolist()
        start += duration
    return sends


def blis_cell(
    run: BlisRun, seed: int, gpu_memory_utilization: float = 0.9, requests: int | None = None
) -> Cell:
    model = ModelSpec(
        name=run.model.split("/")[-1],
        hf_id=run.model,
        architecture=run.architecture,
        quantization="bf16",
        tensor_parallel=run.tp,
        gpus=(tuple(range(run.tp)),),
    )
    workload = Workload(
        qps=run.num_requests / sum(duration for duration, _ in run.stages),
        input_len=run.system_prompt_len + run.question_len,
        output_len=run.output_len,
        num_prompts=requests or run.num_requests,
        seed=seed,
        dataset="random",
        burstiness=1.0,
        warmup_requests=0,
        prefix_len=run.system_prompt_len,
        prefix_groups=run.system_prompts,
    )
    serving = Serving(
        MAX_MODEL_LEN,
        gpu_memory_utilization,
        max_num_batched_tokens=run.max_num_batched_tokens,
        prefix_caching=True,
        max_num_seqs=run.max_num_seqs,
    )
    cell = Cell("simulator", "v1", model, MODES["single"], workload, serving, {"gpu": GPU})
    offload_gib = run.cpu_kv_blocks * BLOCK_TOKENS * _kv_bytes_per_token(cell) / 2**30
    return replace(cell, serving=replace(serving, kv_offloading_gib=offload_gib or None))


def _kv_bytes_per_token(cell: Cell) -> float:
    """All TP ranks' KV bytes per token (the published CPU block counts are per rank)."""
    plan = plan_engine(cell.model.architecture, EngineFlags.of_cell(cell))
    return plan.kv.kv_bytes_per_token_per_gpu * cell.model.tensor_parallel


def memory_utilization(run: BlisRun) -> float:
    """The ``--gpu-memory-utilization`` at which the recipe's KV plan holds the published block
    count (to within one block's share; bisection): the runs published the pool, not the flag."""
    low, high = 0.5, 0.98
    for _ in range(30):
        middle = (low + high) / 2
        cell = blis_cell(run, 0, middle)
        blocks = plan_engine(run.architecture, EngineFlags.of_cell(cell)).kv.num_blocks
        low, high = (middle, high) if blocks < run.total_kv_blocks else (low, middle)
    return high


def blis_points(
    runs: Sequence[BlisRun], seeds: int
) -> tuple[list[Point], list[tuple[BlisRun, str]]]:
    """Simulate every supported run at seeds 0..seeds-1 (each seed a fresh draw of arrivals);
    also the runs left out, with why."""
    points: list[Point] = []
    skipped: list[tuple[BlisRun, str]] = []
    for run in runs:
        why = unsupported(run)
        if why is not None:
            skipped.append((run, why))
            continue
        utilization = memory_utilization(run)
        metrics = []
        for seed in range(seeds):
            sends = stage_sends(run, seed)
            cell = blis_cell(run, seed, utilization, len(sends))
            metrics.append(predict(cell, send_times_s=sends))
        for metric, published in run.published.items():
            predicted = tuple(getattr(m, metric) for m in metrics)
            points.append(
                Point("calibration", SOURCE, REGIME, GPU, run.label, metric, published, predicted)
            )
    return points, skipped
