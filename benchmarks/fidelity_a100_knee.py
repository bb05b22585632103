"""Where the simulator's A100 knee comes from (issue 42): the workload issue 42 describes for its
held-out A100 runs, simulated at two load stages, with the one mechanism the issue suspects
(V1's FlashAttention-2 mixed steps, `servematrix.engine.attention`) as implemented and under
two other readings of the A100's L2, and the step-time terms at the higher stage.

Issue 42 says vLLM V1 held a dense model on A100-80GB at its higher stage (6 req/s; prompts of
about 550-1,000 tokens with shared system prompts, about 250 output tokens, Poisson, a 2,048-token
chunked-prefill budget) where the simulator's queue explodes. Those runs are held out: this script
uses none of their numbers. It takes the prompt shapes of the BLIS H100 calibration runs
(`fidelity_blis`, the same workload family: a shared system prompt, a question of its own, fixed
output), one per shipped dense model and TP, and runs each on an A100-SXM4-80GB at 2.5 then
6 req/s, 300 s each, ``--max-num-batched-tokens 2048``, ``--gpu-memory-utilization 0.9``, no CPU
KV offload. A stage's queue is "growing" when its last 100 s have a mean TTFT over twice its first
100 s's.

The three readings of the mixed step's decode KV rereads (one per query head sharing a KV head,
where FA2 does not pack them; `WithMixedStepKvReads`):

- ``LRU`` (as implemented): one HBM read while one KV head's slice of the step fits one L2
  partition, every query head's read beyond it (an LRU cache cycled by a larger stream keeps
  nothing);
- ``fits``: the part of the slice that fits the partition is reread from L2, the rest from HBM
  (what an optimal replacement policy keeps of a cyclic stream; NVIDIA does not publish its L2
  policy, so the truth lies between these two);
- ``none``: the decodes of a mixed step cost what they cost in a decode-only call (packed, as
  FlashAttention-3 does on H100, and as vLLM PR #58013, open since 2026-09-21, would run FA2's
  mixed batches: a decode call beside a prefill call); neither rereads nor padded tiles.

Nothing here changes the simulator; the variants are the benchmark's own step-time wrappers.
The last line per model is the step at 60 decodes of 670 tokens, alone and with a 180-token
chunk (about the higher stage's step): aiconfigurator's terms, and what each reading adds. Where
the two L2 readings add the same, FA2's padded 64-row query tiles (their compute) outweigh the
KV reads.

    .venv/bin/python benchmarks/fidelity_a100_knee.py
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, replace

from fidelity_blis import BlisRun, blis_cell, load_blis_runs, stage_sends

from servematrix.engine.attention import WithMixedStepKvReads
from servematrix.engine.hardware import gpu_spec
from servematrix.engine.host import WithHostCost
from servematrix.engine.setup import cell_engine_setup
from servematrix.engine.steptime import StepBatch, StepTimeModel
from servematrix.simulate import simulate
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord

GPU = "A100-SXM4-80GB"
STAGES = ((300.0, 2.5), (300.0, 6.0))
BUDGET_TOKENS = 2048
RUNS = ("64", "63", "65", "60")
"""One BLIS run per shipped dense model: Qwen2.5-7B TP 1, Mistral-Nemo 12B TP 1, Yi-34B TP 2,
Llama-3.1-70B TP 4 (their prompt shapes only)."""
WINDOW_S = 100.0


class FitsInL2(WithMixedStepKvReads):
    """The ``fits`` reading (module docstring): the part of the slice beyond one L2 partition
    is what each further query head reads from HBM."""

    def extra_ms(self, batch: StepBatch) -> float:
        decode_tokens = sum(batch.decode_contexts)
        step_tokens = decode_tokens + sum(new + past for new, past in batch.prefill_chunks)
        slice_bytes = step_tokens * self.slice_bytes_per_token
        missed = max(0.0, 1.0 - self.l2_bytes / slice_bytes)
        reads = 1.0 + (self.query_heads_per_kv_head - 1.0) * missed
        once_ms = self.read_ms_per_token * decode_tokens
        return max(reads * once_ms, self.tile_ms_per_token * decode_tokens) - once_ms


class NoRereads(WithMixedStepKvReads):
    """The ``none`` reading: the decodes of a mixed step cost what they cost alone."""

    def extra_ms(self, batch: StepBatch) -> float:
        return 0.0


VARIANTS: dict[str, type[WithMixedStepKvReads]] = {
    "LRU": WithMixedStepKvReads,
    "fits": FitsInL2,
    "none": NoRereads,
}


def a100_run(run: BlisRun) -> BlisRun:
    return replace(run, stages=STAGES, max_num_batched_tokens=BUDGET_TOKENS, cpu_kv_blocks=0)


def a100_cell(run: BlisRun, requests: int) -> Cell:
    cell = blis_cell(run, 0, 0.9, requests)
    return replace(cell, engine={**cell.engine, "gpu": GPU})


def reading(cell: Cell, kind: type[WithMixedStepKvReads]) -> WithMixedStepKvReads:
    """The cell's table step time with the mixed-step rereads read as ``kind``."""
    setup = cell_engine_setup(cell)
    model = setup.step_time
    if not isinstance(model, WithHostCost) or not isinstance(model.model, WithMixedStepKvReads):
        raise SystemExit(f"{cell.model.name}: expected the V1 host cost over FA2 rereads")
    return kind(model.model.model, setup.arch, gpu_spec(GPU), cell.model.tensor_parallel)


def with_reading(cell: Cell, kind: type[WithMixedStepKvReads]) -> StepTimeModel:
    """The cell's whole step time (the recipe's host cost included) under ``kind``."""
    host = cell_engine_setup(cell).step_time
    assert isinstance(host, WithHostCost)
    return WithHostCost(reading(cell, kind), host.cost)


@dataclass(frozen=True)
class Stage:
    rate_per_s: float
    mean_ttft_ms: float
    last_ttft_ms: float
    first_ttft_ms: float
    mean_tpot_ms: float

    @property
    def growing(self) -> bool:
        return self.last_ttft_ms > 2 * self.first_ttft_ms


def _mean_ttft_ms(records: list[RequestRecord]) -> float:
    return statistics.fmean((r.first_token_s - r.sent_s) * 1e3 for r in records)


def stages(records: list[RequestRecord]) -> list[Stage]:
    """Each stage's requests by when they were scheduled: mean TTFT over all, its first and last
    ``WINDOW_S`` seconds, and mean TPOT."""
    out, start = [], 0.0
    for duration, rate in STAGES:
        end = start + duration
        inside = [r for r in records if start <= r.scheduled_s < end]
        first = [r for r in inside if r.scheduled_s < start + WINDOW_S]
        last = [r for r in inside if r.scheduled_s >= end - WINDOW_S]
        tpot = statistics.fmean(
            (r.end_s - r.first_token_s) * 1e3 / (r.completion_tokens - 1)
            for r in inside
            if r.completion_tokens > 1
        )
        out.append(
            Stage(rate, _mean_ttft_ms(inside), _mean_ttft_ms(last), _mean_ttft_ms(first), tpot)
        )
        start = end
    return out


def step_terms(cell: Cell) -> str:
    """The step at 60 decodes of 670 tokens, alone and with a 180-token chunk: the table's
    terms and each reading's reread time."""
    table = reading(cell, NoRereads).model
    decodes = (670,) * 60
    parts = []
    for label, batch in (
        ("decode", StepBatch((), decodes)),
        ("mixed", StepBatch(((180, 100),), decodes)),
    ):
        shared, prefill, decode = table.parts_ms(batch)
        text = f"{label}: shared {shared:.1f}, prefill attn {prefill:.1f}, decode attn {decode:.1f}"
        if batch.prefill_chunks:
            text += ", rereads " + " / ".join(
                f"{name} {reading(cell, kind).step_ms(batch) - table.step_ms(batch):.1f}"
                for name, kind in VARIANTS.items()
            )
        parts.append(text)
    return "; ".join(parts) + " ms"


def main() -> int:
    runs = {run.run: run for run in load_blis_runs()}
    print(
        f"== {GPU}, V1, budget {BUDGET_TOKENS} tokens, stages "
        + ", ".join(f"{d:.0f} s at {r} req/s" for d, r in STAGES)
        + " (seed 0): mean TTFT (first / last 100 s), mean TPOT per stage"
    )
    header = f"{'model':<28}{'TP':>3}  {'rereads':<6}"
    for _, rate in STAGES:
        header += f"  {f'{rate} req/s: TTFT ms (first/last)':<36}{'TPOT':>6}"
    print(header)
    for name in RUNS:
        run = a100_run(runs[name])
        sends = stage_sends(run, 0)
        cell = a100_cell(run, len(sends))
        for variant_name, kind in VARIANTS.items():
            records = simulate(cell, with_reading(cell, kind), send_times_s=sends).records
            line = f"{cell.model.name:<28}{run.tp:>3}  {variant_name:<6}"
            for stage in stages(records):
                ttft = f"{stage.mean_ttft_ms:.0f} ({stage.first_ttft_ms:.0f}/"
                ttft += f"{stage.last_ttft_ms:.0f}){' growing' if stage.growing else ''}"
                line += f"  {ttft:<36}{stage.mean_tpot_ms:>6.1f}"
            print(line, flush=True)
        print(f"  step terms ({cell.model.name}): {step_terms(cell)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
