"""The emulator study through a real one-node SLURM cluster: cells of one deployment in one
sbatch job, one deployment start per job, nothing left running afterwards."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests import slurm_cluster
from tests.test_deploy_workflow import _assert_clean, _config, _traces
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
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "snakemake",
                "all",
                "--workflow-profile",
                "profiles/slurm",
                "--jobs",
                "4",
                # a test cluster: no accounting database, one partition
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
    submitted = [line for line in output.splitlines() if "submitted with SLURM jobid" in line]
    groups = [line for line in submitted if "group_deployment" in line]
    assert len(groups) == 2, "one sbatch job per deployment"
    started: dict[str, list[str]] = {}
    for _, meta in _traces(workdir).values():
        deployment = meta["deployment"]
        started.setdefault(deployment["fingerprint"], []).append(deployment["started"])
    assert sorted(map(sorted, started.values())) == [["fresh", "reused"]] * 2
    _assert_clean(workdir, cfg)
