"""The step-time interface: how long one engine step takes for a given batch.

The scheduler builds a ``StepBatch`` per step and asks a ``StepTimeModel``; implementations
(roofline, measured aiconfigurator tables) are interchangeable without touching the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StepBatch:
    """What one forward pass of one instance computes.

    ``prefill_chunks``: (new tokens, tokens already in the KV cache) per prefilling request.
    ``decode_contexts``: context length (prompt + generated) per decoding request.
    """

    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(new for new, _ in self.prefill_chunks) + len(self.decode_contexts)


class StepTimeModel(Protocol):
    """Predicts the duration of one engine step in milliseconds (no jitter: the engine adds it)."""

    def step_ms(self, batch: StepBatch) -> float: ...


class WithDecodeOverhead:
    """A step-time model plus a fixed cost on pure-decode steps: ``--enforce-eager`` (or V0's
    per-step TP broadcast) on top of a measured table taken with CUDA graphs."""

    def __init__(self, model: StepTimeModel, decode_extra_ms: float, any_step_extra_ms: float):
        self.model = model
        self.decode_extra_ms = decode_extra_ms
        self.any_step_extra_ms = any_step_extra_ms

    def step_ms(self, batch: StepBatch) -> float:
        extra = self.any_step_extra_ms
        if not batch.prefill_chunks:
            extra += self.decode_extra_ms
        return self.model.step_ms(batch) + extra
