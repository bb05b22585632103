"""Cost of the simulator's KV peak tracking: one large single-instance cell, before and after.

The peak of KV blocks in use is tracked inside ``BlockPool.allocate`` (one comparison per
allocation), and the simulator's hot path must stay at 50,000 simulated requests per second or
more on a large cell. This script times ``servematrix.simulate.simulate`` on one cell with
``num_prompts`` replaced by ``--large`` in two source trees (``--tree label=path/to/src``, e.g.
``git archive`` of the previous commit), alternating between them for ``--rounds`` rounds so that
load from other processes on a shared machine hits both alike. Each run is a fresh process that
simulates a 200-request copy of the cell first (step-time tables, imports), then times the large
cell once with ``time.perf_counter``.

Usage (from the repository root)::

    mkdir -p /tmp/before && git archive HEAD~1 src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/simulator_memory_overhead.py \\
        --tree before=/tmp/before/src --tree after=src --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "config.yaml"

CHILD = r"""
import json, sys, time
from dataclasses import replace
from servematrix.spec.config import load_file
from servematrix.simulate import simulate

config_path, study, model, qps, large = sys.argv[1:6]
cells = [
    c for c in load_file(config_path).studies[study].cells
    if c.model.name == model and c.workload.qps == float(qps)
]
cell = cells[0]
simulate(replace(cell, workload=replace(cell.workload, num_prompts=200)))
big = replace(cell, workload=replace(cell.workload, num_prompts=int(large)))
began = time.perf_counter()
simulate(big)
wall_s = time.perf_counter() - began
print(json.dumps({"wall_s": wall_s, "mode": cell.mode.name}))
"""


def run_once(src: Path, args: argparse.Namespace) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(src.resolve()),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    argv = [str(args.config), args.study, args.model, str(args.qps), str(args.large)]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="label=path/to/src")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--study", default="model-size")
    parser.add_argument("--model", default="Qwen2.5-7B-Instruct")
    parser.add_argument("--qps", type=float, default=8.0)
    parser.add_argument("--large", type=int, default=100_000, help="num_prompts of the cell")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = [tuple(t.split("=", 1)) for t in args.tree]
    rates: dict[str, list[float]] = {label: [] for label, _ in trees}
    print(f"cell: study {args.study}, {args.model}, qps {args.qps:g}, {args.large} requests")
    print(f"{'round':>5}  {'tree':<10} {'wall s':>8} {'req/s':>10}")
    for round_ in range(1, args.rounds + 1):
        for label, src in trees:
            result = run_once(Path(src), args)
            rate = args.large / result["wall_s"]
            rates[label].append(rate)
            print(f"{round_:>5}  {label:<10} {result['wall_s']:>8.2f} {rate:>10,.0f}", flush=True)
    print(f"\n{'tree':<10} {'best req/s':>12} {'median req/s':>14}")
    for label, values in rates.items():
        print(f"{label:<10} {max(values):>12,.0f} {statistics.median(values):>14,.0f}")


if __name__ == "__main__":
    main()
