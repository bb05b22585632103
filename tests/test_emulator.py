"""The emulator's parts in-process: command line, start-up checks, model names, vLLM's
context-length rules, the wire shapes and the wall-clock driver's timeline."""

from __future__ import annotations

import asyncio
import json

import pytest

from servematrix.emulator import wire
from servematrix.emulator.cli import (
    StartupError,
    check_kv_transfer_config,
    check_visible_gpus,
    parse_args,
)
from servematrix.emulator.models import ModelError, resolve_model
from servematrix.emulator.pacing import WallClockEngine
from servematrix.engine.admission import ContextLengthError, granted_max_tokens
from servematrix.engine.architecture import ARCHITECTURES_DIR
from servematrix.engine.scheduler import Request
from servematrix.engine.setup import build_engine_setup
from servematrix.engine.steptime import StepBatch
from tests.conftest import ROOT


def test_every_vllm_serve_flag_the_recipes_use_is_accepted():
    args = parse_args(
        [
            "serve",
            "Qwen/Qwen2.5-72B-Instruct",
            "--port", "8100", "--host", "127.0.0.1", "-tp", "4",
            "--max-model-len", "10000", "--gpu-memory-utilization", "0.8",
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
            "--quantization", "awq", "--max-num-seqs", "128",
            "--max-num-batched-tokens", "16384", "--enforce-eager", "--seed", "3",
            "--served-model-name", "a", "b",
            "--kv-offloading-size", "16", "--kv-offloading-backend", "native",
            "--kv-transfer-config",
            '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}',
        ]
    )  # fmt: skip
    assert args.model == "Qwen/Qwen2.5-72B-Instruct"
    assert (args.port, args.tensor_parallel_size, args.max_model_len) == (8100, 4, 10000)
    assert args.enable_chunked_prefill is False and args.enable_prefix_caching is False
    assert args.kv_transfer_config["kv_role"] == "kv_producer"
    assert args.served_model_name == ["a", "b"] and args.enforce_eager and args.seed == 3
    assert args.kv_offloading_size == 16.0 and args.kv_offloading_backend == "native"
    assert parse_args(["serve", "m", "--enable-chunked-prefill"]).enable_chunked_prefill is True
    assert parse_args(["serve", "m"]).enable_chunked_prefill is None


def test_legacy_api_server_form_and_underscored_flags():
    args = parse_args(["--model", "qwen2.5-7b", "--tensor_parallel_size", "2", "--port=9"])
    assert (args.model, args.tensor_parallel_size, args.port) == ("qwen2.5-7b", 2, 9)


def test_unknown_flag_and_missing_model_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "m", "--bogus-flag", "1"])
    assert exit_info.value.code == 2
    assert "error: unrecognized arguments: --bogus-flag 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--kv-transfer-config", "{not json"])


def test_visible_gpus_bound_tensor_parallelism():
    check_visible_gpus(8, {})  # unset: the modelled node's 8 GPUs
    check_visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "4,5"})
    with pytest.raises(StartupError, match=r"World size \(9\) is larger .* GPUs \(8\)"):
        check_visible_gpus(9, {})
    with pytest.raises(StartupError, match=r"World size \(4\) is larger .* GPUs \(1\) in this"):
        check_visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(StartupError, match=r"GPUs \(0\)"):
        check_visible_gpus(1, {"CUDA_VISIBLE_DEVICES": ""})


def test_kv_transfer_config_keys_follow_the_generation():
    v0 = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_rank": 1}
    assert check_kv_transfer_config(v0, "v0", {"MOONCAKE_CONFIG_PATH": "m.json"}) == "kv_consumer"
    with pytest.raises(StartupError, match="MOONCAKE_CONFIG_PATH"):
        check_kv_transfer_config(v0, "v0", {})
    with pytest.raises(StartupError, match="kv_rank\n  Unexpected keyword argument"):
        check_kv_transfer_config(v0, "v1", {})
    assert check_kv_transfer_config(None, "v1", {}) is None


def test_models_by_config_hf_id_architecture_and_directory(tmp_path, monkeypatch):
    gptq = resolve_model("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", None)
    assert (gptq.arch.name, gptq.quantization) == ("qwen2.5-7b", "gptq-int4")
    assert gptq.max_position_embeddings == 32768
    assert resolve_model("qwen2.5-72b", "awq").quantization == "awq"
    # A user's directory with a shipped model's dimensions uses the shipped architecture (and
    # its measured step times); its quantization_config sets the quantization.
    config = json.loads((ARCHITECTURES_DIR / "qwen2.5-7b" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8}
    (tmp_path / "config.json").write_text(json.dumps(config))
    local = resolve_model(str(tmp_path), None)
    assert (local.arch.name, local.quantization) == ("qwen2.5-7b", "gptq-int8")
    # Other dimensions: the directory's own architecture.
    config["num_hidden_layers"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(tmp_path), None).arch.num_layers == 7
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match=r"unknown model 'no/such-model'"):
        resolve_model("no/such-model", None)


def test_an_architecture_flag_wins_over_the_model_id(monkeypatch):
    """What a workflow deployment passes: the config's architecture, loaded as the simulator
    loads it, whatever the served id (here one in no cache, with the Hub off)."""
    from servematrix.engine.architecture import load_architecture

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = str(ROOT / "config" / "examples" / "my-model" / "config.json")
    model = resolve_model("meta-llama/Llama-3.2-1B-Instruct", None, example, "gptq-int8")
    assert model.arch == load_architecture(example)
    assert (model.quantization, model.max_position_embeddings) == ("gptq-int8", 131072)
    assert resolve_model("x/y", "awq", "qwen2.5-7b").quantization == "awq"
    with pytest.raises(ModelError, match=r"--architecture 'no/such\.json': no such file"):
        resolve_model("x/y", None, "no/such.json")


def test_a_directory_of_ones_own_gets_the_tables_of_its_own_dimensions(tmp_path):
    """aiconfigurator's tables are per operator shape: a config.json nobody shipped, of an
    architecture it knows, gets them at its own dimensions; one it does not know, the roofline."""
    config = json.loads((ARCHITECTURES_DIR / "qwen2.5-7b" / "config.json").read_text())
    config["num_hidden_layers"] = 7
    (tmp_path / "config.json").write_text(json.dumps(config))

    def setup(arch):
        settings = {"quantization": "bf16", "tensor_parallel": 1, "recipe": "v1"}
        settings |= {"chunked_prefill": None, "max_model_len": 4096}
        return build_engine_setup(arch, gpu_memory_utilization=0.9, **settings)

    mine, shipped = setup(resolve_model(str(tmp_path), None).arch), setup("qwen2.5-7b")
    assert mine.step_time_label == shipped.step_time_label
    assert mine.step_time_label.startswith("aiconfigurator") and mine.step_time_fallback is None
    decode = StepBatch((), (1024,) * 8)
    assert 0.2 < mine.step_time.step_ms(decode) / shipped.step_time.step_ms(decode) < 0.35
    config["architectures"] = ["GemmaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    gemma = setup(resolve_model(str(tmp_path), None).arch)
    assert gemma.step_time_label.startswith("roofline (aiconfigurator rejects it: ")
    assert "GemmaForCausalLM is not supported" in gemma.step_time_fallback.reason


def _v1_max_tokens(prompt: int, max_tokens: int | None, limit: int, text: bool) -> int:
    return granted_max_tokens("v1", prompt, max_tokens, limit, text)


def _v0_max_tokens(prompt: int, max_tokens: int | None, limit: int) -> int:
    return granted_max_tokens("v0", prompt, max_tokens, limit, False)


def test_v1_context_rules_clamp_or_reject_with_vllm_texts():
    assert _v1_max_tokens(60, 10, 64, False) == 4  # clamped to L - P
    assert _v1_max_tokens(3, None, 64, False) == 16
    with pytest.raises(ContextLengthError) as error:
        _v1_max_tokens(69, 5, 64, False)
    assert error.value.message == (
        "This model's maximum context length is 64 tokens. However, your prompt contains 69 "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt. (parameter=input_tokens, value=69)"
    )
    assert error.value.param == "input_tokens"
    with pytest.raises(ContextLengthError, match="contains at least 65 input tokens"):
        _v1_max_tokens(70, 5, 64, True)
    with pytest.raises(
        ContextLengthError, match=r"^max_tokens=65 cannot be greater than max_model_len"
    ):
        _v1_max_tokens(3, 65, 64, False)
    with pytest.raises(ContextLengthError, match=r"max_tokens must be at least 1, got 0\. \(param"):
        _v1_max_tokens(64, 5, 64, False)


def test_v0_context_rule_rejects_any_overflow():
    assert _v0_max_tokens(60, 4, 64) == 4
    assert _v0_max_tokens(60, None, 64) == 4
    with pytest.raises(ContextLengthError) as error:
        _v0_max_tokens(60, 10, 64)
    assert error.value.message == (
        "This model's maximum context length is 64 tokens. However, you requested 70 tokens "
        "(60 in the messages, 10 in the completion). Please reduce the length of the messages "
        "or completion."
    )


def test_wire_shapes_per_generation():
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m"}
    v1 = json.loads(wire.token_chunk("v1", head, " t0", None, None)[6:])
    assert list(v1) == ["id", "object", "created", "model", "choices", "kv_transfer_params"]
    assert "usage" not in v1 and v1["choices"][0]["token_ids"] is None
    v0 = json.loads(wire.token_chunk("v0", head, " t0", None, None)[6:])
    assert v0["usage"] is None and "token_ids" not in v0["choices"][0]
    assert wire.error_body("v0", "no", "BadRequestError", 400) == (
        '{"object":"error","message":"no","type":"BadRequestError","param":null,"code":400}'
    )
    assert json.loads(wire.error_body("v1", "no", "NotFoundError", 404, "model"))["error"] == {
        "message": "no",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert wire.system_fingerprint("v1", 4, "cfg").startswith("vllm-0.33.0-tp4-")


def _setup(recipe="v0"):
    return build_engine_setup(
        "qwen2.5-7b",
        quantization="gptq-int4",
        tensor_parallel=1,
        recipe=recipe,
        chunked_prefill=None,
        max_model_len=10000,
        gpu_memory_utilization=0.8,
        jitter_cv=0.0,
    )


def test_wall_clock_driver_reproduces_the_engine_timeline():
    """Token due times are computed, not measured: a request arriving while the engine is busy
    joins at the next step boundary, and every due time is the virtual-time engine's."""

    async def emulate() -> list[list[float]]:
        engine = WallClockEngine(_setup().instance(0))
        task = asyncio.create_task(engine.run())
        first = engine.submit(1024, 4)
        await asyncio.sleep(0.005)
        second = engine.submit(512, 3)
        await first.wait(3)
        while not (first.finished and second.finished):
            await asyncio.sleep(0.001)
        task.cancel()
        return [
            [t - first.arrival_s for t in first.due_s],
            [t - first.arrival_s for t in second.due_s],
            [second.arrival_s - first.arrival_s],
        ]

    first_due, second_due, (second_arrival,) = asyncio.run(emulate())
    # The same engine in virtual time: the second request joins after the first step.
    instance = _setup().instance(0)
    instance.add_request(Request(0, 1024, 4))
    clock, due = 0.0, {0: [], 1: []}
    joined = False
    while instance.has_work():
        if not joined and second_arrival <= clock:
            instance.add_request(Request(1, 512, 3))
            joined = True
        result = instance.step()
        clock += result.duration_s
        for request in result.emitted:
            due[request.request_id].append(clock)
    assert joined
    assert first_due == pytest.approx(due[0], abs=1e-9)
    assert second_due == pytest.approx(due[1], abs=1e-9)


def test_a_standalone_emulator_binds_loopback_unless_told():
    """Unlike `vllm serve` (every interface), as every service servematrix starts."""
    assert parse_args(["serve", "qwen2.5-7b"]).host == "127.0.0.1"
    assert parse_args(["serve", "qwen2.5-7b", "--host", "0.0.0.0"]).host == "0.0.0.0"
