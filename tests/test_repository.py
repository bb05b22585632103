"""What the repository's own files promise: `make clean` and .gitignore cover what runs leave."""

from __future__ import annotations

import subprocess

from tests.conftest import ROOT

LEFT_BY_RUNS = ("results", ".snakemake", ".servematrix")
"""Traces and reports; Snakemake's records; the local deployments' GPU locks and state."""


def test_make_clean_removes_what_runs_leave(tmp_path):
    for name in LEFT_BY_RUNS:
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "file").write_text("x")
    (tmp_path / "keep.yaml").write_text("x")
    done = subprocess.run(
        ["make", "-f", str(ROOT / "Makefile"), "clean"], cwd=tmp_path, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.yaml"]


def test_git_ignores_what_runs_leave():
    paths = [f"{name}/sub/file" for name in LEFT_BY_RUNS]
    done = subprocess.run(["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == paths


def test_git_ignores_only_the_workflows_results_not_the_package_layer_of_that_name():
    path = "src/servematrix/results/metrics.py"
    done = subprocess.run(["git", "check-ignore", path], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == ""
