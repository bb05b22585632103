"""Bad input through real Snakemake: the same one line as `servematrix check`, and no job runs.

Every test works in one scratch copy of the workflow, rewriting config/config.yaml; a refused
config must leave no results/ directory behind.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from servematrix.spec import trace
from tests.conftest import ROOT, SMALL_CONFIG
from tests.test_bad_input import ROWS, TEXT_ROWS, broken_text, config_text, expected_text_line
from tests.workflow_helpers import copy_workflow, planned_jobs, snakemake

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("bad"), copy.deepcopy(SMALL_CONFIG))


def servematrix_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("servematrix")]


def check_lines(workdir: Path, path: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "check", path],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    return run.stderr.splitlines()


def refused(workdir: Path, *args: str) -> list[str]:
    """Run snakemake; it must fail before any job, without a traceback; its servematrix lines."""
    shutil.rmtree(workdir / "results", ignore_errors=True)
    run = snakemake(workdir, "--cores", "1", *args)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    assert not (workdir / "results").exists()
    return servematrix_lines(run.stderr)


@pytest.mark.parametrize(("row", "change", "message"), ROWS, ids=[r[0] for r in ROWS])
def test_workflow_refuses_like_check(workdir, row, change, message):
    cfg = copy.deepcopy(SMALL_CONFIG)
    change(cfg)
    (workdir / "config" / "config.yaml").write_text(config_text(cfg))
    lines = refused(workdir, "all")
    assert lines == [f"servematrix: {message}"]
    assert lines == check_lines(workdir, "config/config.yaml")


@pytest.mark.parametrize("row", [r[0] for r in TEXT_ROWS])
def test_workflow_locates_yaml_errors_by_line(workdir, row):
    text, _ = broken_text(row)
    (workdir / "config" / "config.yaml").write_text(text)
    lines = refused(workdir, "all")
    assert lines == [expected_text_line(row, "config/config.yaml")]
    assert lines == check_lines(workdir, "config/config.yaml")


def test_a_syntax_error_in_a_config_of_ones_own_is_located(workdir):
    text, _ = broken_text("yaml-syntax-error")
    (workdir / "mine.yaml").write_text(text)
    lines = refused(workdir, "all", "--config", "configfile=mine.yaml")
    assert lines == [expected_text_line("yaml-syntax-error", "mine.yaml")]


def test_a_missing_config_of_ones_own_is_one_line(workdir):
    lines = refused(workdir, "all", "--config", "configfile=nope.yaml")
    assert lines == ["servematrix: config error at nope.yaml: no such file"]


SNAKEMAKE_READS_CONFIGFILE = (
    "Snakemake reads a --configfile in its command line (ConfigSettings, before it reads the "
    "Snakefile), so no servematrix code runs before it fails: a missing file is a traceback "
    "(snakemake/common/configfile.py opens it outside its try), a syntax error its own line "
    "without the line number. `--config configfile=FILE` is read by servematrix alone."
)


@pytest.mark.xfail(strict=True, reason=SNAKEMAKE_READS_CONFIGFILE)
def test_a_missing_configfile_is_one_line(workdir):
    lines = refused(workdir, "all", "--configfile", "nope.yaml")
    assert lines == ["servematrix: config error at nope.yaml: no such file"]


@pytest.mark.xfail(strict=True, reason=SNAKEMAKE_READS_CONFIGFILE)
def test_a_syntax_error_in_a_configfile_is_located(workdir):
    text, _ = broken_text("yaml-syntax-error")
    (workdir / "mine.yaml").write_text(text)
    lines = refused(workdir, "all", "--configfile", "mine.yaml")
    assert lines == [expected_text_line("yaml-syntax-error", "mine.yaml")]


def test_config_after_the_target_is_the_documented_order(workdir):
    (workdir / "config" / "config.yaml").write_text(config_text(copy.deepcopy(SMALL_CONFIG)))
    after = refused(workdir, "all", "--config", "backend=tgi")
    assert len(after) == 1
    assert after[0].startswith("servematrix: config error at backend: 'tgi' is not one of [")
    assert refused(workdir, "--config", "backend=tgi", "--", "all") == after
    readme = (ROOT / "README.md").read_text()
    assert "snakemake --cores 1 all --config backend=vllm" in readme
    assert "--config KEY=VALUE -- all" in readme


@pytest.mark.parametrize("how", ["--configfile", "--config configfile="])
def test_a_config_of_ones_own_is_not_merged_with_the_default(workdir, how):
    """One study in other.yaml: Snakemake plans exactly the cells `servematrix check` counts."""
    default = copy.deepcopy(SMALL_CONFIG)
    (workdir / "config" / "config.yaml").write_text(config_text(default))
    other = copy.deepcopy(SMALL_CONFIG)
    other["studies"] = {"sizes": other["studies"]["sizes"]}
    (workdir / "other.yaml").write_text(config_text(other))
    args = (
        ["--configfile", "other.yaml"]
        if how == "--configfile"
        else ["--config", "configfile=other.yaml"]
    )
    dry = snakemake(workdir, "-n", "--cores", "1", "all", *args)
    assert dry.returncode == 0, dry.stderr[-2000:]
    check = subprocess.run(
        [sys.executable, "-m", "servematrix.cli", "check", "other.yaml"],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    assert "4 distinct cells on backend simulator" in check.stdout
    assert planned_jobs(dry) == {
        "simulate_cell": 4,
        "step_time_sources": 1,
        "summarize": 1,
        "figures": 1,
        "findings": 1,
        "simulate_capacity": 4,
        "capacity_table": 1,
        "answer_figures": 1,
        "overview": 1,
        "all": 1,
    }


def test_report_before_any_result_is_one_line(workdir):
    (workdir / "config" / "config.yaml").write_text(config_text(copy.deepcopy(SMALL_CONFIG)))
    lines = refused(workdir, "--report", "results/report.html")
    assert len(lines) == 1
    assert re.fullmatch(
        r"servematrix: no results to report yet \(results/simulator/cells/\S+\.parquet and "
        r"\d+ more missing\): run `snakemake --cores 1 all` first",
        lines[0],
    ), lines[0]


def test_the_worked_example_runs(tmp_path):
    """README's example: a model of one's own (a local config.json), its own config file."""
    workdir = copy_workflow(tmp_path, yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    shutil.copytree(ROOT / "config" / "examples", workdir / "config" / "examples")
    run = snakemake(workdir, "--cores", "1", "all", "--configfile", "config/examples/my-model.yaml")
    assert run.returncode == 0, run.stderr[-3000:]
    fallbacks = [line for line in servematrix_lines(run.stderr) if "roofline model" in line]
    # On the terminal, not only in a log: once, since the simulated cells share the Snakemake
    # process (servematrix.workflow.in_process_job), where the step-time model is built once.
    assert len(fallbacks) == 1
    summary = pl.read_parquet(workdir / "results" / "simulator" / "summary" / "my-model.parquet")
    assert summary["model"].to_list() == ["my-llama-1b"] * 2
    assert summary["completed"].to_list() == [50, 50]
    assert (workdir / "results" / "simulator" / "findings" / "my-model.md").is_file()
    # The two configured cells, and the capacity search's probes beside them (its `slo:`).
    cells = sorted((workdir / "results" / "simulator" / "cells").rglob("*.parquet"))
    assert {p.parent.relative_to(workdir).as_posix() for p in cells} == {
        "results/simulator/cells/v1/my-llama-1b/single"
    }
    assert len(cells) > 2
    findings = (workdir / "results" / "simulator" / "findings" / "my-model.md").read_text()
    assert "The question: the best model, at the SLO" in findings


def test_the_worked_example_runs_on_the_emulator(tmp_path, monkeypatch):
    """The same example with `--config backend=emulator`: the emulator is told the config's
    architecture (its hf_id is in no cache here, and the Hub is not asked). With the capacity
    probes a second config file shortens, as docs/configuration.md shows: each probe of the
    default is two minutes of wall time and enough requests for a P99 (7.5 minutes in CI)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    workdir = copy_workflow(tmp_path, yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    shutil.copytree(ROOT / "config" / "examples", workdir / "config" / "examples")
    quick = {"capacity": {"min_duration_s": 10, "tail_requests": 2}}
    (workdir / "config" / "quick-probes.yaml").write_text(yaml.safe_dump(quick))
    configs = ("config/examples/my-model.yaml", "config/quick-probes.yaml")
    example = ("--configfile", *configs, "--config", "backend=emulator")
    run = snakemake(workdir, "--cores", "1", "all", *example)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = pl.read_parquet(workdir / "results" / "emulator" / "summary" / "my-model.parquet")
    assert summary["completed"].to_list() == [50, 50]
    cell = next((workdir / "results" / "emulator" / "cells").rglob("*.parquet"))
    argv = trace.read_metadata(cell)["deployment"]["processes"][0]["argv"]
    arch = str(workdir / "config" / "examples" / "my-model" / "config.json")
    assert argv[argv.index("--architecture") + 1] == arch
    assert argv[argv.index("--modelled-quantization") + 1] == "bf16"
    assert (workdir / "results" / "emulator" / "compare" / "my-model" / "ratios.csv").is_file()
