"""Host-side (CPU) cost of an engine step: what the GPU step tables leave out.

aiconfigurator's tables and the roofline time the forward pass. Around it, vLLM spends CPU time
in two places, and they cost a step differently:

* **on the critical path** of the engine loop: schedule the step, build its input tensors,
  wait for the sampled tokens, update the requests. The GPU idles meanwhile, so this adds to
  every step: a fixed part (``step_ms``) and a part per request in the batch (``per_seq_ms``);
* **beside the engine loop**, in another thread or process: turn each request's new token into
  text and stream it to its client. It overlaps the next GPU step, so it costs nothing while it
  is shorter than the step; but one process does it for every running stream in turn, so when
  its work per step (``overlapped_per_seq_ms`` × requests) outlasts the step, it sets the step
  rate here: tokens cannot reach clients faster than it hands them on (V1's engine core would
  step on, but its outputs, and the requests queued behind them, wait in that process);
* **in front of the engine** (V1): the same API-server process does each request's input work
  (``request_ms``, serial: ``EngineInstance`` queues requests through it).

Per recipe (each recipe version's module holds its costs, ``servematrix.recipes.v0`` and
``v1``; sources and derivation in docs/engine-model.md, "Host-side cost"):

* ``v0`` (vLLM 0.6.x): scheduling and input preparation stay on the critical path (the step
  cost fitted on the calibration set); output processing (detokenisation, request outputs,
  stop checks) runs beside the next step (async output processor, PR #7049);
* ``v1`` (vLLM >= 0.8 default engine): the engine core is a busy loop with a small per-step and
  per-request cost; detokenisation and streaming moved into the separate API-server process.
"""

from __future__ import annotations

from servematrix.engine.steptime import StepBatch, StepTimeModel
from servematrix.recipes.base import HostCost

NO_HOST_COST = HostCost(0.0, 0.0)


class WithHostCost:
    """A step-time model plus the engine's host-side cost of each step."""

    def __init__(self, model: StepTimeModel, cost: HostCost):
        self.model = model
        self.cost = cost

    def step_ms(self, batch: StepBatch) -> float:
        cost = self.cost
        requests = len(batch.prefill_chunks) + len(batch.decode_contexts)
        critical_ms = self.model.step_ms(batch) + cost.step_ms + cost.per_seq_ms * requests
        beside_ms = cost.overlapped_step_ms + cost.overlapped_per_seq_ms * requests
        return critical_ms if critical_ms >= beside_ms else beside_ms
