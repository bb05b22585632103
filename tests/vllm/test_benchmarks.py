"""The benchmark scripts that drive real vLLM run and clean up after themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.vllm.conftest import MARK, marked_env, marked_processes

ROOT = Path(__file__).resolve().parents[2]
ARGS = ("--requests", "40", "--repeat", "1")


def test_real_vllm_chat_prints_both_kinds_and_stops_vllm():
    env = marked_env()
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_vllm_chat.py"), *ARGS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    assert set(rows) == {"completions", "chat"}, result.stdout
    assert all(float(row[3]) > 0 for row in rows.values()), result.stdout
    assert marked_processes(env[MARK]) == []
