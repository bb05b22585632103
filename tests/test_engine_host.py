"""The host-side step cost in isolation: what it adds per step and per request, per recipe."""

from __future__ import annotations

import pytest

from servematrix.engine.host import (
    NO_HOST_COST,
    V0_HOST_COST,
    HostCost,
    WithHostCost,
    host_cost,
)
from servematrix.engine.scheduler import Request
from servematrix.engine.setup import build_engine_setup
from servematrix.engine.steptime import StepBatch


class FixedStep:
    def step_ms(self, batch: StepBatch) -> float:
        return 10.0


def test_adds_a_fixed_part_per_step_and_a_part_per_request() -> None:
    model = WithHostCost(FixedStep(), HostCost(step_ms=2.0, per_seq_ms=0.5))
    assert model.step_ms(StepBatch((), (100,))) == pytest.approx(12.5)
    assert model.step_ms(StepBatch(((512, 0), (64, 0)), (100, 200, 300))) == pytest.approx(14.5)


def test_negative_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="host cost must be >= 0"):
        HostCost(step_ms=-1.0, per_seq_ms=0.0)


def test_per_recipe_cost_and_unknown_recipe() -> None:
    assert host_cost("v0") == V0_HOST_COST
    assert host_cost("v0").step_ms > 0
    assert host_cost("v1") == NO_HOST_COST
    with pytest.raises(ValueError, match="unknown recipe 'v2'"):
        host_cost("v2")


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
    instance.step()  # prefill
    return instance.step().duration_s * 1e3, setup.step_time_label


def test_the_engine_pays_the_recipe_host_cost_on_every_step() -> None:
    v0_ms, v0_label = _batch1_step_ms("v0")
    v1_ms, v1_label = _batch1_step_ms("v1")
    assert v0_ms - v1_ms == pytest.approx(V0_HOST_COST.step_ms + V0_HOST_COST.per_seq_ms, abs=1e-6)
    assert "v0 host" in v0_label and "host" not in v1_label
