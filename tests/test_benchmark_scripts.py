"""The benchmark scripts run: a smoke test, not a timing check (nothing here judges speed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIMULATOR_SPEED = ROOT / "benchmarks" / "simulator_speed.py"


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
