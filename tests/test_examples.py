"""Every example config the README points to passes the one config check (`servematrix check`
and the workflow run the same), so a README command does not stop at its first line."""

from __future__ import annotations

from pathlib import Path

import pytest

from servematrix.spec.config import read_yaml
from servematrix.workflow import check_config
from tests.conftest import ROOT

EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))
NEEDS_THE_VLLM_CPU_MODEL = "vllm-cpu.yaml"  # built by make test-vllm; tests/test_deploy_cpu.py


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if p.name != NEEDS_THE_VLLM_CPU_MODEL], ids=lambda p: p.name
)
def test_the_example_passes_check(path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the examples name their data files from the repository root
    cfg = check_config(read_yaml(path))
    assert cfg.all_cells()


def test_every_example_is_covered() -> None:
    assert {p.name for p in EXAMPLES} >= {"mooncake-trace.yaml", NEEDS_THE_VLLM_CPU_MODEL}
