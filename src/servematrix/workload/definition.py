"""What the client sends: a cell's workload as its config gives it, before any request is built.

It lives below the spec (``servematrix.spec.matrix`` holds it in every `Cell`) so that the
datasets and the request builder of this package need nothing from the layers above them.
"""

from __future__ import annotations

from dataclasses import dataclass

from servematrix.workload.sessions import Sessions


@dataclass(frozen=True)
class Workload:
    """What the client sends: one definition every backend honours (``servematrix.workload``).

    ``qps`` may be ``math.inf`` (every measured request at t = 0). ``max_concurrency`` None
    means no cap; otherwise at most that many requests are in flight and a request waits for a
    free slot after its scheduled time, as ``vllm bench serve --max-concurrency``.
    ``range_ratio`` spreads the random dataset's lengths uniformly over
    [len·(1−r), len·(1+r)]; ``dataset_path`` is the sonnet text or jsonl file; ``prefix_len``
    the sonnet prompts' shared prefix in tokens, or the random prompts' system prompt (part
    of ``input_len``), one of ``prefix_groups`` distinct ones per request. ``ignore_eos``
    False lets the server stop at EOS (the output length is then the model's, at most the
    dataset's).
    The mooncake dataset (``servematrix.workload.replay``) replays ``dataset_path`` from
    ``trace_start_s``; ``trace_timing`` "timestamps" keeps its arrival pattern scaled to ``qps``,
    "qps" re-times it as the other datasets; ``input_len`` caps its inputs and
    ``input_overflow`` says whether longer requests are dropped or truncated. ``sessions``
    makes the measured requests multi-turn conversations (`servematrix.workload.sessions`);
    ``num_prompts`` is then their total number of turns.
    """

    qps: float
    input_len: int
    output_len: int
    num_prompts: int
    seed: int
    dataset: str
    burstiness: float
    warmup_requests: int
    max_concurrency: int | None = None
    range_ratio: float = 0.0
    dataset_path: str | None = None
    prefix_len: int = 0
    ignore_eos: bool = True
    trace_start_s: float = 0.0
    trace_timing: str = "timestamps"
    input_overflow: str = "drop"
    prefix_groups: int = 1
    sessions: Sessions | None = None


TRACE_DEFAULTS = {"trace_start_s": 0.0, "trace_timing": "timestamps", "input_overflow": "drop"}
"""The mooncake dataset's `Workload` fields and their defaults (left out of a cell's
parameters when they are at them)."""
