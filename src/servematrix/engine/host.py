"""Host-side (CPU) cost of an engine step: what the GPU step tables leave out.

aiconfigurator's tables and the roofline time the forward pass. Around it, vLLM's engine loop
runs on the CPU, synchronously with the GPU in the V0 engine: schedule the step, build its input
tensors, wait for the sampled tokens, turn them into Python objects, check stop conditions,
update the block tables. Its cost has a fixed part per step and a part per request in the batch.
It dominates small models at batch 1 (a 0.5B model's decode step is ~1 ms of GPU time) and
grows with the batch under heavy concurrency.

Per recipe (sources and derivation in docs/engine-model.md, "Host-side cost"):

* ``v0`` (vLLM 0.6.x): the API server runs in its own process since 0.6.0 and output
  processing overlaps the next step (async output processor, PR #7049), but scheduling and
  input preparation stay on the critical path of every step;
* ``v1``: the engine core is a separate busy-loop process that overlaps scheduling with the
  GPU; what remains on the critical path per step is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

from servematrix.engine.steptime import StepBatch, StepTimeModel


@dataclass(frozen=True)
class HostCost:
    """CPU time on the critical path of one engine step: ``step_ms`` + ``per_seq_ms`` × the
    number of requests scheduled in it."""

    step_ms: float
    per_seq_ms: float

    def __post_init__(self) -> None:
        if self.step_ms < 0 or self.per_seq_ms < 0:
            raise ValueError(f"host cost must be >= 0, got {self}")


NO_HOST_COST = HostCost(0.0, 0.0)


class WithHostCost:
    """A step-time model plus the engine's host-side cost of each step."""

    def __init__(self, model: StepTimeModel, cost: HostCost):
        self.model = model
        self.cost = cost

    def step_ms(self, batch: StepBatch) -> float:
        requests = len(batch.prefill_chunks) + len(batch.decode_contexts)
        return self.model.step_ms(batch) + self.cost.step_ms + self.cost.per_seq_ms * requests


V0_HOST_COST = HostCost(step_ms=2.07, per_seq_ms=0.0)
"""Fitted on the calibration rows of the Qwen2 speed benchmark (vLLM 0.4.2, A100, batch 1,
bf16, input 1): 1.98 / 2.09 / 2.07 ms for the 0.5B / 1.5B / 7B models, median 2.07
(``benchmarks/fidelity.py`` prints the fit). The per-request part is not identified by batch-1
data and is left at 0. vLLM 0.6's asynchronous output processing moved part of this off the
critical path, so for the ``v0`` recipe (0.6.x) it is an upper bound."""
V1_HOST_COST = NO_HOST_COST
"""No calibration source yet for the V1 engine core's remaining per-step cost."""


def host_cost(recipe: str) -> HostCost:
    """The host-side cost of the recipe's engine (``v0`` / ``v1``)."""
    costs = {"v0": V0_HOST_COST, "v1": V1_HOST_COST}
    try:
        return costs[recipe]
    except KeyError:
        raise ValueError(f"unknown recipe {recipe!r} (known: v0, v1)") from None
