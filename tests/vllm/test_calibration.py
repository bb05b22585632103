"""``servematrix calibrate --gpu cpu`` on real vLLM, and the simulator's prediction from that
profile of a cell the fit never saw (through ``benchmarks/calibration_cpu.py``'s own steps)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from servematrix.deploy import cpupins
from servematrix.engine.profile import read_profile
from tests.benchmark_modules import load
from tests.vllm.conftest import MARK, kill_marked

bench, processes = load("calibration_cpu", "calibration_cpu_processes")


def test_a_profile_fitted_on_vllm_cpu_predicts_a_held_out_cell(vllm_cpu, tmp_path, monkeypatch):
    """One run of each probe, then Poisson arrivals at 4 req/s of 256-token prompts and 24
    output tokens (no probe's shape), measured and simulated from the profile. How close the
    two come is a timing on shared cores, so ``benchmarks/calibration_cpu.py`` prints it; the
    test checks that the fit named this CPU host, that it measured the API server's CPU (vLLM's
    ``/metrics`` gives its process's CPU and the engine's steps), that the deployment moved
    the API server off the engine's core (``node.api_server_cores``) and the profile records
    it, and that both sides served every request."""
    monkeypatch.chdir(tmp_path)
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = bench.FIT_MODEL
    held = bench.HeldOut(model, "single", 1.0, input_len=256, output_len=24)
    raw = bench.raw_config("external", model, "single", [held], rate=4.0)
    profile = tmp_path / "profile.yaml"
    try:
        with bench.served(model, "single", tmp_path) as plan:
            cores = {  # every thread of every process of the instance
                (pid, cpupins.process_name(pid)): {
                    frozenset(os.sched_getaffinity(int(t.name)))
                    for t in Path(f"/proc/{pid}/task").iterdir()
                }
                for pid in processes.vllm_pids(plan.base_url)
            }
            bench.calibrate(plan.base_url, model, profile, repeats=1)
            (actual,) = bench.run_all(bench.measured(raw, plan.base_url))
    finally:
        left = kill_marked(mark)
    assert left == []
    fitted = read_profile(profile)
    assert fitted.provenance.gpu == "cpu" and fitted.provenance.host
    assert fitted.api_server_cpu is not None
    # The deployment put the API server on the client's core (node.api_server_cores) and the
    # engine core and worker alone on theirs, and the profile says so (the simulator then runs
    # the API server beside the engine).
    assert fitted.provenance.api_server_apart
    names = sorted(name for _, name in cores)  # the API server and its resource tracker, too
    assert names[:2] == ["VLLM::EngineCor", "VLLM::Worker"] and len(names) > 2, names
    for (pid, name), threads in cores.items():
        core = bench.VLLM_CORE if name.startswith("VLLM::") else bench.CLIENT_CORE
        assert threads == {frozenset({core})}, (pid, name, threads)
    (predicted,) = bench.run_all(bench.simulated(raw, profile))
    assert actual.failed == predicted.failed == 0, (predicted, actual)
    assert predicted.completed == actual.completed > 0, (predicted, actual)
    assert predicted.mean_e2el_ms > 0 and actual.mean_e2el_ms > 0, (predicted, actual)
