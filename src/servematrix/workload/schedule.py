"""The arrival schedule: when each measured request is sent, precomputed and seeded.

Matches vLLM's benchmark client before V1 (``benchmark_serving.py``, 2024): the first request
goes at t = 0, then each gap is ``gamma(shape=burstiness, scale=1/(qps*burstiness))`` drawn from
NumPy's legacy global generator seeded with the cell's seed (burstiness 1 is the exponential,
i.e. Poisson arrivals; gamma(1, θ) and exponential(θ) give the same stream). Unlike current
``vllm bench serve`` we do not rescale the schedule so the last request lands at N/qps.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_prompts: int, qps: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request in seconds from the benchmark start (float64, non-decreasing)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not qps > 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(qps):
        return np.zeros(num_prompts)
    rng = np.random.RandomState(seed)
    if math.isinf(burstiness):
        gaps = np.full(num_prompts - 1, 1.0 / qps)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=num_prompts - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def benchmark_serving_08_sends(
    num_prompts: int, qps: float, seed: int, input_len: int, output_len: int, vocab_size: int
) -> np.ndarray:
    """The send times vLLM 0.8's ``benchmarks/benchmark_serving.py`` draws for a random-dataset
    run at ``--seed seed`` (default range ratio 1.0, no prefix), as published runs of it drew them.

    Read in the 0.8.2 sdist: ``main`` seeds NumPy's global generator; ``RandomDataset.sample``
    then draws the input lengths, the output lengths and one token offset per prompt below the
    tokenizer's ``vocab_size`` from it; ``get_request`` sends the first request at once and
    draws ``gamma(burstiness, 1/(qps·burstiness))`` after each. The dataset's draws advance the
    stream, so the same seed gives other arrivals than `arrival_times` (burstiness 1 here)."""
    rng = np.random.RandomState(seed)
    rng.randint(input_len, input_len + 1, size=num_prompts)
    rng.randint(output_len, output_len + 1, size=num_prompts)
    rng.randint(0, vocab_size, size=num_prompts)
    return _first_then_gaps(rng, num_prompts, qps)


def benchmark_serving_08_sharegpt_sends(num_prompts: int, qps: float, seed: int) -> np.ndarray:
    """The send times vLLM 0.8's ``benchmark_serving.py`` draws for a ShareGPT run at
    ``--seed seed``: the same ``get_request`` gaps as `benchmark_serving_08_sends`, but nothing
    drawn from NumPy's generator before them (ShareGPT's sampling leaves it alone).

    Checked on the three finite-rate ShareGPT runs of ``surajssd/llm-k8s`` (vLLM 0.8.3, seed 0,
    `benchmarks/data/SOURCES.md`): each request's send plus its published TTFT and ITLs puts the
    last end 0.12-0.15 s before the published benchmark duration, against 0.4-26 s off for
    seeds 1-5."""
    return _first_then_gaps(np.random.RandomState(seed), num_prompts, qps)


def _first_then_gaps(rng: np.random.RandomState, num_prompts: int, qps: float) -> np.ndarray:
    """The first request at once, then one ``gamma(1, 1/qps)`` gap after each (burstiness 1)."""
    gaps = rng.gamma(shape=1.0, scale=1.0 / qps, size=num_prompts - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def bench_serve_019_sends(num_prompts: int, qps: float, seed: int) -> np.ndarray:
    """The send times ``vllm bench serve`` of vLLM 0.19 draws at ``--seed seed`` (Poisson, no
    ramp-up), as published runs of it drew them.

    Read in the 0.19.0 sdist (``vllm/benchmarks/serve.py`` ``get_request``): one gamma delay per
    request from NumPy's global generator seeded in ``main`` (the random dataset draws from its
    own ``default_rng``), the first request's included; their running sums are then rescaled so
    the last request goes at ``num_prompts / qps``."""
    delays = np.cumsum(np.random.RandomState(seed).gamma(1.0, 1.0 / qps, size=num_prompts))
    return delays * (num_prompts / qps) / delays[-1]
