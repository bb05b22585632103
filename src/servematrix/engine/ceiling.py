"""The physical ceiling of a deployment: a request rate its GPUs cannot exceed.

From the step-time model alone, with no queueing: an instance prefills at most as fast as
full ``max_num_batched_tokens`` steps allow, and decodes at most as fast as its largest batch
(``max_num_seqs``, or as many requests as the KV cache holds at their longest) allows. An
aggregated instance does both for every request, so its rate is at most the slower of the
two alone (an upper bound: mixed steps may overlap the two, never beat either); a
disaggregated deployment's prefill and decode instances each carry one half. The capacity
search probes up to a multiple of this ceiling (``servematrix.capacity``), and a search that
finds no failing rate below it says so rather than reporting the ceiling as a capacity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from servematrix.engine.setup import EngineSetup
from servematrix.engine.steptime import StepBatch
from servematrix.spec.topology import Topology


def prefill_rps(setup: EngineSetup, input_len: int) -> float:
    """Requests per second one instance prefills, in steps of full token budgets."""
    budget = setup.scheduler.max_num_batched_tokens
    if input_len <= budget:
        per_step = max(budget // input_len, 1)
        step_ms = setup.step_time.step_ms(StepBatch(((input_len, 0),) * per_step))
        return per_step * 1000 / step_ms
    chunks = math.ceil(input_len / budget)
    step_ms = setup.step_time.step_ms(StepBatch(((budget, input_len // 2),)))
    return 1000 / (chunks * step_ms)


def largest_batch(setup: EngineSetup, input_len: int, output_len: int) -> int:
    """The most requests one instance runs at once: ``max_num_seqs``, or as many as its KV
    cache holds at their longest."""
    fits = setup.kv.capacity_tokens // max(input_len + output_len, 1)
    return max(min(setup.scheduler.max_num_seqs, fits), 1)


def decode_rps(setup: EngineSetup, input_len: int, output_len: int) -> float:
    """Requests per second one instance decodes at its largest batch (at the mean context)."""
    batch = largest_batch(setup, input_len, output_len)
    context = input_len + output_len // 2
    step_ms = setup.step_time.step_ms(StepBatch(decode_contexts=(context,) * batch))
    return batch * 1000 / (step_ms * max(output_len - 1, 1))


def ceiling_rps(
    setups: Sequence[EngineSetup], topology: Topology, input_len: int, output_len: int
) -> float:
    """The deployment's ceiling: its aggregated instances, or the slower side of its prefill
    and decode instances; ``setups`` is each role's engine (`role_engine_setups`)."""
    if topology.disaggregated:
        (prefill, decode), (prefill_role, decode_role) = setups, topology.roles
        return min(
            prefill_role.count * prefill_rps(prefill, input_len),
            decode_role.count * decode_rps(decode, input_len, output_len),
        )
    (setup,), (role,) = setups, topology.roles
    return role.count * min(prefill_rps(setup, input_len), decode_rps(setup, input_len, output_len))
