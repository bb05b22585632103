"""Config ``prefix_caching``: the recipes' flag, the cell's path and fingerprint, and the same
engine behind it in the simulator and the emulator (hits for shared prefixes only)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from servematrix.deploy.recipes import plan
from servematrix.emulator.prefixes import request_fields
from servematrix.simulate import engine_setup, simulate
from servematrix.spec import config
from servematrix.spec.matrix import Cell, ConfigError, Workload
from servematrix.workload import TokenCounter, build_requests

MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


def sonnet_file(directory: Path) -> str:
    path = directory / "sonnet.txt"
    lines = [
        f"Line {k} of the poem, with words that differ: {'abc ' * (k % 7)}end.\n" for k in range(80)
    ]
    path.write_text("".join(lines))
    return str(path)


def study_config(small_config: dict, recipe: str, caching: bool | None, **workload) -> dict:
    """One study of single-instance cells; ``caching`` None leaves the setting out."""
    small_config["studies"] = {
        "apc": {
            "recipe": recipe,
            "models": [MODEL],
            "modes": ["single", "mooncake-tcp"],
            "qps": [2],
            "input_len": [1024],
            "workload": {"num_prompts": 30, **workload},
        }
    }
    if caching is not None:
        small_config["studies"]["apc"]["workload"]["prefix_caching"] = caching
    return small_config


def cells(small_config, recipe, caching, **workload) -> list[Cell]:
    return list(config.load(study_config(small_config, recipe, caching, **workload)).all_cells())


def server_argvs(cell: Cell, backend: str) -> list[tuple[str, ...]]:
    return [p.argv for p in plan(cell, backend).processes if p.name not in ("proxy", "etcd")]


@pytest.mark.parametrize("recipe", ["v0", "v1"])
@pytest.mark.parametrize("backend", ["vllm", "emulator"])
def test_prefix_caching_passes_the_flag_and_gets_its_own_path(small_config, recipe, backend):
    import copy

    default = cells(copy.deepcopy(small_config), recipe, None)
    off = cells(copy.deepcopy(small_config), recipe, False)
    on = cells(small_config, recipe, True)
    assert off == default and all(not c.serving.prefix_caching for c in off)
    for cell_off, cell_on in zip(off, on, strict=True):
        # The default path is unchanged; caching on adds _apc to the file name.
        assert "_apc" not in cell_off.path
        assert cell_on.path == cell_off.path.replace(".parquet", "_apc.parquet")
        assert cell_on.to_dict()["serving"]["prefix_caching"] is True
        assert "prefix_caching" not in cell_off.to_dict()["serving"]  # parameters as before
        assert Cell.from_dict(cell_on.to_dict()) == cell_on
        assert Cell.from_dict(cell_off.to_dict()) == cell_off
        for argv in server_argvs(cell_on, backend):
            assert argv.count("--enable-prefix-caching") == 1
            assert "--no-enable-prefix-caching" not in argv
        for argv in server_argvs(cell_off, backend):
            assert "--enable-prefix-caching" not in argv
            assert ("--no-enable-prefix-caching" in argv) == (recipe == "v1")
        # A warm deployment with the other setting is never reused.
        assert plan(cell_on, backend).fingerprint != plan(cell_off, backend).fingerprint


def test_v1_asks_for_caching_where_it_turned_it_off_v0_after_the_published_line(small_config):
    import copy

    v1_off, v1_on = (cells(copy.deepcopy(small_config), "v1", c)[0] for c in (False, True))
    (argv_off,), (argv_on,) = server_argvs(v1_off, "vllm"), server_argvs(v1_on, "vllm")
    at = argv_off.index("--no-enable-prefix-caching")
    assert argv_on == (*argv_off[:at], "--enable-prefix-caching", *argv_off[at + 1 :])
    v0_off, v0_on = (cells(copy.deepcopy(small_config), "v0", c)[0] for c in (False, True))
    (argv_off,), (argv_on,) = server_argvs(v0_off, "vllm"), server_argvs(v0_on, "vllm")
    at = argv_on.index("--enable-prefix-caching")
    assert argv_on[:at] + argv_on[at + 1 :] == argv_off
    assert argv_on[at + 1 : at + 3] == ("--host", "127.0.0.1")


def test_prefix_caching_must_be_a_boolean(small_config):
    small_config["defaults"]["prefix_caching"] = "yes"
    with pytest.raises(ConfigError) as error:
        config.load(small_config)
    assert error.value.key_path == "defaults.prefix_caching"


def test_engine_follows_the_setting(small_config):
    import copy

    for recipe in ("v0", "v1"):
        for caching in (False, True):
            cell = cells(copy.deepcopy(small_config), recipe, caching)[0]
            assert engine_setup(cell).scheduler.prefix_caching is caching


def ttft_ms(records) -> np.ndarray:
    return np.array([(r.first_token_s - r.sent_s) * 1e3 for r in records if not r.warmup])


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_simulated_sonnet_cells_hit_the_cache_random_cells_do_not(small_config, tmp_path, recipe):
    import copy

    sonnet = {"dataset": "sonnet", "dataset_path": sonnet_file(tmp_path), "prefix_len": 600}
    for mode in (0, 1):  # single, mooncake-tcp
        name = ("single", "mooncake-tcp")[mode]
        off = simulate(cells(copy.deepcopy(small_config), recipe, False, **sonnet)[mode])
        on = simulate(cells(copy.deepcopy(small_config), recipe, True, **sonnet)[mode])
        mean_on, mean_off = ttft_ms(on.records).mean(), ttft_ms(off.records).mean()
        print(f"{recipe} {name}: {mean_off:.1f} -> {mean_on:.1f} ms")
        assert mean_on < 0.9 * mean_off
        random_off = simulate(cells(copy.deepcopy(small_config), recipe, False)[mode])
        random_on = simulate(cells(copy.deepcopy(small_config), recipe, True)[mode])
        assert random_on.records == random_off.records


def test_a_prompt_is_one_segment_per_full_block_keyed_by_its_chain():
    first = request_fields(list(range(10)), block_size=4)  # 2 full blocks
    assert first["prefix_tokens"] == 8 and first["prefix_segment_blocks"] == 1
    assert request_fields(list(range(10)), block_size=4) == first  # the same prompt, same keys
    diverging = request_fields([0, 1, 2, 3, 4, 5, 9, 9, 9], block_size=4)["prefix_chain"]
    assert diverging[0] == first["prefix_chain"][0] and diverging[1] != first["prefix_chain"][1]
    # The same tokens after a different first block are another prefix (vLLM chains hashes).
    later = request_fields([9, 9, 9, 9, 4, 5, 6, 7], block_size=4)["prefix_chain"]
    assert later[1] != first["prefix_chain"][1]
    assert request_fields([0, 1, 2], block_size=4) == {}  # shorter than a block


def test_shared_system_prompts_have_their_own_path_and_hit_the_cache(small_config):
    """Random prompts that start with one of four 512-token system prompts: a cell path of
    their own, and with caching each system prompt is computed about once."""
    import copy

    shared = {"prefix_len": 512, "prefix_groups": 4}
    off, on = (cells(copy.deepcopy(small_config), "v1", c, **shared)[0] for c in (False, True))
    plain = cells(copy.deepcopy(small_config), "v1", False)[0]
    assert off.path == plain.path.replace(".parquet", "_p512_g4.parquet")
    assert "prefix_groups" not in plain.to_dict()["workload"]  # parameters as before
    assert Cell.from_dict(on.to_dict()) == on
    mean_on, mean_off = ttft_ms(simulate(on).records).mean(), ttft_ms(simulate(off).records).mean()
    assert mean_on < 0.8 * mean_off


def test_prefix_groups_need_random_prompts_with_a_prefix(small_config, tmp_path):
    import copy

    for workload in ({"prefix_groups": 2}, {"dataset": "sonnet", "prefix_len": 600,
                     "dataset_path": sonnet_file(tmp_path), "prefix_groups": 2}):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            cells(copy.deepcopy(small_config), "v1", False, **workload)
        assert error.value.key_path == "studies.apc.workload.prefix_groups"
        assert "random dataset with a prefix_len" in str(error.value)


# The emulator as a real process (tests/test_emulator_e2e.py's helpers).


async def _ttft_s(url: str, prompt: str) -> float:
    from tests.test_emulator_e2e import MODEL as HF_MODEL

    body = {"model": HF_MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            async for _ in response.content.iter_any():
                first = time.monotonic() - start
                break
            await response.read()
    return first


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--enable-prefix-caching", "--no-enable-prefix-caching"])
def test_emulator_serves_a_repeated_sonnet_prompt_faster_with_caching(tmp_path, flag):
    from tests.test_emulator_e2e import MODEL as HF_MODEL
    from tests.test_emulator_e2e import emulator

    workload = Workload(
        1.0, 6000, 2, 2, 0, "sonnet", 1.0, 0, dataset_path=sonnet_file(tmp_path), prefix_len=5000
    )
    counter = TokenCounter.for_model(HF_MODEL)
    first, other = (r.prompt for r in build_requests(workload, 1000, counter))
    with emulator("--max-model-len", "10000", "--recipe", "v1", flag) as (url, _):
        ttfts = [asyncio.run(_ttft_s(url, prompt)) for prompt in (first, first, other)]
    print(flag, [f"{t * 1e3:.1f} ms" for t in ttfts])
    if flag == "--enable-prefix-caching":
        assert ttfts[1] < 0.4 * ttfts[0]  # every full block cached
        assert ttfts[2] < 0.6 * ttfts[0]  # the shared preamble cached
    else:
        assert 0.7 * ttfts[0] < ttfts[1] < 1.4 * ttfts[0]
        assert 0.7 * ttfts[0] < ttfts[2] < 1.4 * ttfts[0]


@pytest.mark.slow
def test_reset_prefix_cache_empties_the_emulators_cache_in_dev_mode_only(tmp_path):
    from tests.test_emulator_e2e import MODEL as HF_MODEL
    from tests.test_emulator_e2e import emulator

    workload = Workload(1.0, 6000, 2, 1, 0, "sonnet", 1.0, 0, dataset_path=sonnet_file(tmp_path))
    (prompt,) = (r.prompt for r in build_requests(workload, 1000, TokenCounter.for_model(HF_MODEL)))
    flags = ("--max-model-len", "10000", "--recipe", "v1", "--enable-prefix-caching")
    with emulator(*flags, env={"VLLM_SERVER_DEV_MODE": "1"}) as (url, _):
        cold, hit = (asyncio.run(_ttft_s(url, prompt)) for _ in range(2))
        assert _get_json(url + "/servematrix/kv_cache")["used_blocks"] > 0
        assert _post_json(url + "/reset_prefix_cache") == (200, {"success": True})
        assert _get_json(url + "/servematrix/kv_cache")["used_blocks"] == 0
        after_reset = asyncio.run(_ttft_s(url, prompt))
    assert hit < 0.4 * cold
    assert 0.7 * cold < after_reset < 1.4 * cold
    with emulator(*flags) as (url, _):
        assert _post_json(url + "/reset_prefix_cache")[0] == 404  # 0.33 outside dev mode


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_a_warm_deployment_that_caches_starts_each_cell_with_an_empty_cache(tmp_path, recipe):
    """v1 empties the cache of a reused deployment through /reset_prefix_cache; vLLM 0.6 has
    no such route, so a v0 deployment that caches prefixes starts fresh for the next cell."""
    from servematrix.deploy import warm
    from tests.test_emulator_cell import LARGE_POOL, _cell

    workload = Workload(1.0, 2000, 2, 1, 0, "random", 1.0, 0)
    serving = replace(LARGE_POOL, prefix_caching=True)
    cell = _cell(workload, tmp_path / "state", recipe=recipe, serving=serving, warm_deployment=True)
    settings, state_dir, log_dir = warm.settings_for(cell)
    deployment = plan(cell)
    server = deployment.base_url.removesuffix("/v1")
    try:
        lease = warm.acquire(deployment, state_dir, log_dir, settings)
        assert lease.fresh
        asyncio.run(_ttft_s(server, "word " * 1500))
        assert _get_json(server + "/servematrix/kv_cache")["used_blocks"] > 0  # cached
        lease.release()
        again = warm.acquire(deployment, state_dir, log_dir, settings)
        assert again.fresh == (recipe == "v0")
        assert _get_json(server + "/servematrix/kv_cache")["used_blocks"] == 0
        again.release()
    finally:
        warm.stop_all(state_dir, 10)


def _post_json(url: str) -> tuple[int, dict | None]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST")) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, None


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url) as response:
        return json.loads(response.read())
