"""CPU nodes and the configurable server command: recipes, pins, locks, memory, checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from servematrix.backends import emulator
from servematrix.deploy import gpulock, memory
from servematrix.deploy.recipes import cpu_bind, plan
from servematrix.deploy.supervise import DeployError
from servematrix.spec import config
from servematrix.spec.matrix import ConfigError
from servematrix.vllmcpu.tiny_model import VOCAB_SIZE
from servematrix.workflow import check_config

EXAMPLE = config.SCHEMA_PATH.parent / "examples" / "vllm-cpu.yaml"


# The example's model is built by `make test-vllm` (servematrix.vllmcpu, with torch); these
# tests need only its config.json, the tiny Qwen2's shape, written here.
TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
_ARCHITECTURE: list[str] = []


@pytest.fixture(autouse=True, scope="module")
def tiny_architecture(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    (directory / "config.json").write_text(json.dumps(TINY_QWEN2))
    _ARCHITECTURE[:] = [str(directory)]


def _raw(**changes) -> dict:
    raw = config.read_yaml(EXAMPLE)
    raw["models"]["tiny-qwen2"]["architecture"] = _ARCHITECTURE[0]
    raw["deploy"]["server_command"] = [sys.executable, "-m", "json.tool"]
    for key, value in changes.items():
        raw[key] = value
    return raw


def _cell(raw: dict, mode: str):
    return next(c for c in config.load(raw).all_cells() if c.mode.name == mode)


def test_cpu_node_pins_cores_and_sizes_the_kv_cache_from_the_config():
    raw = _raw()
    raw["deploy"]["server_command"] = [
        "~/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
    ]
    nondisagg = plan(_cell(raw, "nondisagg"))
    prefill, decode, proxy = nondisagg.processes
    assert prefill.env == {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert decode.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in prefill.env
    # The module form takes the model as --model; ~ is expanded.
    assert prefill.argv[:5] == (
        os.path.expanduser("~/venv/bin/python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        os.path.expanduser("~/.cache/servematrix/models/tiny-qwen2"),
    )
    assert (prefill.gpus, decode.gpus) == ((0,), (1,))
    assert proxy.argv[3] == "round-robin"


def test_server_command_forms_and_the_recipes_defaults():
    raw = _raw()
    raw["deploy"]["server_command"] = ["/opt/vllm/bin/vllm", "serve"]
    argv = plan(_cell(raw, "single")).processes[0].argv
    assert argv[:3] == (
        "/opt/vllm/bin/vllm",
        "serve",
        os.path.expanduser(raw["models"]["tiny-qwen2"]["hf_id"]),
    )
    del raw["deploy"]["server_command"]
    assert plan(_cell(raw, "single")).processes[0].argv[:2] == ("vllm", "serve")
    raw["studies"]["vllm-cpu"]["recipe"] = "v0"
    argv = plan(_cell(raw, "single")).processes[0].argv
    assert argv[:5] == ("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", argv[4])
    # The emulator keeps its own executable and form, whatever the command.
    raw["deploy"]["server_command"] = ["/x/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert plan(_cell(raw, "single"), "emulator").processes[0].argv[:3] == (
        "servematrix-emulator",
        "serve",
        "--model",
    )


def test_gpu_node_is_unchanged_by_the_new_settings():
    raw = _raw(node={})
    raw["deploy"].pop("server_command")
    cell = _cell(raw, "single")
    assert "node" not in cell.deploy  # GPU cells keep their parameters
    assert plan(cell).processes[0].env == {"CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.parametrize(
    ("cores", "tp", "expected"),
    [
        ((0,), 1, "0"),
        ((0, 1, 2, 3), 1, "0-3"),
        ((0, 1, 2, 3), 2, "0-1|2-3"),
        ((5, 1, 2), 1, "1-2,5"),
    ],
)
def test_cpu_bind_format(cores, tp, expected):
    assert cpu_bind(cores, tp) == expected


def test_core_pins_are_checked_against_the_allowed_cores():
    gpulock.check_cores_allowed("m", (0, 1), allowed={0, 1})
    with pytest.raises(DeployError, match=r"pins CPU core\(s\) \[7\] but this process may run"):
        gpulock.check_cores_allowed("m", (0, 7), allowed={0, 1})
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(DeployError, match=rf"\[{beyond}\]"):
        gpulock.check_cores_allowed("m", (beyond,))


def test_core_locks_are_taken_like_gpu_locks(tmp_path):
    with gpulock.GpuLocks((1, 0), tmp_path, 5, "cell a", kind="cpu"):
        assert sorted(p.name for p in tmp_path.glob("*.lock")) == ["cpu0.lock", "cpu1.lock"]
        holder = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from servematrix.deploy.gpulock import GpuLocks\n"
                "try:\n"
                f"    GpuLocks((1,), {str(tmp_path)!r}, 0.3, 'cell b', kind='cpu').__enter__()\n"
                "except Exception as e: print(e)",
            ],
            capture_output=True,
            text=True,
        )
        assert holder.stdout.startswith("CPU core 1 is locked by pid "), holder.stdout
        # GPU 1 is another lock.
        with gpulock.GpuLocks((1,), tmp_path, 0.3, "cell c"):
            pass


def test_a_bad_server_command_is_one_config_line_before_any_job(tmp_path):
    raw = _raw()
    check_config(raw)  # this Python with -m json.tool: fine
    raw["deploy"]["server_command"] = [str(tmp_path / "nope" / "python"), "-m", "vllm"]
    with pytest.raises(
        ConfigError, match=r"deploy.server_command: .*nope/python is not an executable"
    ):
        check_config(raw)
    raw["deploy"]["server_command"] = ["no-such-vllm-binary", "serve"]
    with pytest.raises(ConfigError, match="executable 'no-such-vllm-binary' not found"):
        check_config(raw)
    raw["deploy"]["server_command"] = [sys.executable, "-m", "no_such_package.api_server"]
    with pytest.raises(ConfigError, match="cannot import 'no_such_package'"):
        check_config(raw)
    emulator.preflight(config.load({**raw, "backend": "emulator"}))  # only vllm starts it


def test_check_cli_names_a_bad_server_command(tmp_path):
    raw = _raw()
    raw["deploy"]["server_command"] = ["/nonexistent/bin/python", "-m", "vllm"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "check", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "servematrix: config error at deploy.server_command: /nonexistent/bin/python is not an "
        "executable file"
    ]


def test_tree_rss_counts_every_process_of_a_session():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'x = bytearray(200 << 20); import time; time.sleep(30)']); time.sleep(30)",
        ],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        rss = 0.0
        while time.monotonic() < deadline and rss < 200:
            rss = memory.tree_rss_mib(child.pid)
            time.sleep(0.2)
        assert 200 <= rss < 400  # the grandchild's 200 MiB and two interpreters
    finally:
        os.killpg(child.pid, 9)
        child.wait()
    assert memory.process_groups({"groups": [["single", 12], ["proxy", 13]]}) == {
        "single": 12,
        "proxy": 13,
    }


@pytest.mark.parametrize(
    ("log", "reason"),
    [
        (
            "usage: api_server.py [-h] ...\n"
            "api_server.py: error: unrecognized arguments: --bogus-flag\n",
            "api_server.py: error: unrecognized arguments: --bogus-flag",
        ),
        (
            "(APIServer pid=1) INFO 12-01 20:35:21 [utils.py:1] starting\n"
            "Traceback (most recent call last):\n"
            '  File "x.py", line 1, in <module>\n'
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
            "  Value error, User-specified max_model_len (99999) is greater than the derived "
            "max_model_len (4096). [type=value_error]\n"
            "    For further information visit https://errors.pydantic.dev/2.12/v/value_error\n",
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
            "Value error, User-specified max_model_len (99999) is greater than the derived "
            "max_model_len (4096). [type=value_error]",
        ),
        ("INFO ready\nINFO shutting down\n", None),
    ],
)
def test_the_servers_own_error_is_found_in_its_log(tmp_path, log, reason):
    from servematrix.deploy.supervise import server_error

    path = tmp_path / "single.log"
    path.write_text("=== earlier run\nValueError: old: not this one\n")
    start = path.stat().st_size
    with open(path, "a") as handle:
        handle.write(log)
    assert server_error(path, start) == reason
