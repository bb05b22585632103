"""Recipes reproduce the published command lines (vllm-mooncake-spec.md §2, §4) token for token."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from servematrix.deploy.recipes import plan
from servematrix.dryrun import find_cell
from servematrix.emulator import cli as emulator_cli
from servematrix.engine.scheduler import scheduler_config
from servematrix.spec import config
from servematrix.spec.matrix import ConfigError

M72 = "Qwen/Qwen2.5-72B-Instruct"
V0_SERVER = "python3 -m vllm.entrypoints.openai.api_server"
V0_KV = (
    '{"kv_connector":"MooncakeConnector","kv_role":"%s","kv_rank":%d,'
    '"kv_parallel_size":2,"kv_buffer_size":2e9}'
)

# Spec §4 A (vLLM 0.6, published studies), with M = Qwen2.5-72B-Instruct on GPUs 0-3 / 4-7.
SPEC_V0 = {
    "nondisagg": [
        f"CUDA_VISIBLE_DEVICES=0,1,2,3 {V0_SERVER} --model {M72} --port 8100 -tp 4 "
        "--max-model-len 10000 --disable-log-stats --disable-log-requests "
        "--gpu-memory-utilization 0.8",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 {V0_SERVER} --model {M72} --port 8200 -tp 4 "
        "--max-model-len 10000 --disable-log-stats --disable-log-requests "
        "--gpu-memory-utilization 0.8",
    ],
    "chunked": [
        f"CUDA_VISIBLE_DEVICES=0,1,2,3 {V0_SERVER} --model {M72} --port 8100 -tp 4 "
        "--max-model-len 10000 --disable-log-stats --disable-log-requests "
        "--enable-chunked-prefill --gpu-memory-utilization 0.8",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 {V0_SERVER} --model {M72} --port 8200 -tp 4 "
        "--max-model-len 10000 --disable-log-stats --disable-log-requests "
        "--enable-chunked-prefill --gpu-memory-utilization 0.8",
    ],
    "mooncake-rdma": [
        "etcd --listen-client-urls http://0.0.0.0:2379 --advertise-client-urls "
        "http://localhost:2379",
        "MOONCAKE_CONFIG_PATH=./mooncake.json CUDA_VISIBLE_DEVICES=0,1,2,3 "
        f"{V0_SERVER} --model {M72} --port 8100 -tp 4 --max-model-len 10000 "
        f"--gpu-memory-utilization 0.8 --kv-transfer-config '{V0_KV % ('kv_producer', 0)}'",
        "MOONCAKE_CONFIG_PATH=./mooncake.json CUDA_VISIBLE_DEVICES=4,5,6,7 "
        f"{V0_SERVER} --model {M72} --port 8200 -tp 4 --max-model-len 10000 "
        f"--gpu-memory-utilization 0.8 --kv-transfer-config '{V0_KV % ('kv_consumer', 1)}'",
    ],
}

V1_KV = (
    '{"kv_connector":"MooncakeConnector","kv_role":"%s",'
    '"kv_connector_extra_config":{"mooncake_protocol":"%s"}}'
)
V1_COMMON = "--max-model-len 10000 --gpu-memory-utilization 0.8 --no-enable-prefix-caching"
# Spec §4 B (vLLM >= 0.13 V1) and design.md "Deployments".
SPEC_V1 = {
    "nondisagg": [
        f"CUDA_VISIBLE_DEVICES=0,1,2,3 vllm serve {M72} --port 8100 -tp 4 {V1_COMMON} "
        "--no-enable-chunked-prefill",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 vllm serve {M72} --port 8200 -tp 4 {V1_COMMON} "
        "--no-enable-chunked-prefill",
    ],
    "chunked": [
        f"CUDA_VISIBLE_DEVICES=0,1,2,3 vllm serve {M72} --port 8100 -tp 4 {V1_COMMON} "
        "--enable-chunked-prefill",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 vllm serve {M72} --port 8200 -tp 4 {V1_COMMON} "
        "--enable-chunked-prefill",
    ],
    "mooncake-rdma": [
        "VLLM_MOONCAKE_BOOTSTRAP_PORT=8998 CUDA_VISIBLE_DEVICES=0,1,2,3 vllm serve "
        f"{M72} --port 8100 -tp 4 {V1_COMMON} --kv-transfer-config "
        f"'{V1_KV % ('kv_producer', 'rdma')}'",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 vllm serve {M72} --port 8200 -tp 4 {V1_COMMON} "
        f"--kv-transfer-config '{V1_KV % ('kv_consumer', 'rdma')}'",
    ],
    "mooncake-tcp": [
        "VLLM_MOONCAKE_BOOTSTRAP_PORT=8998 CUDA_VISIBLE_DEVICES=0,1,2,3 vllm serve "
        f"{M72} --port 8100 -tp 4 {V1_COMMON} --kv-transfer-config "
        f"'{V1_KV % ('kv_producer', 'tcp')}'",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 vllm serve {M72} --port 8200 -tp 4 {V1_COMMON} "
        f"--kv-transfer-config '{V1_KV % ('kv_consumer', 'tcp')}'",
    ],
}


def _split(line: str) -> tuple[dict[str, str], list[str]]:
    """A published shell line -> (environment assignments, argv)."""
    tokens = shlex.split(line)
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    return env, tokens


def _cell(default_config, model, mode, recipe, backend="vllm", **deploy):
    raw = {**default_config, "backend": backend, "deploy": deploy}
    return find_cell(config.load(raw), model, mode, recipe)


def _servers(default_config, mode, recipe, backend="vllm", **deploy):
    cell = _cell(default_config, "Qwen2.5-72B-Instruct", mode, recipe, backend, **deploy)
    return plan(cell).resolve(".").processes


@pytest.mark.parametrize(
    ("recipe", "mode"),
    [("v0", m) for m in SPEC_V0] + [("v1", m) for m in SPEC_V1],
)
def test_published_line_is_a_prefix_and_only_host_follows(default_config, recipe, mode):
    spec = (SPEC_V0 if recipe == "v0" else SPEC_V1)[mode]
    # host 0.0.0.0 is what the published lines bind (vLLM's default; etcd's explicit URL).
    processes = _servers(default_config, mode, recipe, host="0.0.0.0")
    servers = [p for p in processes if p.name != "proxy"]
    assert len(servers) == len(spec)
    for process, line in zip(servers, spec, strict=True):
        env, argv = _split(line)
        assert dict(process.env) == env, process.name
        assert list(process.env) == list(env), "display order of the environment"
        assert list(process.argv[: len(argv)]) == argv, process.name
        rest = list(process.argv[len(argv) :])
        if process.name == "etcd":
            assert rest[:4] == ["--name", "servematrix", "--data-dir", "./etcd-data"]
        else:
            assert rest == ["--host", "0.0.0.0"]


def test_services_bind_loopback_by_default(default_config):
    for process in _servers(default_config, "mooncake-tcp", "v0"):
        joined = " ".join(process.argv)
        assert "0.0.0.0" not in joined
        assert "127.0.0.1" in joined, process.name


def test_proxy_and_entry_port(default_config):
    rr = _cell(default_config, "Qwen2.5-72B-Instruct", "nondisagg", "v0")
    deployment = plan(rr)
    proxy = deployment.processes[-1]
    assert proxy.argv == (
        "python3",
        "-m",
        "servematrix.proxy",
        "round-robin",
        "--upstream",
        "http://127.0.0.1:8100",
        "--upstream",
        "http://127.0.0.1:8200",
        "--port",
        "8090",
        "--host",
        "127.0.0.1",
    )
    assert deployment.base_url == "http://127.0.0.1:8090/v1"
    v1 = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "mooncake-rdma", "v1"))
    assert v1.processes[-1].argv[3:8] == (
        "disagg-v1",
        "--prefill",
        "http://127.0.0.1:8100",
        "8998",
        "--decode",
    )
    assert [p.name for p in v1.processes] == ["prefill", "decode", "proxy"], "v1 needs no etcd"
    v0 = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "mooncake-tcp", "v0"))
    assert [p.name for p in v0.processes] == ["etcd", "prefill", "decode", "proxy"]
    assert v0.processes[-1].argv[3] == "disagg-v0"


def test_single_mode_is_one_instance_on_8997(default_config):
    deployment = plan(_cell(default_config, "Qwen2.5-14B-Instruct", "single", "v0"))
    (server,) = deployment.processes
    assert server.port == 8997
    assert server.env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert deployment.base_url == "http://127.0.0.1:8997/v1"
    assert server.health.url == "http://127.0.0.1:8997/health"


SINGLE_CHUNKING_FLAGS = {
    # v0 (vLLM 0.6) chunks only when asked at max_model_len 10000: plain passes no flag, as the
    # published nondisagg line (0.6's parser has no --no- form).
    ("v0", "single"): [],
    ("v0", "single-plain"): [],
    ("v0", "single-chunked"): ["--enable-chunked-prefill"],
    ("v1", "single"): [],  # V1 chunks by default
    ("v1", "single-plain"): ["--no-enable-chunked-prefill"],
    ("v1", "single-chunked"): ["--enable-chunked-prefill"],
}


@pytest.mark.parametrize(("recipe", "mode"), list(SINGLE_CHUNKING_FLAGS))
def test_single_modes_say_on_the_command_line_whether_prefill_is_chunked(
    default_config, recipe, mode
):
    """One instance on 8997; the chunking flag is the only difference between the three
    single modes, and the emulator, reading the line as vLLM would, schedules as the cell says."""
    cell = _cell(default_config, "Qwen2.5-14B-Instruct", mode, recipe)
    (server,) = plan(cell).processes
    base = plan(_cell(default_config, "Qwen2.5-14B-Instruct", "single", recipe)).processes[0]
    flags = [a for a in server.argv if "chunked-prefill" in a]
    assert flags == SINGLE_CHUNKING_FLAGS[(recipe, mode)]
    assert [a for a in server.argv if a not in flags] == list(base.argv)
    assert (server.port, server.env) == (8997, {"CUDA_VISIBLE_DEVICES": "0"})
    emulated = plan(_cell(default_config, "Qwen2.5-14B-Instruct", mode, recipe, "emulator"))
    args = emulator_cli.parse_args(list(emulated.processes[0].argv[1:]))
    scheduler = scheduler_config(recipe, args.enable_chunked_prefill, 10_000, "A100-SXM4-80GB")
    chunked = {"single": recipe == "v1", "single-plain": False, "single-chunked": True}[mode]
    assert scheduler.chunked_prefill is cell.chunked_prefill is chunked


def test_mooncake_json_per_deployment(default_config):
    deployment = plan(
        _cell(default_config, "Qwen2.5-72B-Instruct", "mooncake-rdma", "v0", rdma_device="mlx5_0")
    ).resolve("/run/x")
    document = json.loads(deployment.files["mooncake.json"])
    assert document == {
        "prefill_url": "127.0.0.1:13003",
        "decode_url": "127.0.0.1:13103",
        "metadata_server": "etcd://127.0.0.1:2379",
        "protocol": "rdma",
        "device_name": "mlx5_0",
    }
    prefill = deployment.processes[1]
    assert prefill.env["MOONCAKE_CONFIG_PATH"] == "/run/x/mooncake.json"
    # transfer engine base..base+3 and its ZMQ sockets are checked free before start
    assert {13003, 13006, 13012, 13019} <= set(prefill.extra_ports)
    tcp = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "mooncake-tcp", "v0"))
    assert json.loads(tcp.files["mooncake.json"])["device_name"] == ""


def test_emulator_replaces_only_the_executable(default_config):
    for recipe, mode in [("v0", "chunked"), ("v0", "mooncake-rdma"), ("v1", "mooncake-tcp")]:
        real = _servers(default_config, mode, recipe)
        emulated = _servers(default_config, mode, recipe, backend="emulator")
        for a, b in zip(real, emulated, strict=True):
            assert a.env == b.env and a.port == b.port and a.extra_ports == b.extra_ports
            if a.name in ("etcd", "proxy"):
                assert a.argv == b.argv
                continue
            skip = 2 if recipe == "v1" else 3  # `vllm serve` / `python3 -m vllm...api_server`
            assert b.argv[:2] == ("servematrix-emulator", "serve")
            tail = b.argv[2 : 2 + len(a.argv) - skip]
            assert tail == a.argv[skip:]
            extra = b.argv[2 + len(a.argv) - skip :]
            assert extra == (
                *("--gpu", "A100-SXM4-80GB", "--recipe", recipe, "--seed", "0"),
                *("--architecture", "qwen2.5-72b", "--modelled-quantization", "bf16"),
            )


def test_fingerprint_follows_the_command_lines(default_config):
    a = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "chunked", "v0"))
    b = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "chunked", "v0"))
    c = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "nondisagg", "v0"))
    d = plan(_cell(default_config, "Qwen2.5-72B-Instruct", "chunked", "v0", host="0.0.0.0"))
    assert a.fingerprint == b.fingerprint
    assert len({a.fingerprint, c.fingerprint, d.fingerprint}) == 3


def test_cells_of_one_deployment_share_its_fingerprint(default_config):
    raw = {**default_config, "backend": "emulator"}
    cells = [c for c in config.load(raw).studies["mooncake"].cells]
    groups: dict[str, set[tuple[str, str]]] = {}
    for cell in cells:
        groups.setdefault(plan(cell).fingerprint, set()).add((cell.model.name, cell.mode.name))
    assert len(groups) == 8  # 2 models x 4 modes, each over 4 QPS values
    assert all(len(v) == 1 for v in groups.values())


def test_dry_run_cli_prints_copy_paste_commands(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "servematrix.cli",
            "deploy",
            "--dry-run",
            "Qwen2.5-72B-Instruct",
            "mooncake-rdma",
            "--recipe",
            "v0",
        ],
        capture_output=True,
        text=True,
        cwd=config.SCHEMA_PATH.parents[1],
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    commands = [line for line in lines if line.endswith(" &") or "servematrix.proxy" in line]
    assert [shlex.split(c)[0] for c in commands] == [
        "etcd",
        "MOONCAKE_CONFIG_PATH=./mooncake.json",
        "MOONCAKE_CONFIG_PATH=./mooncake.json",
        "python3",
    ]
    assert "cat > mooncake.json <<'EOF'" in lines
    # the kv config survives shell quoting as one argument
    kv = shlex.split(commands[1].rstrip(" &"))
    assert json.loads(kv[kv.index("--kv-transfer-config") + 1])["kv_rank"] == 0


def test_dry_run_names_an_unknown_model():
    result = subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "deploy", "--dry-run", "nope", "single"],
        capture_output=True,
        text=True,
        cwd=config.SCHEMA_PATH.parents[1],
    )
    assert result.returncode == 1
    assert "unknown model 'nope'" in result.stderr


def test_dry_run_does_not_override_a_models_forced_recipe(default_config):
    """Command R7B forces v1 (vLLM 0.6 cannot run it): --recipe v0 is an error, not a v0 plan."""
    cfg = config.load(default_config)
    with pytest.raises(ConfigError) as caught:
        find_cell(cfg, "c4ai-command-r7b-12-2024", "single", "v0")
    assert str(caught.value) == (
        "config error at --recipe: model c4ai-command-r7b-12-2024 forces recipe v1 in every "
        "study (models.c4ai-command-r7b-12-2024.recipe), so it never runs on v0: drop --recipe "
        "or pass --recipe v1"
    )
    assert find_cell(cfg, "c4ai-command-r7b-12-2024", "single", None).recipe == "v1"
    assert find_cell(cfg, "c4ai-command-r7b-12-2024", "single", "v1").recipe == "v1"


def test_engine_kv_settings_reach_the_command_lines(default_config):
    raw = {
        **default_config,
        "backend": "emulator",
        "engine": {"kv_buffer_size": 4e9, "kv_link": {"nic_gb_s": 12.5}},
    }
    cell = find_cell(config.load(raw), "Qwen2.5-72B-Instruct", "mooncake-rdma", "v0")
    prefill = plan(cell).processes[1]
    kv = prefill.argv[prefill.argv.index("--kv-transfer-config") + 1]
    assert kv.endswith('"kv_buffer_size":4e9}')
    assert json.loads(prefill.env["SERVEMATRIX_EMULATOR_KV_LINK"]) == {"nic_gb_s": 12.5}
    assert "SERVEMATRIX_EMULATOR_KV_LINK" not in plan(cell, "vllm").processes[1].env


def test_max_num_seqs_reaches_every_server_and_the_emulator(default_config):
    raw = {**default_config, "defaults": {**default_config["defaults"], "max_num_seqs": 48}}
    for backend in ("vllm", "emulator"):
        cell = find_cell(config.load({**raw, "backend": backend}), "Qwen2.5-72B-Instruct",
                         "mooncake-rdma", "v1")  # fmt: skip
        servers = [p for p in plan(cell).processes if p.name != "proxy"]
        for server in servers:
            at = server.argv.index("--max-num-seqs")
            assert server.argv[at + 1] == "48", (backend, server.name)
    default = _cell(default_config, "Qwen2.5-72B-Instruct", "single", "v1")
    assert "--max-num-seqs" not in plan(default).processes[0].argv
    assert "max_num_seqs" not in default.to_dict()["serving"]


def test_kv_offloading_reaches_v1_servers_and_is_refused_where_it_is_not_modelled(default_config):
    def study(recipe: str, mode: str) -> dict:
        workload = {"kv_offloading_size": 16}
        return {"recipe": recipe, "models": ["Qwen2.5-72B-Instruct"], "modes": [mode],
                "qps": [2], "input_len": [1024], "workload": workload}  # fmt: skip

    raw = {**default_config, "studies": {"offload": study("v1", "nondisagg")}}
    for backend in ("vllm", "emulator"):
        cell = find_cell(config.load({**raw, "backend": backend}), "Qwen2.5-72B-Instruct",
                         "nondisagg", "v1")  # fmt: skip
        for server in [p for p in plan(cell).processes if p.name != "proxy"]:
            at = server.argv.index("--kv-offloading-size")
            assert server.argv[at : at + 4] == ("--kv-offloading-size", "16",
                                                "--kv-offloading-backend", "native")  # fmt: skip
    refused = (("v0", "nondisagg", "needs recipe v1"), ("v1", "mooncake-rdma", "disaggregated"))
    for recipe, mode, message in refused:
        with pytest.raises(ConfigError) as error:
            config.load({**raw, "studies": {"offload": study(recipe, mode)}})
        assert error.value.key_path == "studies.offload.workload.kv_offloading_size"
        assert message in str(error.value)
