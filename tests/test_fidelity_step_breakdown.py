"""The per-term breakdown of a simulated validation run (``benchmarks/fidelity_step_breakdown.py``,
issue 42): GPUStack's Qwen3-14B very long prompts on A100 and H100, simulated for real."""

from __future__ import annotations

import pytest

from servematrix.engine.architecture import load_architecture
from servematrix.engine.steptime import StepBatch
from tests.benchmark_modules import load

(fidelity_step_breakdown,) = load("fidelity_step_breakdown")
A100_RUN, H100_RUN = fidelity_step_breakdown.DEFAULT_RUNS


@pytest.fixture(scope="module")
def results() -> dict[str, object]:
    runs = {run.label: run for run in fidelity_step_breakdown.load_validation()}
    return {label: fidelity_step_breakdown.breakdown(runs[label]) for label in (A100_RUN, H100_RUN)}


def test_the_terms_add_up_to_every_logged_step_and_the_busy_run(results) -> None:
    for result in results.values():
        terms_ms = sum(work.ms for work in result.terms.values())
        steps_ms = sum(sum(times) for times in result.step_ms.values())
        assert terms_ms == pytest.approx(steps_ms, rel=1e-9)
        # Every prompt is sent at once: the engine is busy from the first step to the last.
        assert terms_ms / 1e3 == pytest.approx(result.duration_s, rel=0.02)


def test_prefill_work_is_compute_bound_and_decode_attention_memory_bound(results) -> None:
    for result in results.values():
        gpu = fidelity_step_breakdown.gpu_spec(result.run.gpu)
        terms = result.terms
        assert fidelity_step_breakdown.bound(terms["shared, prefill"], gpu) == "compute"
        assert fidelity_step_breakdown.bound(terms["prefill attn"], gpu) == "compute"
        assert fidelity_step_breakdown.bound(terms["shared, decode"], gpu) == "memory"
        assert fidelity_step_breakdown.bound(terms["decode attn"], gpu) == "memory"


def test_only_the_flashattention_2_card_pays_the_mixed_step_rereads(results) -> None:
    assert results[A100_RUN].terms["FA2 rereads"].ms > 0
    assert results[H100_RUN].terms["FA2 rereads"].ms == 0


def test_the_ratio_table_divides_a_by_b(results) -> None:
    lines = fidelity_step_breakdown.format_ratios(results[A100_RUN], results[H100_RUN])
    total_a = sum(work.ms for work in results[A100_RUN].terms.values())
    total_b = sum(work.ms for work in results[H100_RUN].terms.values())
    assert lines[-1].split()[-1] == f"{total_a / total_b:.2f}"


def test_the_tables_parts_sum_to_the_step() -> None:
    tables = fidelity_step_breakdown.AicStepTime(
        load_architecture("qwen3-14b"), "A100-SXM4-80GB", 1, "bf16"
    )
    batch = StepBatch(prefill_chunks=((2042, 14733), (6, 0)), decode_contexts=(32054, 30000))
    parts = tables.parts_ms(batch)
    assert min(parts) > 0
    assert tables.step_ms(batch) == pytest.approx(sum(parts), rel=1e-12)


def test_an_unknown_run_is_one_line(capsys) -> None:
    assert fidelity_step_breakdown.main(["--run", "no such run"]) == 2
    assert capsys.readouterr().err == "unknown validation run: 'no such run'\n"
