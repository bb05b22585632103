"""Simulator speed on a whole Mooncake trace: wall time and simulated requests per second.

Replays every request of a Mooncake trace file (default: the conversation trace, 12,031
requests, in ``../shared/data/mooncake-fast25/`` beside the repository) on the simulator, one
cell per mode, with prefix caching on, as the ``mooncake-trace`` example does for a window:
Qwen2.5-7B-Instruct-GPTQ-Int4 on A100s (vLLM V1), at the trace's timestamps scaled to
``--qps``, inputs up to ``--max-input-len`` (Qwen2.5's 128k context: every request of the
conversation trace fits; longer ones would be dropped and counted). Each cell is timed with
``time.perf_counter`` (and ``time.process_time``: the CPU seconds, less noisy on a shared
machine) around ``simulate`` once, after a warm-up pass on a 200-request window
that pays the step-time tables, so the wall time is the replay's. "Simulated requests/s" is
requests over wall seconds. The table also gives each cell's prefix-cache hit rate, the best
the trace allows and the mean TTFT/TPOT (a check the run was not degenerate, not a finding).

``--kv-sweep`` instead replays the window of ``config/examples/mooncake-trace.yaml`` (its first
study, caching on) on one instance at QPS 1 with KV pools of three sizes, and prints the hit rate
each gets against the best the window allows: how much of the reuse the cache's size limits.

Usage (from the repository root)::

    .venv/bin/python benchmarks/trace_replay.py
    .venv/bin/python benchmarks/trace_replay.py --trace PATH --count 2000 --modes chunked
    .venv/bin/python benchmarks/trace_replay.py --kv-sweep
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake-fast25" / "conversation_trace.jsonl"
MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


def trace_config(trace: Path, count: int, qps: float, max_input_len: int, modes: list[str]):
    return {
        "backend": "simulator",
        "defaults": {
            "num_prompts": count,
            "output_len": 2000,
            "dataset": "mooncake",
            "dataset_path": str(trace),
            "warmup_requests": 0,
            "max_model_len": max_input_len + 2000,
            "gpu_memory_utilization": 0.9,
            "prefix_caching": True,
        },
        "engine": {"gpu": "A100-SXM4-80GB"},
        "models": {
            MODEL: {
                "hf_id": f"Qwen/{MODEL}",
                "architecture": "qwen2.5-7b",
                "quantization": "gptq-int4",
                "tensor_parallel": 1,
                "gpus": [[0], [4]],
            }
        },
        "studies": {
            "trace": {
                "recipe": "v1",
                "models": [MODEL],
                "modes": modes,
                "qps": [qps],
                "input_len": [max_input_len],
            }
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--count", type=int, default=None, help="requests (default: all)")
    parser.add_argument("--qps", type=float, default=1.0)
    parser.add_argument("--max-input-len", type=int, default=129_000)
    parser.add_argument("--modes", default="nondisagg,chunked,mooncake-rdma")
    parser.add_argument("--kv-sweep", action="store_true", help="hit rate against KV pool size")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.kv_sweep:
        return kv_sweep()

    from servematrix.simulate import simulate
    from servematrix.spec import config
    from servematrix.workload import replay, trace_window

    if not args.trace.is_file():
        print(f"trace file {args.trace} does not exist (give --trace)", file=sys.stderr)
        return 2
    count = args.count or len(replay.read_trace(args.trace))
    modes = args.modes.split(",")
    cells = config.load(
        trace_config(args.trace, count, args.qps, args.max_input_len, modes)
    ).all_cells()
    warm = cells[0]
    simulate(replace(warm, workload=replace(warm.workload, num_prompts=min(200, count))))
    window = trace_window(cells[0].workload)
    bound = replay.reuse_bound(window.requests)
    print(f"# {args.trace.name}: {count} requests ({window.dropped} dropped by the input cap)")
    print(f"# QPS {args.qps:g} (native {replay.native_rate(window.requests):.2f}), {MODEL}, v1")
    print(f"# python {platform.python_version()} on {platform.node()}, {os.cpu_count()} CPUs")
    header = ("mode", "requests", "wall_s", "cpu_s", "sim_req/s", "hit_rate", "best_rate")
    print(f"{header[0]:<14}" + "".join(f"{h:>10}" for h in header[1:]) + "   ttft_ms   tpot_ms")
    for cell in cells:
        start, cpu = time.perf_counter(), time.process_time()
        result = simulate(cell)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        served = [r for r in result.records if not r.warmup and r.success]
        ttft = statistics.fmean((r.first_token_s - r.sent_s) * 1e3 for r in served)
        tpots = [
            (r.end_s - r.first_token_s) * 1e3 / (r.completion_tokens - 1)
            for r in served
            if r.completion_tokens > 1
        ]
        engine = result.engine_parameters
        hit = engine["prefix_cache_hits_tokens"] / engine["prefix_cache_queries_tokens"]
        print(
            f"{cell.mode.name:<14}{len(result.records):>10}{wall:>10.1f}{cpu:>10.1f}"
            f"{len(result.records) / wall:>10.0f}{hit:>10.3f}{bound.hit_rate:>10.3f}"
            f"{ttft:>10.0f}{statistics.fmean(tpots):>10.1f}"
        )
    return 0


KV_POOLS = (("A100-SXM4-80GB", 0.45), ("A100-SXM4-80GB", 0.9), ("H200-SXM-141GB", 0.9))
"""(GPU, gpu_memory_utilization) of the sweep: about 0.5M, 1.2M and 2.0M tokens of KV pool."""


def kv_sweep() -> int:
    import yaml

    from servematrix.simulate import simulate
    from servematrix.spec import config
    from servematrix.workload import replay, trace_window

    raw = yaml.safe_load((ROOT / "config" / "examples" / "mooncake-trace.yaml").read_text())
    name = next(iter(raw["studies"]))
    raw["studies"] = {name: {**raw["studies"][name], "modes": ["single"], "qps": [1]}}
    raw["defaults"]["dataset_path"] = str(ROOT / raw["defaults"]["dataset_path"])
    print(f"{'gpu':<16}{'util':>6}{'kv_tokens':>11}{'hit_rate':>10}{'best_rate':>10}")
    for gpu, util in KV_POOLS:
        raw["engine"] = {"gpu": gpu}
        raw["defaults"]["gpu_memory_utilization"] = util
        cell = config.load(raw).all_cells()[0]
        engine = simulate(cell).engine_parameters
        tokens = engine["kv_cache"]["num_blocks"] * engine["kv_cache"]["block_size_tokens"]
        hit = engine["prefix_cache_hits_tokens"] / engine["prefix_cache_queries_tokens"]
        best = replay.reuse_bound(trace_window(cell.workload).requests).hit_rate
        print(f"{gpu:<16}{util:>6}{tokens:>11,}{hit:>10.3f}{best:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
