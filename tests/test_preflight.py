"""Engine checks of a config before any job, through `servematrix check`: a KV cache that
cannot hold one request of the configured workload is refused in one line naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from servematrix import cli
from servematrix.engine.setup import build_engine_setup
from tests.conftest import SMALL_CONFIG

UTILIZATION = 0.088  # a pool of 16,112 tokens, inside the model's context of 32,768


def pool_blocks() -> int:
    """The KV blocks of the 7B GPTQ model at ``UTILIZATION`` with V0 chunked prefill (its token
    budget, and so the pool, does not depend on max_model_len)."""
    setup = build_engine_setup(
        "qwen2.5-7b",
        quantization="gptq-int4",
        tensor_parallel=1,
        recipe="v0",
        chunked_prefill=True,
        max_model_len=4096,
        gpu_memory_utilization=UTILIZATION,
    )
    return setup.kv.num_blocks


def tight_config(backend: str, input_len: int, max_model_len: int) -> dict:
    cfg = copy.deepcopy(SMALL_CONFIG)
    cfg["backend"] = backend
    cfg["defaults"] |= {"gpu_memory_utilization": UTILIZATION, "max_model_len": max_model_len}
    cfg["studies"] = {
        "tight": {
            "recipe": "v0",
            "models": ["Qwen2.5-7B-Instruct-GPTQ-Int4"],
            "modes": ["chunked"],
            "qps": [2],
            "input_len": [512, input_len],
        }
    }
    return cfg


def check(tmp_path: Path, capsys, cfg: dict) -> tuple[int, list[str]]:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    code = cli.main(["check", str(path)])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("backend", ["simulator", "emulator"])
def test_a_v0_cache_that_admits_no_prompt_of_the_workload_is_a_config_error(
    tmp_path, capsys, backend
):
    blocks = pool_blocks()
    reserved = blocks // 100  # V0's 1 % watermark
    admissible = (blocks - reserved) * 16
    capacity = blocks * 16  # max_model_len may be the whole pool (vLLM's start-up check)
    assert reserved >= 1 and admissible + 1 + 6 <= capacity  # the request fits the context
    code, err = check(tmp_path, capsys, tight_config(backend, admissible + 1, capacity))
    assert code == 1
    assert err == [
        "servematrix: config error at studies.tight.input_len: no request of "
        f"Qwen2.5-7B-Instruct-GPTQ-Int4 at input {admissible + 1} can be served: the KV cache "
        f"holds {blocks} blocks of 16 tokens and v0 admits a prompt into the {blocks - reserved} "
        f"above its watermark, so vLLM ignores every one (Input prompt ({admissible + 1} tokens) "
        "+ lookahead slots (0) is too long and exceeds the capacity of block_manager); lower "
        "input_len or max_model_len, or raise gpu_memory_utilization"
    ]
    assert not (tmp_path / "results").exists()
    # One token less fits above the watermark; a real server is not the engine model.
    assert check(tmp_path, capsys, tight_config(backend, admissible, capacity))[0] == 0
    assert check(tmp_path, capsys, tight_config("vllm", admissible + 1, capacity))[0] == 0


def test_a_cache_shorter_than_max_model_len_is_a_config_error(tmp_path, capsys):
    capacity = pool_blocks() * 16
    code, err = check(tmp_path, capsys, tight_config("simulator", 1024, capacity + 16))
    assert code == 1
    assert err == [
        "servematrix: config error at studies.tight.models[0]: Qwen2.5-7B-Instruct-GPTQ-Int4 "
        f"(gptq-int4) on A100-SXM4-80GB at TP 1: the model's max seq len ({capacity + 16}) is "
        "larger than the maximum number of tokens that can be stored in KV cache "
        f"({capacity}). Try increasing gpu_memory_utilization or decreasing max_model_len when "
        "initializing the engine."
    ]
