"""A deployment over several nodes (``deploy.nodes``): each process binds its node's address
and every peer is named by its node's address, never 127.0.0.1. The rendering is checked on
the published modes and an xPyD topology; then real emulator deployments (the v0 recipe with
its etcd and Mooncake transfer engines, and a v1 2P1D topology) serve a cell on two
loopback "nodes", 127.0.0.2 and 127.0.0.3, while every listening socket is checked."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from servematrix.backends.cell import run_cell
from servematrix.deploy import nodes, warm
from servematrix.deploy.nodes import NodeError
from servematrix.deploy.processes import Plan
from servematrix.deploy.recipes import plan
from servematrix.deploy.supervise import port_problem
from servematrix.dryrun import find_cell
from servematrix.spec import config, trace
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload, topology_mode
from servematrix.spec.topology import parse

NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"
LOOPBACK = "127.0.0.1"


def _text(deployment: Plan) -> str:
    """Everything a deployment's processes are told: argv, environment, health and base
    URLs, and the files they read."""
    return json.dumps(deployment.to_dict())


def _proxy_urls(argv: tuple[str, ...], flag: str) -> list[str]:
    return [argv[i + 1] for i, token in enumerate(argv) if token == flag]


def test_v0_mooncake_over_two_nodes_names_every_peer_by_its_node(default_config):
    raw = {**default_config, "backend": "vllm", "deploy": {"nodes": [NODE_A, NODE_B]}}
    cell = find_cell(config.load(raw), "Qwen2.5-72B-Instruct", "mooncake-tcp", "v0")
    deployment = plan(cell).resolve(".")
    etcd, prefill, decode, proxy = deployment.processes
    assert (etcd.host, prefill.host, decode.host, proxy.host) == (NODE_A, NODE_A, NODE_B, NODE_A)
    assert prefill.argv[-2:] == ("--host", NODE_A)
    assert decode.argv[-2:] == ("--host", NODE_B)
    # what vLLM (and the emulator) advertise to peers, instead of guessing an address
    assert (prefill.env["VLLM_HOST_IP"], decode.env["VLLM_HOST_IP"]) == (NODE_A, NODE_B)
    assert f"servematrix=http://{NODE_A}:2380" in etcd.argv
    assert _proxy_urls(proxy.argv, "--prefill") == [f"http://{NODE_A}:8100"]
    assert _proxy_urls(proxy.argv, "--decode") == [f"http://{NODE_B}:8200"]
    mooncake = json.loads(deployment.files["mooncake.json"])
    assert mooncake["prefill_url"] == f"{NODE_A}:13003"
    assert mooncake["decode_url"] == f"{NODE_B}:13103"
    assert mooncake["metadata_server"] == f"etcd://{NODE_A}:2379"
    assert deployment.base_url == f"http://{NODE_A}:8090/v1"
    assert LOOPBACK not in _text(deployment) and "localhost" not in _text(deployment)


def test_xpyd_instances_take_the_nodes_in_turn_and_bind_every_interface_if_asked():
    cfg = config.load_file(Path("config/examples/xpyd.yaml"))
    deploy = config.deploy_settings(
        {**cfg.raw, "backend": "vllm", "deploy": {"nodes": [NODE_A, NODE_B], "host": "0.0.0.0"}}
    )
    cell = next(c for c in cfg.all_cells() if c.mode.name == "2P(TP2)+1D(TP4)")
    deployment = plan(Cell(**{**cell.__dict__, "backend": "vllm", "deploy": deploy}))
    by_name = {p.name: p for p in deployment.processes}
    assert [by_name[n].node for n in ("prefill0", "prefill1", "decode0", "proxy")] == [0, 1, 0, 0]
    assert all(p.argv[p.argv.index("--host") + 1] == "0.0.0.0" for p in deployment.processes)
    advertised = [by_name[n].env["VLLM_HOST_IP"] for n in ("prefill0", "prefill1", "decode0")]
    assert advertised == [NODE_A, NODE_B, NODE_A]
    proxy = by_name["proxy"].argv
    assert _proxy_urls(proxy, "--prefill") == [f"http://{NODE_A}:8100", f"http://{NODE_B}:8101"]
    assert _proxy_urls(proxy, "--decode") == [f"http://{NODE_A}:8200"]
    assert LOOPBACK not in _text(deployment)


def test_a_count_of_slurm_nodes_is_filled_in_the_job_and_keeps_the_fingerprint(
    default_config, monkeypatch
):
    raw = {**default_config, "backend": "vllm", "deploy": {"nodes": 2}}
    cell = find_cell(config.load(raw), "Qwen2.5-72B-Instruct", "mooncake-tcp", "v1")
    deployment = plan(cell)
    assert "@NODE1@" in _text(deployment)
    filled = deployment.filled({"@NODE0@": NODE_A, "@NODE1@": NODE_B}, ("n1", "n2"))
    assert filled.fingerprint == deployment.fingerprint
    assert "@NODE" not in _text(filled) and LOOPBACK not in _text(filled)
    prefill, decode = filled.processes[:2]
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    assert nodes.launcher(filled, prefill) == []
    assert nodes.launcher(filled, decode)[:2] == ["srun", "--overlap"]
    assert "--nodelist=n2" in nodes.launcher(filled, decode)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(NodeError, match=r"^deploy.nodes: 2 places .* not a SLURM job"):
        nodes.on_allocation(deployment, cell.deploy)


MODEL = ModelSpec(
    "Qwen2.5-7B-Instruct-GPTQ-Int4",
    "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "qwen2.5-7b",
    "gptq-int4",
    1,
    ((0, 1, 2),),
)
PORT_NAMES = ("proxy", "prefill", "decode", "single", "etcd", "bootstrap", "mooncake")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _cell(recipe: str, mode: str, state_dir: Path) -> Cell:
    """An emulator cell on the two loopback nodes, on ports free on both."""
    spec = MODES.get(mode) or topology_mode(parse(mode), "tcp")
    workload = Workload(math.inf, 256, 8, 6, 0, "random", 1.0, 0)
    for _ in range(50):
        cell = Cell(
            backend="emulator",
            recipe=recipe,
            model=MODEL,
            mode=spec,
            workload=workload,
            serving=Serving(4096, 0.8),
            engine={"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0},
            deploy={
                "nodes": [NODE_A, NODE_B],
                "ports": {name: _free_port() for name in PORT_NAMES},
                "state_dir": str(state_dir),
                "warm": True,
                "startup_timeout_s": 120,
                "stop_timeout_s": 10,
            },
        )
        ports = [port for process in plan(cell).processes for port in process.ports]
        taken = any(port_problem(node, p) for p in ports for node in (NODE_A, NODE_B))
        if len(set(ports)) == len(ports) and not taken:
            return cell
    raise RuntimeError("no free set of ports on both loopback nodes")


def _listening() -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket in this network namespace."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state != "0A":  # LISTEN
            continue
        address, port = local.split(":")
        octets = [str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)]
        found.add((".".join(octets), int(port, 16)))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "mode"), [("v0", "mooncake-tcp"), ("v1", "2P(TP1)+1D(TP1)")])
def test_real_deployment_on_two_loopback_nodes_binds_and_serves_there(
    tmp_path, monkeypatch, recipe, mode
):
    """The cell is served through the proxy on node A by instances on both nodes (v0: KV
    over the transfer engines, registered in etcd on node A); while the deployment is up,
    every port of every process listens on its node's address and on no other."""
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "state"
    cell = _cell(recipe, mode, state)
    path = tmp_path / "cell.parquet"
    try:
        run_cell(cell, path)
        listening = _listening()
        metadata = json.loads(pq.read_schema(path).metadata[trace.METADATA_KEY])
    finally:
        warm.stop_all(state)
    rows = trace.read(path).to_pylist()
    assert len(rows) == 6 and all(r["success"] for r in rows)
    deployment = metadata["deployment"]
    assert LOOPBACK not in json.dumps(deployment["processes"]) + json.dumps(deployment["files"])
    assert deployment["base_url"] == f"http://{NODE_A}:{cell.deploy['ports']['proxy']}/v1"
    expected = {}
    for process in deployment["processes"]:
        for port in [process["port"], *process["extra_ports"]]:
            expected[port] = process["host"]
        # Its own port; the others (transfer engine, ZMQ, bootstrap) as far as it binds them.
        assert (process["host"], process["port"]) in listening, process["name"]
    for port, host in expected.items():
        bound = {address for address, p in listening if p == port}
        assert bound <= {host}, f"port {port}: bound on {bound}, expected {host}"
    hosts = {p["name"]: p["host"] for p in deployment["processes"]}
    if recipe == "v0":
        assert hosts == {"etcd": NODE_A, "prefill": NODE_A, "decode": NODE_B, "proxy": NODE_A}
        etcd_peer = deployment["processes"][0]["extra_ports"][0]
        assert (NODE_A, etcd_peer) in listening
        transfer_engine = cell.deploy["ports"]["mooncake"]  # prefill_url's port
        assert (NODE_A, transfer_engine) in listening
        log = Path("results/emulator/logs/deployments")
        prefill_logs = list(log.rglob("prefill.log"))
        assert (
            prefill_logs and f"registered at etcd http://{NODE_A}:" in prefill_logs[0].read_text()
        )
    else:
        assert hosts == {"prefill0": NODE_A, "prefill1": NODE_B, "decode0": NODE_A, "proxy": NODE_A}
    assert not any(port_problem(host, port) for port, host in expected.items()), "all stopped"
