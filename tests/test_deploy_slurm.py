"""The emulator study through a real SLURM cluster: cells of one deployment in one sbatch job,
one deployment start per job, nothing left running afterwards; and, on two nodes, one
deployment spread over both."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from servematrix.deploy.supervise import port_problem
from tests import slurm_cluster
from tests.test_deploy_workflow import MODEL, _assert_clean, _config, _traces
from tests.workflow_helpers import copy_workflow

pytestmark = pytest.mark.slow


def test_study_on_slurm_groups_each_deployment_into_one_job(tmp_path):
    why = slurm_cluster.unavailable()
    if why is None and importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        why = "SLURM test needs snakemake-executor-plugin-slurm (the test extra)"
    if why is not None:
        pytest.skip(why)
    cfg = _config(["single", "chunked"], [4, 8])
    workdir = copy_workflow(tmp_path / "wf", cfg)
    with slurm_cluster.cluster(tmp_path / "slurm") as env:
        output = _run_on_slurm(workdir, env)
    submitted = [line for line in output.splitlines() if "submitted with SLURM jobid" in line]
    groups = [line for line in submitted if "group_deployment" in line]
    assert len(groups) == 2, "one sbatch job per deployment"
    started: dict[str, list[str]] = {}
    for _, meta in _traces(workdir).values():
        deployment = meta["deployment"]
        started.setdefault(deployment["fingerprint"], []).append(deployment["started"])
    assert sorted(map(sorted, started.values())) == [["fresh", "reused"]] * 2
    _assert_clean(workdir, cfg)


def test_a_deployment_over_two_slurm_nodes_serves_from_both(tmp_path):
    """A two-node cluster on this machine (nodes n1 and n2 at 127.0.0.2 and 127.0.0.3): with
    `deploy.nodes: 2` each cell's job gets both nodes; the decode instance is started on
    n2 through srun and binds n2's address, the proxy and etcd bind n1's, and the cells are
    served through them. Nothing is left in the queue."""
    why = slurm_cluster.unavailable()
    if why is None and importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        why = "SLURM test needs snakemake-executor-plugin-slurm (the test extra)"
    if why is not None:
        pytest.skip(why)
    cfg = _config(["mooncake-tcp"], [4, 8], nodes=2)
    cfg["studies"]["mooncake-v1"] = {**cfg["studies"]["mooncake"], "recipe": "v1"}
    workdir = copy_workflow(tmp_path / "wf", cfg)
    root = tmp_path / "slurm"
    with slurm_cluster.cluster(root, two_nodes=True) as env:
        # The cells only, one job at a time: jobs on the same two nodes would share the
        # deployment's ports.
        cells = [
            f"results/emulator/cells/{recipe}/{MODEL}/mooncake-tcp/qps{qps}_in128_out4_n6_s0.parquet"
            for recipe in ("v0", "v1")
            for qps in (4, 8)
        ]
        output = _run_on_slurm(workdir, env, cells, jobs=1)
        jobs = subprocess.run(
            ["scontrol", "show", "job", "--oneliner"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        ).stdout.splitlines()
    submitted = [line for line in output.splitlines() if "submitted with SLURM jobid" in line]
    assert len(submitted) == 4, "a cell spread over nodes is a job of its own"
    assert len(jobs) == 4 and all("NumNodes=2 " in job and "NodeList=n[1-2]" in job for job in jobs)
    # n2's slurmd launched one step per cell: its decode instance
    assert (root / "log" / "slurmd-n2.log").read_text().count("launch task") == 4
    n1, n2 = slurm_cluster.NODE_ADDRESSES.values()
    traces = _traces(workdir)
    assert len(traces) == 4
    for path, (table, meta) in traces.items():
        assert all(table.column("success").to_pylist()), path
        hosts = {p["name"]: p["host"] for p in meta["deployment"]["processes"]}
        expected = {"prefill": n1, "decode": n2, "proxy": n1}
        assert hosts == ({"etcd": n1} if "/v0/" in path else {}) | expected, path
        assert "127.0.0.1" not in json.dumps(meta["deployment"]["processes"]), path
        assert meta["deployment"]["base_url"].startswith(f"http://{n1}:")
    _assert_clean(workdir, cfg)
    for address in (n1, n2):
        assert all(port_problem(address, port) is None for port in cfg["ports"].values())


def _run_on_slurm(workdir, env, targets=("all",), jobs: int = 4) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            *targets,
            "--workflow-profile",
            "profiles/slurm",
            "--jobs",
            str(jobs),
            "--slurm-no-account",
            "--slurm-status-command",
            "squeue",
            "--slurm-init-seconds-before-status-checks",
            "2",
            "--default-resources",
            "slurm_partition=debug",
            "runtime=10",
            "mem_mb=1000",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    queue = subprocess.run(
        ["squeue", "-h"], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert queue.stdout.strip() == "", "no job left in the queue"
    return output
