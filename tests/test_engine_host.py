"""The host-side step cost in isolation: what it adds per step and per request, per recipe."""

from __future__ import annotations

import pytest

from servematrix.engine.host import WithHostCost
from servematrix.engine.scheduler import Request
from servematrix.engine.setup import build_engine_setup
from servematrix.engine.steptime import StepBatch
from servematrix.recipes import UnknownRecipeError, recipe_version
from servematrix.recipes.base import HostCost
from servematrix.recipes.v0 import V0_EAGER_HOST_COST, V0_HOST_COST
from servematrix.recipes.v1 import V1_HOST_COST
from servematrix.simulate import simulate
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload


class FixedStep:
    def step_ms(self, batch: StepBatch) -> float:
        return 10.0


def test_adds_a_fixed_part_per_step_and_a_part_per_request() -> None:
    model = WithHostCost(FixedStep(), HostCost(step_ms=2.0, per_seq_ms=0.5))
    assert model.step_ms(StepBatch((), (100,))) == pytest.approx(12.5)
    assert model.step_ms(StepBatch(((512, 0), (64, 0)), (100, 200, 300))) == pytest.approx(14.5)


def test_work_beside_the_step_only_counts_when_it_outlasts_the_step() -> None:
    model = WithHostCost(
        FixedStep(), HostCost(step_ms=1.0, per_seq_ms=0.0, overlapped_per_seq_ms=0.1)
    )
    assert model.step_ms(StepBatch((), (100,) * 50)) == pytest.approx(11.0)  # 5 ms beside
    assert model.step_ms(StepBatch((), (100,) * 200)) == pytest.approx(20.0)  # 20 ms beside
    assert model.step_ms(StepBatch(((64, 0),), (100,) * 199)) == pytest.approx(20.0)


def test_work_beside_every_step_adds_to_its_work_per_request() -> None:
    """A CPU node's API server takes in one output message a step, whatever its size
    (``overlapped_step_ms``), beside its work on each request's token."""
    cost = HostCost(step_ms=1.0, per_seq_ms=0.0, overlapped_step_ms=4.0, overlapped_per_seq_ms=0.1)
    model = WithHostCost(FixedStep(), cost)
    assert model.step_ms(StepBatch((), (100,) * 50)) == pytest.approx(11.0)  # 9 ms beside
    assert model.step_ms(StepBatch((), (100,) * 200)) == pytest.approx(24.0)  # 24 ms beside
    assert "step >= 4 ms + 100 us/request beside it" in cost.label


def test_negative_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="host cost must be >= 0"):
        HostCost(step_ms=-1.0, per_seq_ms=0.0)
    with pytest.raises(ValueError, match="host cost must be >= 0"):
        HostCost(step_ms=0.0, per_seq_ms=0.0, request_ms=-1.0)


def test_per_recipe_cost_and_unknown_recipe() -> None:
    v0, v1 = recipe_version("v0"), recipe_version("v1")
    assert v0.host_cost_with(enforce_eager=False) == V0_HOST_COST
    assert V0_HOST_COST.step_ms > 0 and not V0_HOST_COST.per_seq_ms
    assert v1.host_cost_with(False) == v1.host_cost_with(True) == V1_HOST_COST
    with pytest.raises(UnknownRecipeError, match=r"^unknown recipe 'v2' \(known: v0, v1\)$"):
        recipe_version("v2")


def test_eager_v0_processes_outputs_on_the_critical_path() -> None:
    """vLLM 0.6 turns the async output processor off under --enforce-eager."""
    eager = recipe_version("v0").host_cost_with(enforce_eager=True)
    assert eager == V0_EAGER_HOST_COST
    assert eager.per_seq_ms == V0_HOST_COST.overlapped_per_seq_ms > 0
    assert not eager.overlapped_per_seq_ms
    batch = StepBatch((), (100,) * 32)
    graphs, eager_ms = (WithHostCost(FixedStep(), c).step_ms(batch) for c in (V0_HOST_COST, eager))
    assert eager_ms - graphs == pytest.approx(32 * eager.per_seq_ms)


def test_v1_has_an_api_server_in_front_and_a_small_engine_core_cost() -> None:
    cost = recipe_version("v1").host_cost
    assert 0 < cost.step_ms < 1 and 0 < cost.per_seq_ms < 0.01
    assert cost.overlapped_per_seq_ms > 0 and cost.request_ms > 0
    assert "API server" in cost.label


def _batch1_step_ms(recipe: str) -> tuple[float, str]:
    setup = build_engine_setup(
        "qwen2.5-7b",
        quantization="bf16",
        tensor_parallel=1,
        recipe=recipe,
        chunked_prefill=None,
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        jitter_cv=0.0,
    )
    instance = setup.instance(0)
    instance.add_request(Request(0, 16, 3))
    while not instance.step().emitted:  # the API server's hand-over, then the prefill
        pass
    return instance.step().duration_s * 1e3, setup.step_time_label


def test_the_engine_pays_the_recipe_host_cost_on_every_step() -> None:
    v0_ms, v0_label = _batch1_step_ms("v0")
    v1_ms, v1_label = _batch1_step_ms("v1")
    v0_extra = V0_HOST_COST.step_ms + V0_HOST_COST.per_seq_ms
    v1_extra = V1_HOST_COST.step_ms + V1_HOST_COST.per_seq_ms
    assert v0_ms - v1_ms == pytest.approx(v0_extra - v1_extra, abs=1e-6)
    assert "v0 host (2.07 ms/step" in v0_label and "v1 host (0.169 ms/step" in v1_label


def _ttft_s(recipe: str) -> float:
    cell = Cell(
        backend="simulator",
        recipe=recipe,
        model=ModelSpec(
            "Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b", "bf16", 1, ((0,),)
        ),
        mode=MODES["single"],
        workload=Workload(
            qps=0.5,
            input_len=16,
            output_len=2,
            num_prompts=1,
            seed=0,
            dataset="random",
            burstiness=1.0,
            warmup_requests=0,
        ),
        serving=Serving(4096, 0.9),
        engine={"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0},
    )
    record = next(r for r in simulate(cell).records if not r.warmup)
    return record.first_token_s - record.sent_s


def test_a_v1_request_pays_the_api_path_before_its_first_token() -> None:
    """TTFT at batch 1: v1's API server (its serial work) comes before the prefill."""
    api_s = V1_HOST_COST.request_ms * 1e-3
    assert _ttft_s("v1") > api_s
    assert _ttft_s("v1") - _ttft_s("v0") == pytest.approx(api_s, abs=0.006)


def test_a_request_aborted_in_the_api_servers_inbox_never_runs() -> None:
    """A client that leaves while its request waits for the API server's hand-over: the request
    is dropped there (it never reaches the scheduler); the others are served."""
    setup = build_engine_setup(
        "qwen2.5-7b",
        quantization="bf16",
        tensor_parallel=1,
        recipe="v1",
        chunked_prefill=None,
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        jitter_cv=0.0,
    )
    instance = setup.instance(0)
    requests = [Request(k, 16, 3) for k in range(3)]
    for request in requests:
        instance.add_request(request)
    instance.abort(requests[1])
    served: set[int] = set()
    while instance.has_work():
        served |= {r.request_id for r in instance.step().finished}
    assert served == {0, 2}
    assert requests[1].num_computed == 0 and requests[1].num_generated == 0
