"""``servematrix calibrate`` against the emulator as a real process: it writes a profile that
gives every probe it was not fitted on a prediction, and the emulator then serves from that
profile.

How close the predictions come is a timing, measured by ``benchmarks/calibration_emulator.py``
(the emulator's step times are paced by the wall clock, so this machine's load adds to them);
the tests check what was written and what it covers."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from servematrix.engine.profile import read_profile
from tests.benchmark_modules import load
from tests.conftest import SMALL_CONFIG
from tests.test_emulator_e2e import emulator
from tests.workflow_helpers import copy_workflow, snakemake

pytestmark = pytest.mark.slow

(bench,) = load("calibration_emulator")  # its held-out probes, and their medians measured
SERVED = bench.SERVED  # the emulator module's model
CALIBRATE = str(Path(sys.executable).with_name("servematrix"))


def calibrate(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CALIBRATE,
            "calibrate",
            "--url",
            url,
            "--model",
            SERVED,
            "--architecture",
            "qwen2.5-7b",
            "--quantization",
            "gptq-int4",
            "--server",
            "servematrix-emulator",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_calibrate_the_emulator_and_predict_held_out_probes(tmp_path):
    out = tmp_path / "profile.yaml"
    with emulator("--max-model-len", "4096") as (url, _):
        done = calibrate(url, out)
        assert done.returncode == 0, done.stderr
        profile = read_profile(out)
        held_out = bench.held_out_medians(url, repeats=3)
    assert profile.provenance.server_version and profile.provenance.probes >= 28
    assert profile.provenance.server_metrics  # the emulator exports vLLM's request histograms
    assert profile.residuals is not None and profile.residuals.observations >= 28
    assert all(v > 0 for v in profile.terms.vector()[:2])
    terms = np.array(profile.terms.vector())
    assert set(held_out) == {
        ("prefill 1x768", "ttft"),
        ("prefill 1x768", "itl"),
        ("prefill 1x768", "server prefill"),
        ("prefill 1x768", "server decode step"),
        ("decode 8x512", "itl"),
    }
    for key, (seconds, features) in held_out.items():
        predicted = float(np.dot(features, terms))
        assert predicted > 0 and seconds > 0, (key, predicted, seconds)
    # The emulator serves from the profile it was calibrated by.
    with emulator("--max-model-len", "4096", "--step-time-profile", str(out)) as (url, process):
        process.terminate()
        log = process.communicate(timeout=30)[0]
    assert f"step time profile {out}" in log


def test_calibrate_fails_in_one_line_without_a_server(tmp_path):
    done = calibrate("http://127.0.0.1:9", tmp_path / "p.yaml")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "servematrix calibrate: error: no OpenAI" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_study_depends_on_the_workflows_calibrate_rule(tmp_path):
    """``calibration:`` in the config: rule calibrate probes the server and writes the profile
    ``engine.profile`` names, and the study's simulated cells take their step times from it."""
    cfg = copy.deepcopy(SMALL_CONFIG)
    del cfg["slo"], cfg["capacity"]
    study = cfg["studies"]["sizes"]
    cfg["studies"] = {
        "one": {**study, "models": ["Qwen2.5-7B-Instruct-GPTQ-Int4"], "input_len": [512]}
    }
    cfg["engine"] = {"profile": "results/profiles/emulated-a100.yaml"}
    with emulator("--max-model-len", "4096") as (url, _):
        cfg["calibration"] = {
            "url": url,
            "model": SERVED,
            "architecture": "qwen2.5-7b",
            "quantization": "gptq-int4",
            "server": "servematrix-emulator",
            "repeats": 1,
        }
        workdir = copy_workflow(tmp_path / "wf", cfg)
        done = snakemake(workdir, "--cores", "1", "results/simulator/step_times/one.md")
    assert done.returncode == 0, done.stderr[-3000:]
    profile = read_profile(workdir / "results" / "profiles" / "emulated-a100.yaml")
    assert profile.provenance.method == "fitted" and profile.provenance.server.startswith(
        "servematrix-emulator at http://127.0.0.1:"
    )
    sources = (workdir / "results" / "simulator" / "step_times" / "one.md").read_text()
    assert "hardware profile results/profiles/emulated-a100.yaml" in sources
