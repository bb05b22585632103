"""Where a simulated validation run's time goes: every step the engine times, split into the
terms of its step-time model, with each term's source and whether the datasheet roofline calls
it compute- or memory-bound (issue 42).

For a ``serve`` run simulated at its published setup (seed 0), each step's time is split into:

- ``shared``: aiconfigurator's ``shared(T)``, every op but attention (GEMMs, norms,
  activation, logits) at the step's T tokens (`aic_table.AicStepParts`), apart for steps with
  prefill tokens (``shared, prefill``) and pure decodes (``shared, decode``);
- ``prefill attn``: its context-attention table at each chunk's new and cached tokens;
- ``decode attn``: its generation-attention table at the decodes' batch and mean context;
- ``FA2 rereads``: what V1's single FlashAttention-2 varlen call adds for the decodes of a step
  that also prefills (`engine.attention`, A100 and other cards below compute capability 9.0);
- ``host``: the recipe's CPU time per step (`engine.host`).

Beside each term, the FLOPs and bytes it moves over its time, as a share of the card's dense
bf16 peak and HBM bandwidth, and which of the two rooflines is the longer (``compute`` or
``memory``): linear layers 2 x params per token and their weights once; attention 4 x layers x
query heads x head size per query token and KV token (causal within a chunk), reading the KV
once. The engine memoises a repeated batch shape, so a shape is counted once; the line ``steps``
gives the logged total beside the run's duration. For two runs of one workload on two GPUs, the
last table divides each term's time on the first by the second's.

    .venv/bin/python benchmarks/fidelity_step_breakdown.py
    .venv/bin/python benchmarks/fidelity_step_breakdown.py \\
        --run "gpustack-lab 14B A100 random 4k rate=inf" --run "gpustack-lab 14B H100 ..."
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from fidelity_points import predict
from fidelity_validation import (
    CHAT_SOURCES,
    PRIMED_RUNS,
    ValidationRun,
    _serve_cell,
    load_validation,
    published_sends,
)

from servematrix.engine.aic_table import AicStepTime
from servematrix.engine.architecture import Architecture
from servematrix.engine.attention import WithMixedStepKvReads
from servematrix.engine.hardware import GpuSpec, gpu_spec
from servematrix.engine.host import WithHostCost
from servematrix.engine.kvcache import kv_bytes_per_token_per_gpu
from servematrix.engine.setup import EngineSetup, cell_engine_setup
from servematrix.engine.steptime import StepBatch, StepTimeModel

DEFAULT_RUNS = (
    "gpustack-lab 14B A100 random 32k rate=inf",
    "gpustack-lab 14B H100 random 32k rate=inf",
)
"""GPUStack's Qwen3-14B very long prompts on both cards: the pair whose simulated A100 -> H100
speed-up (3.3) is nearly twice the published one (1.87)."""
TERMS = ("shared, prefill", "shared, decode", "prefill attn", "decode attn", "FA2 rereads", "host")
SOURCES = {
    "shared, prefill": "aic shared(T)",
    "shared, decode": "aic shared(T)",
    "prefill attn": "aic context attn",
    "decode attn": "aic generation attn",
    "FA2 rereads": "engine.attention",
    "host": "engine.host",
}


class StepLog:
    """A step-time model that records every batch it is asked about and the time it gave."""

    def __init__(self, model: StepTimeModel):
        self.model = model
        self.steps: list[tuple[StepBatch, float]] = []

    def step_ms(self, batch: StepBatch) -> float:
        ms = self.model.step_ms(batch)
        self.steps.append((batch, ms))
        return ms


@dataclass
class Work:
    """One term's time over the logged steps, and the FLOPs and bytes it does in that time."""

    ms: float = 0.0
    flop: float = 0.0
    bytes: float = 0.0


@dataclass
class RunBreakdown:
    run: ValidationRun
    label: str
    duration_s: float
    published_duration_s: float
    terms: dict[str, Work] = field(default_factory=lambda: {name: Work() for name in TERMS})
    step_ms: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepCosts:
    """What a step's FLOPs and bytes are per unit of work, on one GPU of the TP group."""

    linear_flop_per_token: float
    lm_head_flop_per_seq: float
    weight_bytes: float
    attention_flop_per_pair: float
    kv_bytes_per_token: float

    @classmethod
    def of(cls, arch: Architecture, tp: int) -> StepCosts:
        lm_head = arch.vocab_size * arch.hidden_size
        linear = arch.num_layers * arch.linear_params_per_layer
        return cls(
            2.0 * linear / tp,
            2.0 * lm_head / tp,
            2.0 * (linear + lm_head) / tp,
            4.0 * arch.num_layers * arch.num_attention_heads * arch.head_dim / tp,
            kv_bytes_per_token_per_gpu(arch, tp),
        )


def gpu_model(setup: EngineSetup) -> tuple[AicStepTime, WithMixedStepKvReads | None]:
    """The measured tables and FA2 term inside a setup's step-time model (host cost outside)."""
    model = setup.step_time.model if isinstance(setup.step_time, WithHostCost) else setup.step_time
    rereads = model if isinstance(model, WithMixedStepKvReads) else None
    tables = rereads.model if rereads else model
    if not isinstance(tables, AicStepTime):
        raise ValueError(f"the step times are not aiconfigurator's tables: {setup.step_time_label}")
    return tables, rereads


def simulate_logged(run: ValidationRun, seed: int) -> tuple[EngineSetup, StepLog, float]:
    """The run simulated with its GPU steps logged (the host cost stays outside the log, so the
    API server in front keeps its cost); its setup, the log and the benchmark duration."""
    if run.interface != "serve" or published_sends(run) or run.label in PRIMED_RUNS:
        raise ValueError(f"{run.label}: only rate-inf or seeded serve runs are broken down")
    cell = _serve_cell(run, seed, None)
    setup = cell_engine_setup(cell)
    if not isinstance(setup.step_time, WithHostCost):
        raise ValueError(f"{run.label}: no host cost in {setup.step_time_label}")
    log = StepLog(setup.step_time.model)
    metrics = predict(
        cell,
        chat_stream=run.source in CHAT_SOURCES,
        step_time=WithHostCost(log, setup.step_time.cost),
    )
    return setup, log, run.num_prompts / metrics.request_throughput


def breakdown(run: ValidationRun, seed: int = 0) -> RunBreakdown:
    """Every logged step of the run split into `TERMS` (module docstring)."""
    setup, log, duration_s = simulate_logged(run, seed)
    tables, rereads = gpu_model(setup)
    costs = StepCosts.of(setup.arch, run.tp)
    host = setup.step_time.cost
    published_s = run.num_prompts / run.published["request_throughput_per_s"]
    result = RunBreakdown(run, setup.step_time_label, duration_s, published_s)
    terms = result.terms
    for batch, gpu_ms in log.steps:
        parts = tables.parts_ms(batch)
        seqs = len(batch.prefill_chunks) + len(batch.decode_contexts)
        shared = terms["shared, prefill" if batch.prefill_chunks else "shared, decode"]
        shared.ms += parts.shared_ms
        shared.flop += costs.linear_flop_per_token * batch.num_tokens
        shared.flop += costs.lm_head_flop_per_seq * seqs
        shared.bytes += costs.weight_bytes
        prefill = terms["prefill attn"]
        prefill.ms += parts.prefill_attention_ms
        for new, past in batch.prefill_chunks:
            prefill.flop += costs.attention_flop_per_pair * new * (past + new / 2)
            prefill.bytes += costs.kv_bytes_per_token * (past + new)
        decode = terms["decode attn"]
        decode.ms += parts.decode_attention_ms
        decode.flop += costs.attention_flop_per_pair * sum(batch.decode_contexts)
        decode.bytes += costs.kv_bytes_per_token * sum(batch.decode_contexts)
        if rereads is not None and batch.prefill_chunks and batch.decode_contexts:
            terms["FA2 rereads"].ms += rereads.extra_ms(batch)
        critical_ms = gpu_ms + host.step_ms + host.per_seq_ms * seqs
        step_ms = max(critical_ms, host.overlapped_per_seq_ms * seqs)
        terms["host"].ms += step_ms - gpu_ms
        kind = "mixed" if batch.prefill_chunks and batch.decode_contexts else "prefill"
        result.step_ms.setdefault("decode" if not batch.prefill_chunks else kind, []).append(
            step_ms
        )
    return result


def bound(work: Work, gpu: GpuSpec) -> str:
    """Which datasheet roofline is the longer for the term's work: compute or memory."""
    if not work.flop and not work.bytes:
        return "-"
    return (
        "compute"
        if work.flop / gpu.bf16_flops_per_s > work.bytes / gpu.hbm_bytes_per_s
        else "memory"
    )


def format_breakdown(result: RunBreakdown) -> list[str]:
    gpu = gpu_spec(result.run.gpu)
    total_ms = sum(work.ms for work in result.terms.values())
    lines = [
        f"== {result.run.label} ({gpu.name}: {gpu.bf16_dense_tflops:g} TFLOP/s bf16, "
        f"{gpu.hbm_bandwidth_tb_s:g} TB/s HBM), seed 0",
        f"   step times: {result.label}",
        f"{'term':<16} {'source':<20} {'time s':>8} {'share':>6} {'TFLOP/s':>8} {'% peak':>7} "
        f"{'TB/s':>6} {'% HBM':>6}  roofline",
    ]
    for name, work in result.terms.items():
        seconds = work.ms / 1e3
        tflops = work.flop / seconds / 1e12 if seconds and work.flop else 0.0
        tbs = work.bytes / seconds / 1e12 if seconds and work.bytes else 0.0
        rates = (
            f"{tflops:>8.0f} {100 * tflops / gpu.bf16_dense_tflops:>6.0f}% "
            f"{tbs:>6.2f} {100 * tbs / gpu.hbm_bandwidth_tb_s:>5.0f}%"
            if work.flop or work.bytes
            else f"{'-':>8} {'-':>7} {'-':>6} {'-':>6}"
        )
        lines.append(
            f"{name:<16} {SOURCES[name]:<20} {seconds:>8.1f} {100 * work.ms / total_ms:>5.1f}% "
            f"{rates}  {bound(work, gpu)}"
        )
    steps = sum(len(times) for times in result.step_ms.values())
    kinds = ", ".join(
        f"{kind} {len(times)} (median {statistics.median(times):.1f} ms)"
        for kind, times in sorted(result.step_ms.items())
    )
    lines.append(
        f"steps: {steps} logged, {total_ms / 1e3:.1f} s of a {result.duration_s:.1f} s run "
        f"(published: {result.published_duration_s:.1f} s): {kinds}"
    )
    return lines


def format_ratios(a: RunBreakdown, b: RunBreakdown) -> list[str]:
    """Each term's time on ``a``'s GPU and ``b``'s for one workload, and how much faster ``b``
    does the term's work: FLOP/s (compute-bound terms) or bytes/s (memory-bound) b over a."""
    lines = [
        f"== per term, {a.run.gpu} (a) vs {b.run.gpu} (b): time, and b's speed over a's per unit "
        "of work (FLOPs where compute-bound, bytes where memory-bound)",
        f"{'term':<16} {'a s':>8} {'b s':>8} {'b faster':>9}",
    ]
    gpu = gpu_spec(b.run.gpu)
    for name in TERMS:
        work_a, work_b = a.terms[name], b.terms[name]
        kind = bound(work_b, gpu)
        speed = "-"
        if kind != "-" and work_a.ms and work_b.ms:
            unit_a, unit_b = (
                (work_a.flop, work_b.flop) if kind == "compute" else (work_a.bytes, work_b.bytes)
            )
            speed = f"{(unit_b / work_b.ms) / (unit_a / work_a.ms):.2f}"
        lines.append(f"{name:<16} {work_a.ms / 1e3:>8.1f} {work_b.ms / 1e3:>8.1f} {speed:>9}")
    total_a = sum(work.ms for work in a.terms.values())
    total_b = sum(work.ms for work in b.terms.values())
    lines.append(
        f"{'all steps':<16} {total_a / 1e3:>8.1f} {total_b / 1e3:>8.1f} {total_a / total_b:>9.2f}"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run", action="append", help="validation run label (repeatable; default: the 14B pair)"
    )
    args = parser.parse_args(argv)
    runs = {run.label: run for run in load_validation()}
    labels = args.run or list(DEFAULT_RUNS)
    unknown = [label for label in labels if label not in runs]
    if unknown:
        print(f"unknown validation run: {unknown[0]!r}", file=sys.stderr)
        return 2
    try:
        results = [breakdown(runs[label]) for label in labels]
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    for result in results:
        print("\n".join(format_breakdown(result)), end="\n\n")
    for a, b in itertools.pairwise(results):
        if a.run.gpu != b.run.gpu:
            print("\n".join(format_ratios(a, b)), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
