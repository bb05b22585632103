"""End to end on the default config: every study's recommendation answers its question within
one screen, the report opens on the front page, and a report after another config's run holds
only the current config's studies."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import yaml

from servematrix.reporting import browser
from servematrix.reporting.findings.recommend import ANSWER_WORDS, answer_words
from tests.conftest import ROOT
from tests.workflow_helpers import copy_workflow, snakemake, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    workdir = copy_workflow(tmp_path_factory.mktemp("default"), config)
    run = snakemake(workdir, "--cores", "2", "all")
    assert run.returncode == 0, run.stderr[-3000:]
    report = snakemake(workdir, "--report", "results/report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    return workdir


def recommendation(workdir, study: str) -> dict:
    path = workdir / "results" / "simulator" / "findings" / f"{study}.json"
    return json.loads(path.read_text(encoding="utf-8"))


def test_every_default_recommendation_fits_one_screen(default_run):
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    assert len(config["studies"]) == 6
    for study in config["studies"]:
        sentences = recommendation(default_run, study)["sentences"]
        assert 0 < answer_words(sentences) <= ANSWER_WORDS, (study, answer_words(sentences))
        markdown = (default_run / "results" / "simulator" / "findings" / f"{study}.md").read_text()
        assert not re.search(r"\d[eE][+-]?\d", markdown), study


def test_the_mooncake_study_is_answered_per_model(default_run):
    answer = recommendation(default_run, "mooncake")
    sentences = answer["sentences"]
    assert sentences[0].startswith("The question: the best mode for each model")
    assert any(s.startswith("For Qwen2.5-72B-Instruct, run ") for s in sentences)
    assert any(s.startswith("For Qwen2.5-7B-Instruct-GPTQ-Int4, run ") for s in sentences)
    # one ranking per model, each of the model's four modes only
    assert sorted(t["title"] for t in answer["tables"]) == [
        "Qwen2.5-72B-Instruct",
        "Qwen2.5-7B-Instruct-GPTQ-Int4",
    ]
    assert all(len(t["rows"]) == 4 for t in answer["tables"])
    scaling = recommendation(default_run, "command-r-input")["sentences"]
    assert scaling[0].startswith("The question: how capacity falls with input length")


def test_the_report_opens_on_the_front_page(default_run):
    """A real headless Chromium: after the report's scripts ran, the page shows the Overview
    result (the front page in its frame), not Snakemake's rule graph."""
    dom = browser.rendered_dom(default_run / "results" / "report.html")
    frames = re.findall(r'<iframe src="(data:text/html[^"]*)"', dom)
    assert len(frames) == 1 and "filename=overview.html" in frames[0]


def test_a_report_after_another_configs_run_holds_only_its_studies(default_run, tmp_path):
    """Results of the default config are on disk; a smaller config is run in the same directory
    and reported: its studies only, in the report's categories and on its front page."""
    from tests.conftest import SMALL_CONFIG

    config = copy.deepcopy(SMALL_CONFIG)
    workdir = copy_workflow(tmp_path, yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    shutil.copytree(default_run / "results", workdir / "results")
    write_config(workdir, config)
    assert snakemake(workdir, "--cores", "2", "all").returncode == 0
    report = snakemake(workdir, "--report", "report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    html = (workdir / "report.html").read_text(encoding="utf-8")
    categories = json.loads(re.search(r"var categories = (\{.*?\});\n", html).group(1))
    assert set(categories) == {"disagg", "sizes", "Overview"}
    overview = (workdir / "results" / "simulator" / "overview.html").read_text()
    assert 'id="disagg"' in overview and 'id="mooncake"' not in overview


def test_a_config_without_slo_gets_findings_and_a_front_page_that_say_so(tmp_path):
    from tests.conftest import SMALL_CONFIG

    config = copy.deepcopy(SMALL_CONFIG)
    del config["slo"]
    workdir = copy_workflow(tmp_path, config)
    run = snakemake(workdir, "--cores", "2", "all")
    assert run.returncode == 0, run.stderr[-3000:]
    base = workdir / "results" / "simulator"
    line = (
        "slo: {ttft: {statistic: p99, max_ms: 2000}, tpot: {statistic: p99, max_ms: 100}, "
        "attainment: 0.9}"
    )
    for study in ("disagg", "sizes"):
        findings = (base / "findings" / f"{study}.md").read_text(encoding="utf-8")
        assert "No SLO is set" in findings and line in findings
    overview = (base / "overview.html").read_text(encoding="utf-8")
    assert "servematrix: no SLO set" in overview and f"<code>{line}</code>" in overview
    assert not (base / "capacity").exists()
    report = snakemake(workdir, "--report", "results/report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    assert "No SLO is set" in (workdir / "results" / "report.html").read_text(encoding="utf-8")
