"""Resolve the pip section of every envs/*.yaml with pip's own resolver, as conda would hand it
to pip, and print a table: does it resolve, how many packages, the versions that matter.

No conda channel is reachable from the machines servematrix is developed on, so this is the
part of `snakemake --sdm conda` that can be checked here: that the pins of each environment
agree with each other on the package index pip sees. Nothing is installed (`--dry-run`). An
environment whose Python is the running one resolves as on this machine (source-only
packages allowed); another Python resolves binary wheels for Linux x86_64.

    .venv/bin/python benchmarks/check_envs.py      (needs pip >= 23 and the package index)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SHOWN = ("vllm", "torch", "mooncake-transfer-engine", "numpy", "polars", "snakemake")
MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in (5, 17, 24, 27, 28, 31, 34, 35)]
PLATFORMS = [*MANYLINUX, "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def resolve(python: str, requirements: list[str]) -> tuple[str, dict[str, str], int]:
    """(outcome, versions shown, packages) of a dry-run install of the requirements."""
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
        command += ["--ignore-installed", "--report", str(report)]
        if python != running:
            command += ["--only-binary=:all:", "--python-version", python]
            command += ["--target", str(Path(scratch) / "target")]
            command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        result = subprocess.run(command + requirements, capture_output=True, text=True)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
            return (errors[-2] if len(errors) > 1 else "pip failed"), {}, 0
        installed = json.loads(report.read_text())["install"]
    versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installed}
    return "resolves", {name: versions[name] for name in SHOWN if name in versions}, len(installed)


def main() -> int:
    print(f"{'environment':<18} {'python':<7} {'packages':>8}  outcome / versions")
    failed = 0
    for path in sorted((ROOT / "envs").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        deps = spec["dependencies"]
        python = next(str(d).split("=", 1)[1] for d in deps if str(d).startswith("python="))
        pip = next(d["pip"] for d in deps if isinstance(d, dict))
        outcome, versions, count = resolve(python, pip)
        failed += outcome != "resolves"
        shown = ", ".join(f"{name} {version}" for name, version in versions.items())
        print(f"{path.stem:<18} {python:<7} {count:>8}  {outcome}{': ' + shown if shown else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
