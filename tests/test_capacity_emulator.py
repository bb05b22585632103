"""A server that fails requests is never recommended, with or without an attainment: two real
emulator deployments searched at the SLO, one failing 5 % of its requests (the emulator's
injected fault), then ranked as the findings rank them."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from servematrix.backends.cell import CellError, run_cell
from servematrix.capacity import run as capacity_run
from servematrix.deploy.supervise import port_problem
from servematrix.reporting.findings.recommend import rankings
from servematrix.results import steady
from servematrix.spec import config
from servematrix.spec.slo import Slo

pytestmark = pytest.mark.slow

SLO = {"ttft": {"statistic": "p90", "max_ms": 3000}}


def _free_base() -> int:
    for _ in range(100):
        base = random.randrange(12000, 30000, 1000)
        if not any(port_problem("127.0.0.1", base + offset) for offset in (997, 800)):
            return base
    raise RuntimeError("no free ports")


def _config() -> dict:
    base = _free_base()
    model = {
        "hf_id": "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
        "architecture": "qwen2.5-7b",
        "quantization": "gptq-int4",
        "tensor_parallel": 1,
        "gpus": [[0]],
    }
    return {
        "backend": "emulator",
        "defaults": {"num_prompts": 10, "output_len": 8, "seed": 0},
        "slo": SLO,
        "capacity": {"min_duration_s": 3, "tail_requests": 2, "max_probes": 3},
        "ports": {"single": base + 997, "proxy": base + 90, "bootstrap": base + 800},
        "deploy": {"warm": False, "startup_timeout_s": 60, "stop_timeout_s": 10},
        "models": {"failing": model, "healthy": model},
        "studies": {
            "s": {
                "recipe": "v1",
                "models": ["failing", "healthy"],
                "modes": ["single"],
                "qps": [4],
                "input_len": [128],
            }
        },
    }


def test_a_server_failing_requests_is_never_recommended(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config.load(_config())
    (failing_path, failing), (healthy_path, healthy) = capacity_run.deployments(
        cfg.studies["s"].cells
    ).items()
    settings = cfg.raw["capacity"]
    monkeypatch.setenv("SERVEMATRIX_EMULATOR_FAIL_FRACTION", "0.05")
    broken = capacity_run.search_deployment(failing, cfg.slo, settings, hint=4.0)
    monkeypatch.delenv("SERVEMATRIX_EMULATOR_FAIL_FRACTION")
    sound = capacity_run.search_deployment(healthy, cfg.slo, settings, hint=4.0)

    # Without an attainment, a failed request breaks the SLO at every rate, however fast the
    # served ones were (5 % failures are under what the P90 bound would let through).
    assert broken["capacity"] == 0 and broken["breaks_first"] == "failed requests"
    assert sound["capacity"] > 0
    capacity_run.write_deployment(broken, failing_path)
    capacity_run.write_deployment(sound, healthy_path)
    (ranking,) = rankings(capacity_run.study_table([failing_path, healthy_path]), "models")
    assert [row["model"] for row in ranking.rows] == ["healthy", "failing"]

    # With an attainment of 0.97 the same probes (reused, not rerun) miss it: a failed request
    # meets no bound.
    with_attainment = Slo.from_config({**SLO, "attainment": 0.97})
    again = capacity_run.search_deployment(failing, with_attainment, settings, hint=4.0)
    assert again["capacity"] == 0
    assert {p["trace"] for p in again["searches"][0]["probes"]} <= {
        p["trace"] for p in broken["searches"][0]["probes"]
    }


def test_a_probe_whose_requests_all_failed_breaks_the_slo_a_cell_fails(tmp_path, monkeypatch):
    """Every request failing: a capacity probe keeps its trace and is judged (the SLO is
    broken), while the same cell measured for a study fails with one line and writes nothing."""
    monkeypatch.chdir(tmp_path)
    cfg = config.load(_config())
    study_cell = cfg.studies["s"].cells[0]
    cell = replace(study_cell, workload=replace(study_cell.workload, qps=2.0, num_prompts=6))
    monkeypatch.setenv("SERVEMATRIX_EMULATOR_FAIL_FRACTION", "1")
    with pytest.raises(CellError, match=r"all 6 requests to http://\S+/v1/completions failed; "):
        run_cell(cell, cell.path)
    assert not Path(cell.path).exists()
    verdict = steady.judge(capacity_run.run_probe(cell), cfg.slo, tail_requests=2)
    assert not verdict.met and Path(cell.path).is_file()


def test_a_measured_search_starts_from_its_twin_and_keeps_it_in_the_ledger(tmp_path, monkeypatch):
    """The capacity job on the emulator reads the simulator twin's document for the same
    deployment, starts its search there, and keeps the twin's capacity: the study table then
    holds the error ledger, each deployment's predicted range made from the other's error."""
    monkeypatch.chdir(tmp_path)
    raw = _config()
    measured, twin = config.load(raw), config.load({**raw, "backend": "simulator"})
    pairs = zip(
        capacity_run.deployments(twin.studies["s"].cells).items(),
        capacity_run.deployments(measured.studies["s"].cells).items(),
        strict=True,
    )
    paths, twins = [], []
    for (twin_path, twin_cells), (path, cells) in pairs:
        predicted = capacity_run.search_deployment(twin_cells, twin.slo, twin.raw["capacity"])
        capacity_run.write_deployment(predicted, twin_path)
        cells_json = json.dumps([c.to_dict() for c in cells])
        capacity_run.capacity_job(cells_json, SLO, measured.raw["capacity"], [twin_path], path)
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        assert document["started_from"] == "simulator"
        assert document["simulated_capacity_level"] == predicted["capacity_level"]
        paths.append(path)
        twins.append(predicted)
    table = capacity_run.study_table(paths).sort("model")
    for row, predicted in zip(
        table.to_dicts(), sorted(twins, key=lambda d: d["model"]), strict=True
    ):
        assert row["simulated_capacity_per_gpu"] == predicted["capacity_per_gpu"] > 0
        assert row["capacity_per_gpu"] > 0
        assert row["predicted_lo_per_gpu"] <= row["predicted_hi_per_gpu"]
