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
    """A measured table taken with CUDA graphs, run with ``--enforce-eager`` and/or V0's per-step
    TP broadcast.

    Eager decode: the host launches every kernel one by one, but launches are asynchronous, so
    they overlap the GPU's work. A pure-decode step takes ``max(table step, eager_launch_ms)``:
    launch-bound (longer) for a small model whose GPU step is shorter than its launches, as
    long as the table says for a large one. ``any_step_extra_ms`` is added to every step.
    """

    def __init__(self, model: StepTimeModel, eager_launch_ms: float, any_step_extra_ms: float):
        self.model = model
        self.eager_launch_ms = eager_launch_ms
        self.any_step_extra_ms = any_step_extra_ms

    def step_ms(self, batch: StepBatch) -> float:
        ms = self.model.step_ms(batch)
        if not batch.prefill_chunks and ms < self.eager_launch_ms:
            ms = self.eager_launch_ms
        return ms + self.any_step_extra_ms


class PlusSiblingDifference:
    """A GPU without measured tables, from a sibling card's (the same die with other memory):
    the sibling's measured step plus the roofline's difference between the two cards for the
    same batch. The difference is the memory-bound time the cards' HBM bandwidths set apart; a
    compute-bound step costs the same on both, so it is the sibling's measured one."""

    def __init__(self, measured: StepTimeModel, card: StepTimeModel, sibling: StepTimeModel):
        self.measured = measured
        self.card = card
        self.sibling = sibling

    def step_ms(self, batch: StepBatch) -> float:
        difference = self.card.step_ms(batch) - self.sibling.step_ms(batch)
        return self.measured.step_ms(batch) + difference
