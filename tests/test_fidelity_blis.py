"""BLIS's H100 calibration runs: the file parses and is self-consistent, and each run's cell has
the published arrivals' shape, KV pool and CPU KV tier (``benchmarks/fidelity_blis.py``).
``benchmarks/fidelity.py`` prints how close the simulator comes; nothing here judges that."""

from __future__ import annotations

import pytest

from servematrix.engine.setup import EngineFlags, engine_setup, plan_engine
from tests.benchmark_modules import load

(fidelity_blis,) = load("fidelity_blis")
RUNS = fidelity_blis.load_blis_runs()
SIMULATED = [run for run in RUNS if fidelity_blis.unsupported(run) is None]


def test_all_fifteen_runs_load_and_the_four_moe_runs_say_why_they_are_left_out() -> None:
    assert len(RUNS) == 15 and len({run.run for run in RUNS}) == 15
    left_out = [run for run in RUNS if run not in SIMULATED]
    assert len(left_out) == 4
    assert all("Llama-4-Scout" in run.model for run in left_out)
    assert all("mixture-of-experts" in fidelity_blis.unsupported(run) for run in left_out)


def _published_totals() -> dict[str, tuple[int, int, int]]:
    lines = fidelity_blis.CSV_PATH.read_text().splitlines()
    rows = [line.split(",") for line in lines if not line.startswith("#")]
    header = rows[0]
    index = {name: header.index(name) for name in header}
    columns = ("completed_requests", "total_input_tokens", "total_output_tokens")
    return {row[0]: tuple(int(row[index[name]]) for name in columns) for row in rows[1:]}


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.run)
def test_published_totals_are_the_fixed_lengths(run) -> None:
    """Catches transcription slips, and pins the reading the simulation rests on: every request
    is its system prompt plus its question (no growing multi-turn context), and the client
    counts one output token fewer than ``max_tokens``."""
    completed, inputs, outputs = _published_totals()[run.run]
    assert inputs == completed * (run.system_prompt_len + run.question_len)
    assert outputs == completed * (run.output_len - 1)
    assert 0 <= completed - run.num_requests <= 64
    published = run.published
    assert published["p99_ttft_ms"] >= published["p90_ttft_ms"]
    assert published["p99_e2el_ms"] >= published["p90_e2el_ms"]
    assert published["mean_e2el_ms"] > published["mean_ttft_ms"] + published["mean_itl_ms"]


def test_stage_sends_follow_each_stage_rate_inside_its_window() -> None:
    run = next(r for r in RUNS if r.run == "20260217-231439")  # 600 s at 8/s, then 600 s at 20/s
    sends = fidelity_blis.stage_sends(run, 0)
    assert sends == sorted(sends) and sends == fidelity_blis.stage_sends(run, 0)
    assert sends != fidelity_blis.stage_sends(run, 1)
    first = [t for t in sends if t < 600]
    second = [t for t in sends if t >= 600]
    assert max(sends) <= 1200
    assert abs(len(first) - 4800) < 4 * 4800**0.5
    assert abs(len(second) - 12000) < 4 * 12000**0.5
    per_second = [sum(1 for t in second if 600 + k <= t < 601 + k) for k in range(600)]
    assert max(per_second) < 45  # Poisson(20) per second, no pile-up at the stage's end


@pytest.mark.parametrize("run", SIMULATED, ids=lambda run: run.run)
def test_each_cell_holds_the_published_kv_pool_and_cpu_tier(run) -> None:
    cell = fidelity_blis.blis_cell(run, 0, fidelity_blis.memory_utilization(run))
    flags = EngineFlags.of_cell(cell)
    assert abs(plan_engine(run.architecture, flags).kv.num_blocks - run.total_kv_blocks) <= 1
    setup = engine_setup(run.architecture, flags)
    assert setup.kv_offload is not None
    assert setup.kv_offload.capacity_blocks == run.cpu_kv_blocks
    assert setup.scheduler.max_num_seqs == run.max_num_seqs
    assert setup.scheduler.max_num_batched_tokens == run.max_num_batched_tokens
    assert setup.scheduler.prefix_caching
    workload = cell.workload
    assert workload.input_len == run.system_prompt_len + run.question_len
    assert (workload.prefix_len, workload.prefix_groups) == (
        run.system_prompt_len,
        run.system_prompts,
    )


def test_a_run_is_scored_on_its_seven_published_metrics_per_seed() -> None:
    run = next(r for r in RUNS if r.run == "66")  # 1,219 requests, the shortest to simulate
    points, skipped = fidelity_blis.blis_points([run], seeds=2)
    assert skipped == []
    assert [p.metric for p in points] == list(fidelity_blis.METRICS)
    assert all(p.set_name == "calibration" and p.gpu == "H100-SXM5-80GB" for p in points)
    assert all(len(p.predicted) == 2 and p.predicted[0] != p.predicted[1] for p in points)
