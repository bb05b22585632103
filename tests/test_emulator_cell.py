"""The ``emulator`` backend's cell end to end: a real deployment of emulator processes, the load
generator, and the trace it writes. What the emulator knows beyond a vLLM server lands in the
trace: each request's preemptions, and the exact peak of KV blocks in use; what it cannot serve
becomes a failed row with vLLM's answer, and the cell completes."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from servematrix.backends.cell import run_cell
from servematrix.backends.emulator import modelled_layout
from servematrix.deploy import warm
from servematrix.deploy.recipes import plan
from servematrix.deploy.supervise import port_problem
from servematrix.results import aggregate
from servematrix.spec import trace
from servematrix.spec.matrix import MODES, Cell, ModelSpec, Serving, Workload

pytestmark = pytest.mark.slow

MODEL = ModelSpec(
    "Qwen2.5-7B-Instruct-GPTQ-Int4",
    "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "qwen2.5-7b",
    "gptq-int4",
    1,
    ((0,), (4,)),
)
PORT_NAMES = ("proxy", "prefill", "decode", "single", "etcd", "bootstrap", "mooncake")
SMALL_POOL_UTILIZATION = {"v0": 0.13736, "v1": 0.14368}
"""Where each recipe's plan leaves 814 KV blocks of 16 tokens on the modelled A100 with a
32768-token budget (v1 counts the CUDA graphs, v0 does not: 0.5 GiB apart)."""


def small_pool(recipe: str) -> Serving:
    """814 blocks; max_model_len is the whole pool."""
    return Serving(13024, SMALL_POOL_UTILIZATION[recipe], 32768)


LARGE_POOL = Serving(4096, 0.8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cell(
    workload: Workload,
    state_dir: Path,
    *,
    recipe: str = "v1",
    mode: str = "single",
    serving: Serving = LARGE_POOL,
    warm_deployment: bool = False,
) -> Cell:
    """An emulator cell whose deployment binds only free, distinct loopback ports."""
    for _ in range(50):
        cell = Cell(
            backend="emulator",
            recipe=recipe,
            model=MODEL,
            mode=MODES[mode],
            workload=workload,
            serving=serving,
            engine={"gpu": "A100-SXM4-80GB", "jitter_cv": 0.0},
            deploy={
                "ports": {name: _free_port() for name in PORT_NAMES},
                "state_dir": str(state_dir),
                "warm": warm_deployment,
                "startup_timeout_s": 120,
                "stop_timeout_s": 10,
            },
        )
        ports = [port for process in plan(cell).processes for port in process.ports]
        if len(set(ports)) == len(ports) and not any(port_problem("127.0.0.1", p) for p in ports):
            return cell
    raise RuntimeError("no free set of loopback ports")


def _random(num_prompts: int, input_len: int, output_len: int, **extra) -> Workload:
    return Workload(math.inf, input_len, output_len, num_prompts, 0, "random", 1.0, 0, **extra)


def _run(cell: Cell, path: Path) -> tuple[list[dict], dict]:
    run_cell(cell, path)
    rows = trace.read(path).to_pylist()
    metadata = json.loads(pq.read_schema(path).metadata[trace.METADATA_KEY])
    return rows, metadata


def test_preemptions_per_request_and_the_exact_kv_peak_per_cell(tmp_path, monkeypatch):
    """Two cells on one warm deployment with a small KV pool. The first overfills it: the
    engine preempts, each row says how often, and the peak is the whole pool. The second sends
    one short request at a time on the same (reused) server: its peak is one request's blocks,
    not the first cell's, and nothing is preempted."""
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "state"
    heavy = _cell(_random(16, 1536, 128), state, serving=small_pool("v1"), warm_deployment=True)
    light = replace(heavy, workload=_random(4, 128, 4, max_concurrency=1))
    pool_blocks = modelled_layout(heavy)["kv_pool_blocks"]
    assert pool_blocks == 814
    try:
        rows, metadata = _run(heavy, tmp_path / "heavy.parquet")
        light_rows, light_metadata = _run(light, tmp_path / "light.parquet")
    finally:
        warm.stop_all(state)
    assert all(r["success"] for r in rows + light_rows)
    preemptions = [r["preemptions"] for r in rows]
    assert all(isinstance(n, int) for n in preemptions)
    assert sum(preemptions) > 0 and 0 in preemptions
    memory_use = metadata["memory"]
    assert memory_use["peak_kv_blocks"] == [pool_blocks]  # 16 x 104 blocks wanted
    assert memory_use["peak_kv_cache_usage"] == 1.0
    assert light_metadata["deployment"]["started"] == "reused"
    assert [r["preemptions"] for r in light_rows] == [0] * 4
    light_memory = light_metadata["memory"]
    # One request at a time: 128 prompt + 3 computed output tokens = 9 blocks.
    assert light_memory["peak_kv_blocks"] == [9]
    assert light_memory["peak_kv_cache_usage"] == 9 / pool_blocks
    samples = [u for s in light_memory["kv_cache_usage"].values() for _, u in s]
    assert max(samples) <= light_memory["peak_kv_cache_usage"]


def test_one_instance_serves_plain_and_chunked_prefill(tmp_path, monkeypatch):
    """single-plain and single-chunked each start one emulator process from their own command
    line (--no-enable-chunked-prefill / --enable-chunked-prefill), serve every request, and the
    summary of the two traces says which chunked."""
    monkeypatch.chdir(tmp_path)
    paths = []
    flags = {
        "single-plain": "--no-enable-chunked-prefill",
        "single-chunked": "--enable-chunked-prefill",
    }
    for mode in ("single-plain", "single-chunked"):
        cell = _cell(_random(4, 4096, 8), tmp_path / "state", mode=mode, serving=Serving(8192, 0.8))
        paths.append(tmp_path / f"{mode}.parquet")
        rows, metadata = _run(cell, paths[-1])
        assert all(r["success"] for r in rows), mode
        (server,) = metadata["deployment"]["processes"]
        assert server["argv"][:2] == ["servematrix-emulator", "serve"]
        assert flags[mode] in server["argv"]
    summary = aggregate.summarize(paths)
    assert dict(zip(summary["mode"], summary["chunked_prefill"], strict=True)) == {
        "single-plain": False,
        "single-chunked": True,
    }


def test_disaggregated_preemptions_and_peaks_cover_both_instances(tmp_path, monkeypatch):
    """v1 Mooncake: every request is served by the prefiller and by the decoder; the trace
    counts both instances' preemptions, and the memory both instances' peaks."""
    monkeypatch.chdir(tmp_path)
    cell = _cell(_random(6, 256, 8), tmp_path / "state", mode="mooncake-tcp")
    rows, metadata = _run(cell, tmp_path / "disagg.parquet")
    assert all(r["success"] for r in rows)
    assert [r["preemptions"] for r in rows] == [0] * 6
    prefill, decode = metadata["memory"]["peak_kv_blocks"]
    assert prefill >= 16 and decode >= 16  # at least one 256-token prompt on each
    pool = metadata["memory"]["kv_pool_blocks"]
    assert metadata["memory"]["peak_kv_cache_usage"] == max(prefill, decode) / pool


JSONL_LINES = [
    {"input_len": 64, "output_len": 4},  # served
    {"input_len": 13100, "output_len": 4},  # prompt beyond max_model_len: 400 on both
    {"input_len": 13000, "output_len": 100},  # v0: 400; v1: max_tokens clamped to 24
    {"input_len": 12897, "output_len": 1},  # v0: more blocks than above the watermark
    {"input_len": 12896, "output_len": 2},  # fits exactly above the watermark
]


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_requests_the_server_cannot_serve_are_failed_rows(tmp_path, monkeypatch, recipe):
    """Per-request lengths from a jsonl file, some beyond what the server can serve: each
    becomes a row with vLLM's answer (0.6 and 0.33 differ), the others are served and the
    cell completes."""
    monkeypatch.chdir(tmp_path)
    dataset = tmp_path / "lengths.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in JSONL_LINES))
    workload = Workload(
        math.inf,
        64,
        4,
        len(JSONL_LINES),
        0,
        "jsonl",
        1.0,
        0,
        max_concurrency=1,  # in file order: each answer is from a server that served the last
        dataset_path=str(dataset),
    )
    cell = _cell(workload, tmp_path / "state", recipe=recipe, serving=small_pool(recipe))
    rows, _ = _run(cell, tmp_path / "jsonl.parquet")
    outcome = [(r["success"], r["error"], r["completion_tokens"]) for r in rows]
    limit = cell.serving.max_model_len
    if recipe == "v0":
        too_long = (
            f"HTTP 400: This model's maximum context length is {limit} tokens. However, you "
            "requested {} tokens ({} in the messages, {} in the completion). Please reduce the "
            "length of the messages or completion."
        )
        assert outcome == [
            (True, None, 4),
            (False, too_long.format(13104, 13100, 4), 0),
            (False, too_long.format(13100, 13000, 100), 0),
            (False, "stream ended without a token", 0),
            (True, None, 2),
        ]
    else:
        assert outcome == [
            (True, None, 4),
            (
                False,
                f"HTTP 400: This model's maximum context length is {limit} tokens. However, "
                "your prompt contains 13100 input tokens, which exceeds this limit even without "
                "any output tokens. Please reduce the length of the input prompt. "
                "(parameter=input_tokens, value=13100)",
                0,
            ),
            (True, None, limit - 13000),
            (True, None, 1),
            (True, None, 2),
        ]
    assert [r["preemptions"] for r in rows] == [0] * len(JSONL_LINES)


def test_kv_peak_benchmark_quick_prints_its_table():
    result = subprocess.run(
        [sys.executable, "benchmarks/emulator_kv_peak.py", "--quick"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("| v1 ")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4:7] == ["814", "814", "814"]  # the pool, filled on both backends
    # Both preempt; the wall clock can move a request by a step, and so one preemption.
    assert int(cells[8]) > 0 and int(cells[9]) > 0 and int(cells[10]) <= 2
