"""The A100 knee benchmark's readings of the mixed-step rereads (``benchmarks/
fidelity_a100_knee.py``): the L2 part that fits is between none and the LRU reading. Step-time
arithmetic on aiconfigurator's A100 tables, no simulation."""

from __future__ import annotations

from servematrix.engine.steptime import StepBatch
from tests.benchmark_modules import load

(knee,) = load("fidelity_a100_knee")


def _yi_34b_cell():
    runs = {run.run: run for run in knee.load_blis_runs()}
    return knee.a100_cell(knee.a100_run(runs["65"]), 10)


def test_the_part_that_fits_rereads_less_than_lru_and_more_than_none() -> None:
    cell = _yi_34b_cell()
    lru, fits, none = (knee.reading(cell, kind) for kind in knee.VARIANTS.values())
    table = none.model
    big = StepBatch(((180, 100),), (4000,) * 40)  # 160k tokens: 4x one L2 partition's slice
    extra = [model.step_ms(big) - table.step_ms(big) for model in (lru, fits, none)]
    assert extra[0] > extra[1] > extra[2] == 0.0


def test_a_slice_inside_one_partition_reads_alike_either_way() -> None:
    cell = _yi_34b_cell()
    lru, fits, _ = (knee.reading(cell, kind) for kind in knee.VARIANTS.values())
    small = StepBatch(((180, 100),), (670,) * 8)
    assert lru.step_ms(small) == fits.step_ms(small)


def test_a_stage_grows_when_its_last_window_waits_twice_its_first() -> None:
    assert knee.Stage(6.0, 500.0, 900.0, 400.0, 30.0).growing
    assert not knee.Stage(6.0, 500.0, 700.0, 400.0, 30.0).growing
