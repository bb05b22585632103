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

Per recipe (sources and derivation in docs/engine-model.md, "Host-side cost"):

* ``v0`` (vLLM 0.6.x): scheduling and input preparation stay on the critical path (the step
  cost fitted on the calibration set); output processing (detokenisation, request outputs,
  stop checks) runs beside the next step (async output processor, PR #7049);
* ``v1`` (vLLM >= 0.8 default engine): the engine core is a busy loop with a small per-step and
  per-request cost; detokenisation and streaming moved into the separate API-server process.
"""

from __future__ import annotations

from dataclasses import dataclass

from servematrix.engine.steptime import StepBatch, StepTimeModel


@dataclass(frozen=True)
class HostCost:
    """CPU time per engine step: ``step_ms`` + ``per_seq_ms`` × requests on the critical path,
    and ``overlapped_per_seq_ms`` × requests of work beside it that the step cannot be shorter
    than."""

    step_ms: float
    per_seq_ms: float
    overlapped_per_seq_ms: float = 0.0
    request_ms: float = 0.0
    """The API server's serial work per request before the engine sees it (parse, validate,
    tokenise, hand over); ``EngineInstance`` queues requests through it."""

    def __post_init__(self) -> None:
        values = (self.step_ms, self.per_seq_ms, self.overlapped_per_seq_ms, self.request_ms)
        if min(values) < 0:
            raise ValueError(f"host cost must be >= 0, got {self}")

    @property
    def label(self) -> str:
        """How the cost reads in a step-time source label."""
        parts = [f"{self.step_ms:.3g} ms/step"]
        if self.per_seq_ms:
            parts.append(f"{self.per_seq_ms * 1e3:.3g} us/request")
        if self.overlapped_per_seq_ms:
            parts.append(f"step >= {self.overlapped_per_seq_ms * 1e3:.3g} us/request beside it")
        if self.request_ms:
            parts.append(f"API server {self.request_ms:.3g} ms/request")
        return ", ".join(parts)


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
        beside_ms = cost.overlapped_per_seq_ms * requests
        return critical_ms if critical_ms >= beside_ms else beside_ms


V0_OUTPUT_PROCESSING_MS_PER_SEQ = 0.103
"""V0 ``LLMEngine._process_model_outputs`` (detokenise, build the request outputs, check stop
conditions): 0.2 ms at batch 1 and 3.4 ms at batch 32, Llama-3-70B FP8 on 4 H100 (vLLM RFC
#6913, the async output processor's design, July 2024), i.e. (3.4 - 0.2) / 31 ms per sequence.
vLLM 0.6.0 runs it beside the next step (PR #7049)."""

V0_HOST_COST = HostCost(
    step_ms=2.07, per_seq_ms=0.0, overlapped_per_seq_ms=V0_OUTPUT_PROCESSING_MS_PER_SEQ
)
"""``step_ms`` fitted on the calibration rows of the Qwen2 speed benchmark (vLLM 0.4.2, A100,
batch 1, bf16, input 1): 1.98 / 2.09 / 2.07 ms for the 0.5B / 1.5B / 7B models, median 2.07
(``benchmarks/fidelity.py`` prints the fit). The per-request part on the critical path is not
identified by batch-1 data and is left at 0. vLLM 0.6's asynchronous output processing moved
part of this off the critical path, so for the ``v0`` recipe (0.6.x) it is an upper bound."""

V0_EAGER_HOST_COST = HostCost(
    step_ms=V0_HOST_COST.step_ms, per_seq_ms=V0_OUTPUT_PROCESSING_MS_PER_SEQ
)
"""``--enforce-eager`` turns V0's async output processor off ("Since, enforce-eager is enabled,
async output processor cannot be used", ``ModelConfig.verify_async_output_proc``), so output
processing is back on the critical path of every step."""

V1_API_REQUEST_MS = 4.0
"""The API server's serial work per request (V1): vLLM PR #17546 (API-server scale-out, May
2025) served Llama-3.2-1B on 2 A100s (DP 2) with ShareGPT at 120 req/s offered; with the single
API server of the time the 10,000 requests took 130.74 s, 76.5 req/s, far below what two A100s
decode for a 1B model: 13.07 ms of API-server time per request. Less its ~198 streamed tokens
(ShareGPT's mean output in vLLM's benchmark, PR #8335: 197,521 tokens for 1,000 prompts) at
``alpha2`` 45.9 us: 4.0 ms per request of input work. Derived, not fitted; the split assumes the
run was bound by the API server, which the PR's point (scale-out fixed it) implies. It is the
whole of the modelled API path: BLIS's ``alpha0`` is not used (see ``V1_HOST_COST``)."""

V1_HOST_COST = HostCost(
    step_ms=0.169,
    per_seq_ms=0.0028,
    overlapped_per_seq_ms=0.0459,
    request_ms=V1_API_REQUEST_MS,
)
"""Per-step beta7 169.4 us and per-request beta6 2.8 us (engine core, critical path) and
per-output-token alpha2 45.9 us (detokenisation and streaming in the API-server process,
beside the engine core), from BLIS's trained-physics fit, iteration 25: ``inference-sim/
inference-sim``, branch ``training`` @ 0ba6f035c69815b59c311bec6f66f854b68af4d4,
``training/iterations/iter25/inner_loop_results.json`` (copied to ``defaults.yaml`` by commit
638a7d33 "add trained-physics model (#950)" and refit since as iter29). That fit used 15
serving runs of inference-sim's own vLLM fork (journey and step tracing) on H100-80GB-HBM3
(``training/trainval_data/README.md``: Llama-2-7B, Qwen2.5-7B, Mistral-Nemo-12B, Yi-34B,
Llama-3.1-70B, Llama-4-Scout; TP 1-4), minimising RMSE of the per-run APE of mean TTFT plus
that of mean E2E; not vLLM 0.8.4 / 0.10.1 traces, as this docstring used to say.

Its ``alpha0`` (15,561.96 us, "QueueingTime", added between arrival and the engine's queue)
is not used: it was fitted together with a prefill compute term at 0.139 x the FLOP time at
peak (beta1a). For a 1,000-token prefill of a 7-8B model on an H100 BLIS's step is ~11 ms (2 ms
of compute, 6.5 ms of weight streaming, 2 ms per-layer) and its TTFT at idle ~27 ms with
alpha0; aiconfigurator's measured step alone is ~21 ms (Qwen2.5-7B, 1,024 tokens). So alpha0
stands in for prefill time BLIS's step leaves out, and adding it to a measured prefill counted
that time twice. The API path is ``V1_API_REQUEST_MS`` (idle TTFT 21 + 4 = 25 ms).
Not fitted here."""
