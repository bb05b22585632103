"""Shared fixtures: the repository root and a small, valid config to derive broken ones from."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

SMALL_CONFIG: dict[str, Any] = {
    "backend": "simulator",
    "defaults": {"num_prompts": 20, "output_len": 6, "seed": 0, "warmup_requests": 1},
    "slo": {
        "ttft": {"statistic": "p99", "max_ms": 2000},
        "tpot": {"statistic": "p99", "max_ms": 100},
        "attainment": 0.9,
    },
    # Short probes (the defaults' 600 s and 6,400 requests for a P99 are the benchmarks').
    "capacity": {"min_duration_s": 60, "tail_requests": 5},
    "models": {
        "Qwen2.5-7B-Instruct-GPTQ-Int4": {
            "hf_id": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
            "architecture": "qwen2.5-7b",
            "quantization": "gptq-int4",
            "tensor_parallel": 1,
            "gpus": [[0], [4]],
        },
        "Qwen2.5-14B-Instruct": {
            "hf_id": "Qwen/Qwen2.5-14B-Instruct",
            "architecture": "qwen2.5-14b",
            "tensor_parallel": 1,
            "gpus": [[0]],
        },
    },
    "studies": {
        "disagg": {
            "recipe": "v0",
            "models": ["Qwen2.5-7B-Instruct-GPTQ-Int4"],
            "modes": ["nondisagg", "mooncake-rdma"],
            "qps": [2, 4],
            "input_len": [1024],
        },
        "sizes": {
            "recipe": "v0",
            "models": ["Qwen2.5-7B-Instruct-GPTQ-Int4", "Qwen2.5-14B-Instruct"],
            "modes": ["single"],
            "qps": [4],
            "input_len": [512, 1024],
            "x": "input_len",
        },
    },
}


@pytest.fixture
def small_config() -> dict[str, Any]:
    return copy.deepcopy(SMALL_CONFIG)


@pytest.fixture
def default_config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
