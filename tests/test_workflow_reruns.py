"""End to end: after a run, a changed setting makes Snakemake plan exactly the cells it changes.

Real Snakemake with its default rerun triggers (no --rerun-triggers), on the simulator: each
setting is changed once against a finished run and the dry run's planned cells are compared
with the cells the setting reaches (issue 15: a changed GPU used to rerun no cell).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from servematrix.engine.architecture import architecture_dir
from tests.workflow_helpers import copy_workflow, snakemake, write_config

pytestmark = pytest.mark.slow

SMALL = "Qwen2.5-7B-Instruct-GPTQ-Int4"
BIG = "Qwen2.5-14B-Instruct"
ARCH_FILE = "models/qwen14b/config.json"
DATASET = "data/lengths.jsonl"
CELLS = "results/simulator/cells"
DISAGG = {
    f"{CELLS}/v0/{SMALL}/{mode}/qps{qps}_in1024_out6_n20_s0.parquet"
    for mode in ("nondisagg", "mooncake-rdma")
    for qps in (2, 4)
}
SIZES_SMALL = {f"{CELLS}/v0/{SMALL}/single/qps4_in{n}_out6_n20_s0.parquet" for n in (512, 1024)}
SIZES_BIG = {f"{CELLS}/v0/{BIG}/single/qps4_in{n}_out6_n20_s0.parquet" for n in (512, 1024)}
REPLAY = {f"{CELLS}/v1/{SMALL}/single/qps4_in1024_out6_n20_s0_jsonl-lengths.parquet"}
EVERY = DISAGG | SIZES_SMALL | SIZES_BIG | REPLAY
NONE: set[str] = set()


def _config(small_config: dict[str, Any]) -> dict[str, Any]:
    """The small config, with the 14B's architecture in a local config.json and one study
    that replays a jsonl file, so that both files' contents can change."""
    config = copy.deepcopy(small_config)
    config["models"][BIG]["architecture"] = ARCH_FILE
    config["studies"]["replay"] = {
        "recipe": "v1",
        "models": [SMALL],
        "modes": ["single"],
        "qps": [4],
        "input_len": [1024],
        "workload": {"dataset": "jsonl", "dataset_path": DATASET},
    }
    return config


def _set(path: str, value: Any) -> Callable[[Path, dict], None]:
    """Set a config key; the path is dotted, a model's name (with dots) as one part."""
    model = next((m for m in (SMALL, BIG) if m in path), None)
    parts = path.replace(model, "@").split(".") if model else path.split(".")
    parts = [model if part == "@" else part for part in parts]

    def change(workdir: Path, config: dict) -> None:
        *parents, key = parts
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
        write_config(workdir, config)

    return change


def _edit_json(name: str, key: str, value: Any) -> Callable[[Path, dict], None]:
    def change(workdir: Path, config: dict) -> None:
        path = workdir / name
        data = json.loads(path.read_text())
        data[key] = value
        path.write_text(json.dumps(data, indent=2))

    return change


def _rewrite_dataset(text: str | None) -> Callable[[Path, dict], None]:
    def change(workdir: Path, config: dict) -> None:
        path = workdir / DATASET
        path.write_text(path.read_text() if text is None else text)  # None: same bytes, new mtime

    return change


# (setting, change, the cells it must rerun)
CHANGES = [
    ("engine.gpu: H100-SXM5-80GB", _set("engine.gpu", "H100-SXM5-80GB"), EVERY),
    ("engine.jitter_cv: 0", _set("engine.jitter_cv", 0), EVERY),
    ("defaults.gpu_memory_utilization: 0.9", _set("defaults.gpu_memory_utilization", 0.9), EVERY),
    ("defaults.max_model_len: 8192", _set("defaults.max_model_len", 8192), EVERY),
    (
        "studies.sizes.workload.enforce_eager: true",
        _set("studies.sizes.workload.enforce_eager", True),
        SIZES_SMALL | SIZES_BIG,
    ),
    (
        "studies.disagg.workload.max_num_batched_tokens: 16384",
        _set("studies.disagg.workload.max_num_batched_tokens", 16384),
        DISAGG,
    ),
    (f"models.{BIG}.quantization: awq", _set(f"models.{BIG}.quantization", "awq"), SIZES_BIG),
    (
        f"{ARCH_FILE}: num_hidden_layers 40",
        _edit_json(ARCH_FILE, "num_hidden_layers", 40),
        SIZES_BIG,
    ),
    (f"{ARCH_FILE}: a key the engine ignores", _edit_json(ARCH_FILE, "torch_dtype", "x"), NONE),
    (f"{DATASET}: another line", _rewrite_dataset('{"input_len": 900, "output_len": 6}\n'), REPLAY),
    (f"{DATASET}: rewritten, same bytes", _rewrite_dataset(None), NONE),
    (
        f"models.{SMALL}.hf_id (token counter of text datasets)",
        _set(f"models.{SMALL}.hf_id", "x/y"),
        REPLAY,
    ),
    (f"models.{SMALL}.gpus: [[1], [5]]", _set(f"models.{SMALL}.gpus", [[1], [5]]), NONE),
    ("slo.ttft.max_ms: 1000", _set("slo.ttft.max_ms", 1000), NONE),
    ("studies.sizes.title", _set("studies.sizes.title", "Sizes"), NONE),
    ("ports.proxy: 9090", _set("ports.proxy", 9090), NONE),
    ("deploy.startup_timeout_s: 60", _set("deploy.startup_timeout_s", 60), NONE),
]


def planned_cells(dry_run_stdout: str) -> set[str]:
    """The traces of the cell jobs a dry run plans."""
    cells, rule = set(), None
    for line in dry_run_stdout.splitlines():
        if match := re.match(r"(?:local)?rule (\w+):$", line):
            rule = match.group(1)
        elif rule == "simulate_cell" and (match := re.match(r"\s+output: (\S+)$", line)):
            cells.add(match.group(1))
    return cells


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    from tests.conftest import SMALL_CONFIG

    config = _config(SMALL_CONFIG)
    workdir = copy_workflow(tmp_path_factory.mktemp("reruns"), config)
    (workdir / ARCH_FILE).parent.mkdir(parents=True)
    shutil.copy(architecture_dir("qwen2.5-14b") / "config.json", workdir / ARCH_FILE)
    (workdir / DATASET).parent.mkdir(parents=True)
    (workdir / DATASET).write_text(
        '{"input_len": 1000, "output_len": 6}\n{"input_len": 500, "output_len": 4}\n'
    )
    run = snakemake(workdir, "--cores", "1", "all")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Shell command: None" not in run.stdout + run.stderr  # script rules have none
    dry = snakemake(workdir, "-n", "--cores", "1", "all")
    assert "Nothing to be done" in dry.stdout + dry.stderr
    return workdir, config


def test_a_changed_setting_plans_exactly_its_cells(finished, capsys):
    workdir, config = finished
    saved = {name: (workdir / name).read_bytes() for name in (ARCH_FILE, DATASET)}
    rows, wrong = [], []
    for setting, change, expected in CHANGES:
        change(workdir, copy.deepcopy(config))
        try:
            dry = snakemake(workdir, "-n", "--cores", "1", "all")
            assert dry.returncode == 0, dry.stderr[-3000:]
            planned = planned_cells(dry.stdout)
        finally:
            write_config(workdir, config)
            for name, content in saved.items():
                if (workdir / name).read_bytes() != content:
                    (workdir / name).write_bytes(content)
        rows.append((setting, len(planned), sorted(p.removeprefix(CELLS + "/") for p in planned)))
        if planned != expected:
            wrong.append((setting, sorted(planned ^ expected)))
    with capsys.disabled():
        print("\n| setting changed | cells planned | which |\n|---|---|---|")
        for setting, count, which in rows:
            names = ", ".join(which) if 0 < count < len(EVERY) else ("all" if count else "none")
            print(f"| {setting} | {count} of {len(EVERY)} | {names} |")
    assert not wrong
