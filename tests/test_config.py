from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from servematrix.spec import config
from servematrix.spec.matrix import (
    MODES,
    WORKLOAD_TOKEN_PATTERN,
    Cell,
    ConfigError,
    wildcard_pattern,
)
from servematrix.spec.topology import TOPOLOGY_PATTERN
from servematrix.workflow import check_config
from tests.conftest import ROOT


def test_default_config_has_every_study_of_the_design(default_config):
    cfg = config.load(default_config)
    assert set(cfg.studies) == {
        "mooncake",
        "mooncake-v1",
        "quantization",
        "model-size",
        "command-r-qps",
        "command-r-input",
    }
    assert cfg.studies["mooncake"].recipe == "v0"
    assert cfg.studies["mooncake-v1"].recipe == "v1"
    assert cfg.studies["command-r-input"].x == "input_len"
    assert "c4ai-command-r7b-12-2024" in cfg.studies["command-r-qps"].models
    # 72B TP 4 on GPUs 0-3 and 4-7; the GPTQ 7B on GPU 0 and GPU 4 (design, Study A).
    assert cfg.models["Qwen2.5-72B-Instruct"].gpus == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert cfg.models["Qwen2.5-7B-Instruct-GPTQ-Int4"].gpus == ((0,), (4,))


def test_defaults_are_filled_from_the_schema(small_config):
    cell = config.load(small_config).studies["disagg"].cells[0]
    assert cell.serving.max_model_len == 10000
    assert cell.serving.gpu_memory_utilization == 0.8
    assert cell.workload.burstiness == 1.0
    assert cell.workload.dataset == "random"
    assert cell.engine["gpu"] == "A100-SXM4-80GB"


def test_cell_paths_follow_the_design(small_config):
    paths = [c.path for c in config.load(small_config).studies["disagg"].cells]
    assert paths[0] == (
        "results/simulator/cells/v0/Qwen2.5-7B-Instruct-GPTQ-Int4/nondisagg/"
        "qps2_in1024_out6_n20_s0.parquet"
    )
    assert len(paths) == 4


def test_shared_cells_are_measured_once(small_config):
    small_config["studies"]["sizes"]["modes"] = ["single"]
    small_config["studies"]["again"] = dict(small_config["studies"]["sizes"])
    cfg = config.load(small_config)
    assert len(cfg.all_cells()) == 4 + 4


def test_a_model_can_force_its_recipe(default_config):
    cfg = config.load(default_config)
    recipes = {c.model.name: c.recipe for c in cfg.studies["command-r-qps"].cells}
    assert recipes["c4ai-command-r7b-12-2024"] == "v1"
    assert recipes["c4ai-command-r-08-2024"] == "v0"


def test_cell_round_trips_through_a_dict(small_config):
    cell = config.load(small_config).studies["disagg"].cells[3]
    assert Cell.from_dict(cell.to_dict()) == cell


def _break(cfg, path, value):
    node = cfg
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return cfg


@pytest.mark.parametrize(
    ("path", "value", "key_path", "words"),
    [
        (("studies", "disagg", "models"), ["nope"], "studies.disagg.models[0]", "unknown model"),
        (("studies", "disagg", "qps"), [2, -4], "studies.disagg.qps[1]", "minimum"),
        (("studies", "disagg", "modes"), ["turbo"], "studies.disagg.modes[0]", "turbo"),
        (
            ("models", "Qwen2.5-14B-Instruct", "tensor_parallel"),
            2,
            "models.Qwen2.5-14B-Instruct.gpus[0]",
            "tensor_parallel is 2",
        ),
        (
            ("models", "Qwen2.5-7B-Instruct-GPTQ-Int4", "gpus"),
            [[0], [0]],
            "models.Qwen2.5-7B-Instruct-GPTQ-Int4.gpus[1]",
            "pinned twice",
        ),
        (("defaults", "num_prompts"), "many", "defaults.num_prompts", "not of type"),
        (("studies", "sizes", "input_len"), [9999], "studies.sizes.input_len", "max_model_len"),
        (("backend",), "tgi", "backend", "tgi"),
        (("studies", "disagg", "colour"), "red", "studies.disagg", "colour"),
    ],
)
def test_bad_config_names_the_key_path(small_config, path, value, key_path, words):
    """The config check (`servematrix check`, the workflow); a backend's name is the
    registry's to accept (servematrix.backends), not the schema's."""
    with pytest.raises(ConfigError) as caught:
        check_config(_break(small_config, path, value))
    assert caught.value.key_path == key_path
    assert words in str(caught.value)


def test_two_instance_mode_needs_two_pins(small_config):
    small_config["studies"]["sizes"]["modes"] = ["chunked"]
    with pytest.raises(ConfigError, match=r"studies\.sizes\.modes\[0\].*pins only 1"):
        config.load(small_config)


def test_the_schema_accepts_every_mode_and_no_other():
    schema = yaml.safe_load(config.SCHEMA_PATH.read_text())
    study = schema["properties"]["studies"]["additionalProperties"]
    named, spelled = study["properties"]["modes"]["items"]["anyOf"]
    assert named["enum"] == list(MODES)
    assert spelled["pattern"] == f"^({TOPOLOGY_PATTERN})$"  # or a topology's spelling


def test_the_docs_define_every_mode():
    """docs/configuration.md's "Modes" has a row per mode: instances, proxy, chunked prefill
    per recipe, KV; the README's short table names each mode too."""
    readme = (ROOT / "docs" / "configuration.md").read_text()
    section = readme.split("\n### Modes\n", 1)[1].split("\n#", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    assert [row[0].strip("| `") for row in rows] == list(MODES)
    assert all(len(row) == 6 and all(cell.strip() for cell in row) for row in rows)
    tour = (ROOT / "README.md").read_text().split("\n## Modes\n", 1)[1].split("\n#", 1)[0]
    assert all(f"`{mode}`" in tour for mode in MODES)


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_one_gpu_compares_plain_and_chunked_prefill(small_config, recipe):
    """single-plain and single-chunked each run one instance on the model's first pin, so a
    one-GPU model compares the two; ``single`` leaves it to the recipe's vLLM (off in 0.6 at
    max_model_len 10000, on in V1)."""
    small_config["studies"]["sizes"] |= {
        "recipe": recipe,
        "models": ["Qwen2.5-14B-Instruct"],
        "modes": ["single", "single-plain", "single-chunked"],
        "input_len": [1024],
    }
    cells = config.load(small_config).studies["sizes"].cells
    chunked = {c.mode.name: c.chunked_prefill for c in cells}
    assert chunked == {"single": recipe == "v1", "single-plain": False, "single-chunked": True}
    assert {c.instance_gpus for c in cells} == {((0,),)}
    assert cells[1].path.endswith("/single-plain/qps4_in1024_out6_n20_s0.parquet")


def test_shared_cell_with_conflicting_settings_is_rejected(small_config):
    small_config["studies"]["other"] = {
        **small_config["studies"]["sizes"],
        "workload": {"gpu_memory_utilization": 0.7},
    }
    with pytest.raises(ConfigError, match="also in study"):
        config.load(small_config)


def test_wildcard_pattern_escapes_names():
    import re

    pattern = wildcard_pattern(["Qwen2.5-7B", "Qwen2.5-7B-GPTQ"])
    assert re.fullmatch(pattern, "Qwen2.5-7B-GPTQ")
    assert not re.fullmatch(pattern, "Qwen2x5-7B")


def test_qps_inf_is_a_load_spelled_qpsinf(small_config):
    small_config["studies"]["disagg"]["qps"] = [2, float("inf")]
    cells = config.load(small_config).studies["disagg"].cells
    assert cells[1].workload.qps == float("inf")
    assert cells[1].path.endswith("/nondisagg/qpsinf_in1024_out6_n20_s0.parquet")
    assert Cell.from_dict(json.loads(json.dumps(cells[1].to_dict()))) == cells[1]


WORKLOAD_ERRORS = [
    (
        {"studies.disagg.qps": [2, float("nan")]},
        "config error at studies.disagg.qps[1]: nan is not of type 'number'",
    ),
    (
        {"defaults.max_concurrency": 0},
        "config error at defaults.max_concurrency: 0 is less than the minimum of 1",
    ),
    (
        {"defaults.max_concurrency": 2.5},
        "config error at defaults.max_concurrency: 2.5 is not of type 'integer'",
    ),
    (
        {"defaults.range_ratio": 1},
        "config error at defaults.range_ratio: 1 is greater than or equal to the maximum of 1",
    ),
    (
        {"defaults.range_ratio": -0.1},
        "config error at defaults.range_ratio: -0.1 is less than the minimum of 0",
    ),
    (
        {"defaults.dataset": "sharegpt"},
        "config error at defaults.dataset: 'sharegpt' is not one of "
        "['random', 'sonnet', 'jsonl', 'mooncake']",
    ),
    (
        {"studies.sizes.workload": {"dataset": "sonnet"}},
        "config error at studies.sizes.workload.dataset: dataset 'sonnet' needs a dataset_path",
    ),
    (
        {"defaults.dataset": "jsonl", "defaults.dataset_path": "no/such.jsonl"},
        "config error at defaults.dataset_path: dataset file no/such.jsonl does not exist",
    ),
    (
        {"defaults.dataset_path": "x.txt"},
        "config error at defaults.dataset_path: the random dataset reads no file",
    ),
    (
        {"defaults.prefix_groups": 2},
        "config error at defaults.prefix_groups: applies to the random dataset with a prefix_len "
        "only",
    ),
    (
        {"studies.sizes.workload": {"range_ratio": 0.9}},
        "config error at studies.sizes.input_len: input 1946 + output 12 (range_ratio 0.9) "
        "exceeds max_model_len 1024",
    ),
    (
        {"defaults.burstiness": float("nan")},
        "config error at defaults.burstiness: nan is not of type 'number'",
    ),
]


def _set(cfg: dict, changes: dict) -> dict:
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return cfg


@pytest.mark.parametrize(("changes", "message"), WORKLOAD_ERRORS)
def test_bad_workload_settings_name_the_key(small_config, changes, message):
    small_config["defaults"]["max_model_len"] = 1024
    small_config["studies"]["disagg"]["input_len"] = [512]
    with pytest.raises(ConfigError) as caught:
        config.load(_set(small_config, changes))
    assert str(caught.value) == message


def test_text_datasets_need_their_settings_to_apply(small_config, tmp_path):
    poem = tmp_path / "sonnet_4x.txt"
    poem.write_text("line\n")
    _set(small_config, {"defaults.dataset": "sonnet", "defaults.dataset_path": str(poem)})
    with pytest.raises(ConfigError, match=r"^config error at defaults\.range_ratio: applies to"):
        config.load(_set(copy.deepcopy(small_config), {"defaults.range_ratio": 0.2}))
    with pytest.raises(ConfigError, match=r"studies\.sizes\.input_len: input 512 must be longer"):
        config.load(_set(small_config, {"studies.sizes.workload": {"prefix_len": 512}}))


@pytest.mark.parametrize(
    ("settings", "suffix"),
    [
        ({}, ""),
        ({"max_concurrency": 8}, "_c8"),
        ({"range_ratio": 0.25}, "_r0.25"),
        ({"burstiness": 0.5}, "_b0.5"),
        ({"warmup_requests": 0}, "_w0"),
        ({"ignore_eos": False}, "_eos"),
        ({"dataset": "jsonl", "dataset_path": "DATA/share gpt_v3.jsonl"}, "_jsonl-share-gpt-v3"),
        (
            {"dataset": "sonnet", "dataset_path": "DATA/sonnet_4x.txt", "prefix_len": 50},
            "_sonnet-sonnet-4x_p50",
        ),
        ({"max_concurrency": 1, "range_ratio": 0.5, "burstiness": 2}, "_r0.5_b2_c1"),
        ({"prefix_caching": True}, "_apc"),
        ({"prefix_caching": False}, ""),
        ({"max_concurrency": 8, "prefix_caching": True}, "_c8_apc"),
    ],
)
def test_non_default_workloads_get_their_own_path(small_config, tmp_path, settings, suffix):
    for key in ("dataset_path",):
        if key in settings:
            path = tmp_path / settings[key].removeprefix("DATA/")
            path.write_text("line\n")
            settings = {**settings, key: str(path)}
    small_config["studies"]["sizes"]["workload"] = settings
    cfg = config.load(small_config)
    path = cfg.studies["sizes"].cells[0].path
    assert path == (
        "results/simulator/cells/v0/Qwen2.5-7B-Instruct-GPTQ-Int4/single/"
        f"qps4_in512_out6_n20_s0{suffix}.parquet"
    )
    assert re.fullmatch(WORKLOAD_TOKEN_PATTERN, Path(path).stem)
    assert cfg.cell_at(path) == cfg.studies["sizes"].cells[0]


def test_studies_differing_only_in_concurrency_keep_both_cells(small_config):
    small_config["studies"]["capped"] = {
        **small_config["studies"]["sizes"],
        "workload": {"max_concurrency": 4},
    }
    cfg = config.load(small_config)
    assert len(cfg.all_cells()) == 4 + 4 + 4
    capped = {c.path for c in cfg.studies["capped"].cells}
    assert not capped & {c.path for c in cfg.studies["sizes"].cells}


def test_a_study_may_name_its_question(small_config, default_config):
    small_config["studies"]["sizes"]["question"] = "input_len"
    assert config.load(small_config).studies["sizes"].question == "input_len"
    assert config.load(small_config).studies["disagg"].question is None
    assert config.load(default_config).studies["command-r-input"].question == "input_len"


@pytest.mark.parametrize(
    ("question", "message"),
    [
        (
            "modes",
            "config error at studies.sizes.question: 'modes' compares the study's modes, but it "
            "lists one (single): list two or more, or drop question",
        ),
        (
            "speed",
            "config error at studies.sizes.question: 'speed' is not one of "
            "['modes', 'models', 'input_len']",
        ),
    ],
)
def test_a_question_the_study_cannot_answer_is_one_clear_error(small_config, question, message):
    small_config["studies"]["sizes"]["question"] = question
    with pytest.raises(ConfigError) as error:
        config.load(small_config)
    assert str(error.value) == message
