"""Workflow speed: the workflow part of `make all` from an empty results/, and a forced
re-simulation of every cell, both through real Snakemake (issue 17, item 4).

What is timed, in a scratch copy of the workflow (Snakefile, rules, scripts, report, profiles,
envs, config) so the repository's own results/ is left alone:

1. **first run**: ``snakemake --cores N all`` from an empty ``results/`` and no ``.snakemake/``
   (the venv is already built: what `make all` costs after its first line);
2. **report**: ``snakemake --report results/report.html`` (the second line of `make all`);
3. **forced re-simulation**: ``snakemake --cores N --forcerun <cell rules> --until <cell rules>
   all`` against the finished run: every configured cell simulated again through Snakemake, its
   downstream left alone.

Targets: the first run under a minute on 2 cores (issue 40; issue 17 had asked 45 s before
capacity probes were steady-state runs), the forced re-simulation under 15 s (issue 17).
Each step's job count is read from Snakemake's own "Job stats" table. ``--fingerprints PATH``
writes a SHA-256 of every trace's records (all columns, row order kept; the file's run metadata,
which holds wall-clock times and versions, left out), so two trees that write the same traces
write the same file.

Usage (from the repository root)::

    .venv/bin/python benchmarks/workflow_speed.py                 # --cores 2, default config
    .venv/bin/python benchmarks/workflow_speed.py --cores 1 --fingerprints /tmp/traces.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.workflow_helpers import copy_workflow, planned_jobs  # noqa: E402

FIRST_RUN_TARGET_S = 60.0
RESIMULATION_TARGET_S = 15.0
CELL_RULES = ("cell", "simulate_cell")
"""The rules that write traces: a measured cell, and a simulated one (rules/cells.smk)."""


@dataclass(frozen=True)
class Step:
    name: str
    wall_s: float
    jobs: int
    target_s: float | None


def _snakemake(workdir: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True, text=True
    )
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        sys.exit(f"snakemake {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return wall_s, result


def _job_count(result: subprocess.CompletedProcess) -> int:
    """Jobs Snakemake ran, from the 'Job stats' table it prints before running them."""
    match = re.search(r"^total\s+(\d+)$", result.stdout + result.stderr, re.MULTILINE)
    return int(match.group(1)) if match else 0


def _cell_rules(workdir: Path) -> list[str]:
    """The trace-writing rules this tree defines (the names differ before and after batching)."""
    _, dry = _snakemake(workdir, "-n", "--forceall", "--cores", "1", "all")
    return [rule for rule in planned_jobs(dry) if rule in CELL_RULES]


def fingerprints(results: Path) -> dict[str, str]:
    import pyarrow.parquet as pq

    out = {}
    for path in sorted((results).glob("*/cells/**/*.parquet")):
        table = pq.read_table(path).replace_schema_metadata(None)
        digest = hashlib.sha256()
        for name in table.column_names:
            digest.update(name.encode())
            digest.update(json.dumps(table.column(name).to_pylist(), default=str).encode())
        out[str(path.relative_to(results))] = digest.hexdigest()
    return out


def measure(config: Path, cores: int, workdir: Path) -> list[Step]:
    import yaml

    copy_workflow(workdir, yaml.safe_load(config.read_text()))
    cores_arg = ("--cores", str(cores))
    wall_s, run = _snakemake(workdir, *cores_arg, "all")
    steps = [Step(f"first run (--cores {cores})", wall_s, _job_count(run), FIRST_RUN_TARGET_S)]
    wall_s, _ = _snakemake(workdir, "--report", "results/report.html")
    steps.append(Step("report", wall_s, 0, None))
    rules = _cell_rules(workdir)
    wall_s, run = _snakemake(
        workdir, *cores_arg, "--forcerun", *rules, "--until", *rules, "--", "all"
    )
    steps.append(
        Step(
            f"forced re-simulation ({', '.join(rules)})",
            wall_s,
            _job_count(run),
            RESIMULATION_TARGET_S,
        )
    )
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--config", type=Path, default=ROOT / "config" / "config.yaml")
    parser.add_argument("--fingerprints", type=Path, help="write every trace's SHA-256 here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="servematrix-workflow-speed-") as scratch:
        workdir = Path(scratch)
        steps = measure(args.config, args.cores, workdir)
        if args.fingerprints:
            prints = fingerprints(workdir / "results")
            args.fingerprints.write_text(json.dumps(prints, indent=1, sort_keys=True) + "\n")
            print(f"{len(prints)} trace fingerprints written to {args.fingerprints}")
        shutil.rmtree(workdir / ".snakemake", ignore_errors=True)
    print(
        f"\nmachine: {platform.node()}, {platform.processor() or platform.machine()}, "
        f"config {args.config.name}\n"
    )
    print("| step | wall s | jobs | target |\n|---|---:|---:|---|")
    for step in steps:
        target = (
            ""
            if step.target_s is None
            else (f"< {step.target_s:.0f} s: {'met' if step.wall_s < step.target_s else 'NOT met'}")
        )
        print(f"| {step.name} | {step.wall_s:.1f} | {step.jobs} | {target} |")


if __name__ == "__main__":
    main()
