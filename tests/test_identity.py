"""A cell's identity (what Snakemake compares): every input of its result, per backend."""

from __future__ import annotations

import copy
import json

import pytest

from servematrix.backends.identity import cell_identity, identity_document
from servematrix.spec import config

CELL = 0  # the first cell of the study "sizes" (single instance)


def _identity(raw: dict, backend: str, **changes) -> str:
    raw = copy.deepcopy(raw)
    raw["backend"] = backend
    if backend == "external":
        raw["base_url"] = "http://127.0.0.1:8000/v1"
    for path, value in changes.items():
        *parents, key = path.split("__")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value
    return cell_identity(config.load(raw).studies["sizes"].cells[CELL])


SMALL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


@pytest.mark.parametrize(
    ("backend", "change", "changes_identity"),
    [
        ("simulator", {"engine__gpu": "H100-SXM5-80GB"}, True),
        ("simulator", {"ports__single": 9000}, False),
        ("simulator", {"deploy__startup_timeout_s": 5}, False),
        ("simulator", {"slo__ttft__max_ms": 5}, False),
        ("emulator", {"engine__gpu": "H100-SXM5-80GB"}, True),
        ("emulator", {"ports__single": 9000}, True),  # in the server's command line
        ("emulator", {"deploy__host": "0.0.0.0"}, True),
        ("emulator", {"deploy__idle_timeout_s": 5}, False),
        ("emulator", {"deploy__startup_timeout_s": 5}, False),
        ("vllm", {"engine__gpu": "H100-SXM5-80GB"}, False),  # real GPUs: the engine is not used
        ("vllm", {"engine__kv_buffer_size": 1e9}, False),  # v0 single passes no KV config
        ("vllm", {"defaults__gpu_memory_utilization": 0.5}, True),
        ("vllm", {"ports__single": 9000}, True),
        ("external", {"ports__single": 9000}, False),
        ("external", {"engine__gpu": "H100-SXM5-80GB"}, False),
        ("external", {"base_url": "http://127.0.0.1:9000/v1"}, True),
        ("external", {"defaults__max_model_len": 8192}, True),
    ],
)
def test_identity_holds_what_the_result_depends_on(small_config, backend, change, changes_identity):
    before = _identity(small_config, backend)
    after = _identity(small_config, backend, **change)
    assert (before != after) is changes_identity


def test_pins_change_a_deployed_cell_only(small_config):
    pins = {f"models__{SMALL}__gpus": [[3], [4]]}
    assert _identity(small_config, "simulator") == _identity(small_config, "simulator", **pins)
    for backend in ("emulator", "vllm"):
        assert _identity(small_config, backend) != _identity(small_config, backend, **pins)


def test_identity_is_canonical_json_with_the_architecture_content(small_config):
    text = _identity(small_config, "simulator")
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    document = json.loads(text)
    assert document["model"]["architecture"]["num_layers"] == 28
    assert "gpus" not in document["model"] and "hf_id" not in document["model"]


def test_a_dataset_file_is_identified_by_its_content(small_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"input_len": 10, "output_len": 2}\n')
    small_config["defaults"].update(dataset="jsonl", dataset_path="a.jsonl")
    cell = config.load(small_config).studies["sizes"].cells[CELL]
    first = identity_document(cell)["workload"]["dataset_sha256"]
    (tmp_path / "a.jsonl").write_text('{"input_len": 11, "output_len": 2}\n')
    assert identity_document(cell)["workload"]["dataset_sha256"] != first
