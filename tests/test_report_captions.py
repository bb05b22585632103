"""The report's RST captions render (Jinja as Snakemake configures it) without RST warnings."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest
from docutils.core import publish_parts

from servematrix.spec import config

REPORT = Path(__file__).resolve().parents[1] / "report"


def render(name: str, raw_config: dict, study: str | None) -> tuple[str, str]:
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    snakemake = SimpleNamespace(config=raw_config, wildcards=SimpleNamespace(study=study))
    text = env.from_string((REPORT / name).read_text()).render(snakemake=snakemake)
    warnings = io.StringIO()
    publish_parts(
        text, writer="html", settings_overrides={"warning_stream": warnings, "report_level": 2}
    )
    return text, warnings.getvalue()


@pytest.mark.parametrize("name", sorted(p.name for p in REPORT.glob("*.rst")))
def test_caption_renders_cleanly_for_every_study(name, default_config, small_config):
    for raw in (default_config, small_config):
        resolved = dict(config.load(raw).raw)
        for study in resolved["studies"]:
            text, warnings = render(name, resolved, study)
            assert text.strip()
            assert warnings == "", f"{name} for {study}: {warnings}"


def test_workflow_description_names_backend_and_studies(default_config):
    text, _ = render("workflow.rst", dict(config.load(default_config).raw), None)
    assert "**simulator** backend" in text
    assert "**command-r-input**" in text
