from __future__ import annotations

import pytest

from servematrix import config
from servematrix.config import ConfigError


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
    assert config.Cell.from_dict(cell.to_dict()) == cell


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
    with pytest.raises(ConfigError) as caught:
        config.load(_break(small_config, path, value))
    assert caught.value.key_path == key_path
    assert words in str(caught.value)


def test_two_instance_mode_needs_two_pins(small_config):
    small_config["studies"]["sizes"]["modes"] = ["chunked"]
    with pytest.raises(ConfigError, match=r"studies\.sizes\.modes\[0\].*pins only 1"):
        config.load(small_config)


def test_shared_cell_with_conflicting_settings_is_rejected(small_config):
    small_config["studies"]["other"] = {
        **small_config["studies"]["sizes"],
        "workload": {"burstiness": 2.0},
    }
    with pytest.raises(ConfigError, match="also in study"):
        config.load(small_config)


def test_wildcard_pattern_escapes_names():
    import re

    pattern = config.wildcard_pattern(["Qwen2.5-7B", "Qwen2.5-7B-GPTQ"])
    assert re.fullmatch(pattern, "Qwen2.5-7B-GPTQ")
    assert not re.fullmatch(pattern, "Qwen2x5-7B")
