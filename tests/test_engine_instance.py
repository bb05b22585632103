"""The clock-agnostic instance: steps, multi-step decode runs and jitter."""

from __future__ import annotations

import pytest

from servematrix.engine.instance import EngineInstance, Jitter
from servematrix.engine.kvcache import BlockPool
from servematrix.engine.scheduler import Request, Scheduler, scheduler_config
from servematrix.engine.steptime import StepBatch


class LinearStepTime:
    """10 ms per step + 1 ms per token + 0.001 ms per context token."""

    def step_ms(self, batch: StepBatch) -> float:
        return 10 + batch.num_tokens + 0.001 * sum(batch.decode_contexts)


def instance(jitter_cv: float = 0.0) -> EngineInstance:
    config = scheduler_config("v1", True, 10_000, "A100-SXM4-80GB")
    return EngineInstance(
        Scheduler(config, BlockPool(1000)), LinearStepTime(), Jitter(jitter_cv, 1)
    )


def test_step_durations_and_tokens():
    inst = instance()
    inst.add_request(Request(0, 100, 3))
    first = inst.step()
    assert first.duration_s == 0.110 and [r.request_id for r in first.emitted] == [0]
    second = inst.step()
    assert second.duration_s == pytest.approx(0.011101)
    third = inst.step()
    assert [r.request_id for r in third.finished] == [0] and not inst.has_work()


def test_decode_run_equals_single_steps():
    def trace(use_runs: bool) -> list[float]:
        inst = instance(jitter_cv=0.05)
        for k in range(3):
            inst.add_request(Request(k, 50 + k, 6 + k))
        times, clock = [], 0.0
        while inst.has_work():
            run = inst.decode_run(float("inf")) if use_runs else None
            if run is not None:
                times += [clock + end for end in run.step_ends_s]
                clock += run.step_ends_s[-1]
            else:
                clock += inst.step().duration_s
                times.append(clock)
        return times

    assert trace(True)[-1] == trace(False)[-1]


def test_decode_run_stops_at_the_horizon():
    inst = instance()
    inst.add_request(Request(0, 10, 50))
    inst.step()
    run = inst.decode_run(0.025)  # steps of ~11 ms: the third starts at 22 ms < 25 ms
    assert len(run.step_ends_s) == 3


def test_jitter_is_seeded_and_zero_cv_is_exact():
    assert Jitter(0.0, 3).factor() == 1.0
    a, b = Jitter(0.05, 7), Jitter(0.05, 7)
    assert [a.factor() for _ in range(5000)] == b.peek(5000)


def test_decode_run_with_no_time_before_the_horizon_is_left_to_step():
    # An event at "now" (a horizon of 0) leaves no room for a run; the caller steps instead.
    inst = instance()
    inst.add_request(Request(0, 10, 50))
    inst.step()
    assert inst.decode_run(0.0) is None
    assert len(inst.decode_run(1.0).step_ends_s) > 1
