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


def fronted(
    api_request_ms: float, api_token_ms: float = 0.0, api_step_ms: float = 0.0
) -> EngineInstance:
    """An instance with an API server in front (LinearStepTime, no jitter)."""
    config = scheduler_config("v1", True, 10_000, "A100-SXM4-80GB")
    return EngineInstance(
        Scheduler(config, BlockPool(1000)),
        LinearStepTime(),
        Jitter(0.0, 1),
        api_request_ms=api_request_ms,
        api_token_ms=api_token_ms,
        api_step_ms=api_step_ms,
    )


def test_a_lone_request_waits_for_the_api_server_before_its_first_step():
    inst = fronted(4.0)
    inst.add_request(Request(0, 100, 2))
    assert inst.has_work() and not inst.scheduler.waiting
    first = inst.step()  # the API server's 4 ms, then the 110 ms prefill
    assert first.duration_s == pytest.approx(0.114)
    assert [r.request_id for r in first.emitted] == [0]
    assert inst.steps == 1  # the hand-over is not an engine step


def test_the_api_server_hands_requests_over_while_the_engine_steps():
    inst = fronted(4.0)
    for k in range(6):
        inst.add_request(Request(k, 100, 3))
    first = inst.step()  # request 0: 4 ms of API, 110 ms of prompt: time for the other five
    assert first.duration_s == pytest.approx(0.114)
    assert len(inst.scheduler.waiting) == 5 and not inst._inbox
    inst.step()
    assert len(inst.scheduler.running) == 6


def test_a_request_reaching_an_idle_api_server_mid_step_joins_the_next_step():
    """vLLM's API server starts on a request when it arrives: one that arrived 10 ms before the
    step ends (its 4 ms of input work done by then) joins the next step; one that arrived 2 ms
    before waits for the step after; without ``waited_ms`` it waits too."""
    for waited_ms, joins_next in ((10.0, True), (2.0, False), (0.0, False)):
        inst = fronted(4.0)
        inst.add_request(Request(0, 100, 5))
        inst.step()  # a 110 ms prefill: the API server idles for most of it
        late = Request(1, 50, 2)
        inst.add_request(late, waited_ms)
        step = inst.step()
        assert (late in step.emitted) is joins_next, waited_ms
        while inst.has_work():
            inst.step()
        assert late.num_generated == 2


def test_decode_runs_hand_requests_over_as_single_steps_do():
    """The simulator's driver: arrivals join at their time, runs stop at the next arrival."""

    def trace(use_runs: bool) -> list[tuple[float, int]]:
        inst = fronted(30.0, 0.5)
        arrivals = [(0.0, 0), (0.05, 1), (0.06, 2), (0.2, 3)]
        events, clock = [], 0.0
        while arrivals or inst.has_work():
            while arrivals and arrivals[0][0] <= clock:
                inst.add_request(Request(arrivals.pop(0)[1], 10, 40))
            if not inst.has_work():
                clock = arrivals[0][0]
                continue
            horizon = arrivals[0][0] - clock if arrivals else float("inf")
            run = inst.decode_run(horizon) if use_runs else None
            if run is not None:
                events += [(clock + end, len(run.requests)) for end in run.step_ends_s]
                clock += run.step_ends_s[-1]
            else:
                result = inst.step()
                clock += result.duration_s
                events.append((clock, len(result.emitted)))
        return events

    single, runs = trace(False), trace(True)
    assert [n for _, n in runs] == [n for _, n in single]
    assert [t for t, _ in runs] == pytest.approx([t for t, _ in single])
    assert max(n for _, n in runs) == 4


def test_streaming_tokens_leaves_the_api_server_less_time_for_new_requests():
    def handed_over(api_token_ms: float, api_step_ms: float = 0.0) -> int:
        inst = fronted(4.0, api_token_ms, api_step_ms)
        for k in range(40):
            inst.add_request(Request(k, 1, 50))
        inst.step()  # request 0's 1-token prompt, 11 ms: two more get in
        for _ in range(3):  # short decode steps of the running batch
            inst.step()
        return len(inst.scheduler.running) + len(inst.scheduler.waiting)

    assert handed_over(0.0) > handed_over(1.0)
    # the step's one output message takes the API server's time whatever the batch's size
    assert handed_over(0.0) > handed_over(0.0, api_step_ms=5.0)


def test_a_decode_run_ends_with_the_step_that_hands_a_request_over():
    inst = fronted(25.0)
    inst.add_request(Request(0, 10, 50))
    inst.step()  # 4 + 20 ms prefill... of a 10-token prompt: 20 ms
    inst.add_request(Request(1, 10, 50))
    run = inst.decode_run(float("inf"))
    assert run is not None and len(run.step_ends_s) == 3  # 11 ms decode steps: 25 ms at the 3rd
    assert [r.request_id for r in inst.scheduler.waiting] == [1]


def test_the_api_server_refuses_what_the_pool_could_never_hold():
    inst = fronted(4.0)
    with pytest.raises(ValueError, match="KV blocks but the pool has 1000"):
        inst.add_request(Request(0, 16_000, 10))


def test_a_request_that_arrives_with_its_kv_goes_straight_to_the_scheduler():
    """A disaggregated decode instance's request passed its API server before the KV pull."""
    inst = fronted(4.0)
    inst.add_request(Request(0, 100, 3, num_computed=99))
    assert [r.request_id for r in inst.scheduler.waiting] == [0] and not inst._inbox
    assert inst.step().duration_s == pytest.approx(0.011)  # one token of 10 + 1 ms, no hand-over
