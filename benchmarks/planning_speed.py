"""Planning speed: how long Snakemake takes to plan a matrix before its first job (issue 43).

Writes configs of growing size (simulated cells: models × modes × rates × input lengths, one
study), copies the workflow (Snakefile, rules, scripts, report, config/schema.yaml) into a
scratch directory and times ``snakemake -n --cores 1 all`` (a dry run: the DAG, every input
function, no job). ``--repo DIR`` plans with another checkout's workflow and package (its
``src/`` first on ``PYTHONPATH``), so a before and an after print side by side.

Usage (from the repository root)::

    .venv/bin/python benchmarks/planning_speed.py
    git worktree add /tmp/before <rev>
    .venv/bin/python benchmarks/planning_speed.py --repo /tmp/before
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("Snakefile", "rules", "scripts", "report", "config/schema.yaml")
MODES = ["nondisagg", "chunked", "mooncake-rdma", "mooncake-tcp"]


def config(cells: int) -> dict:
    """One study of ``cells`` cells: 4 modes × 2 input lengths × cells/8 rates (8 capacity
    searches)."""
    rates = [round(0.5 * (k + 1), 1) for k in range(cells // 8)]
    return {
        "backend": "simulator",
        "defaults": {"num_prompts": 20, "output_len": 6, "seed": 0},
        "slo": {"ttft": {"statistic": "p99", "max_ms": 2000}},
        "models": {
            "Qwen2.5-7B-Instruct": {
                "hf_id": "Qwen/Qwen2.5-7B-Instruct",
                "architecture": "qwen2.5-7b",
                "tensor_parallel": 1,
                "gpus": [[0], [4]],
            }
        },
        "studies": {
            "sweep": {
                "recipe": "v1",
                "models": ["Qwen2.5-7B-Instruct"],
                "modes": MODES,
                "qps": rates,
                "input_len": [512, 1024],
            }
        },
    }


def plan_s(repo: Path, cells: int) -> tuple[float, int]:
    """Wall time of one dry run and the jobs it planned."""
    with tempfile.TemporaryDirectory(prefix="servematrix-plan-") as scratch:
        work = Path(scratch)
        for part in PARTS:
            source, target = repo / part, work / part
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copy(source, target)
        (work / "config" / "config.yaml").write_text(yaml.safe_dump(config(cells)))
        env = {**os.environ, "PYTHONPATH": str(repo / "src")}
        started = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--quiet", "rules", "all"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        elapsed = time.perf_counter() - started
    jobs = next(
        int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("total")
    )
    return elapsed, jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--cells", type=int, nargs="*", default=[400, 1600, 3200])
    args = parser.parse_args()
    print(f"workflow and package of {args.repo}")
    print(f"{'cells':>6} {'jobs':>6} {'dry run s':>10} {'ms per cell':>12}")
    for cells in args.cells:
        elapsed, jobs = plan_s(args.repo.resolve(), cells)
        print(f"{cells:>6} {jobs:>6} {elapsed:>10.1f} {1000 * elapsed / cells:>12.2f}")


if __name__ == "__main__":
    main()
