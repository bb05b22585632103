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
