"""Mooncake trace replay: the reader's errors, the window, the prompts every backend sends, the
reuse bound, and the prefix-cache hits the simulator and the emulator report for a window."""

from __future__ import annotations

import asyncio
import json
import math
import re
import urllib.request
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from servematrix.simulate import simulate
from servematrix.spec import config
from servematrix.spec.matrix import ConfigError, Workload
from servematrix.workload import (
    WorkloadError,
    build_requests,
    measured_sends,
    replay,
    request_lengths,
)
from servematrix.workload.replay import TraceRequest

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "config" / "examples" / "data" / "mooncake-conversation-1000.jsonl"
MODEL = "Qwen2.5-7B-Instruct-GPTQ-Int4"


def write_trace(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def row(timestamp: int, input_len: int, ids: list[int], output_len: int = 3) -> dict:
    return {
        "timestamp": timestamp,
        "input_length": input_len,
        "output_length": output_len,
        "hash_ids": ids,
    }


def trace_workload(path: str, n: int, cap: int = 100_000, **fields) -> Workload:
    return Workload(1.0, cap, 2000, n, 0, "mooncake", 1.0, 0, dataset_path=path, **fields)


def test_two_requests_share_exactly_the_blocks_their_hash_ids_share(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [row(0, 1300, [7, 8, 9]), row(5, 1200, [7, 8, 4]), row(9, 600, [5, 6])],
    )
    # The client's path (build_requests: what the load generator sends on vllm, emulator and
    # external); the simulator reads the same window's lengths and chains.
    first, second, third = (r.prompt for r in build_requests(trace_workload(path, 3), 1000))
    assert (len(first), len(second), len(third)) == (1300, 1200, 600)
    assert first[:1024] == second[:1024]  # blocks 7 and 8
    assert first[1024:1200] != second[1024:1200]  # block 9 vs 4: a different tail
    assert first[:512] != third[:512]
    assert all(0 <= t < 1000 for t in first)
    again = [r.prompt for r in build_requests(trace_workload(path, 3), 1000)]
    assert again == [first, second, third]  # the same file and seed: the same prompts
    lengths = request_lengths(trace_workload(path, 3))
    assert lengths.input_lens == [1300, 1200, 600]
    chains = lengths.prefix_chains
    assert chains[0][:2] == chains[1][:2] and chains[0][2] != chains[1][2]
    assert not set(chains[2]) & set(chains[0])


def test_a_block_id_after_a_different_prefix_is_another_chain():
    requests = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(0, 1024, 1, (3, 2))]
    (a, b) = replay.engine_chains(requests)
    assert a[1] != b[1]
    assert replay.reuse_bound(requests).hit_tokens == 0


def test_the_reuse_bound_counts_whole_blocks_of_earlier_prefixes():
    requests = [
        TraceRequest(0, 1300, 1, (7, 8, 9)),  # nothing before it
        TraceRequest(0, 1200, 1, (7, 8, 4)),  # blocks 7, 8: 1024 tokens
        TraceRequest(0, 1300, 1, (7, 8, 9)),  # all of it but the last token's block: 1296
        TraceRequest(0, 1100, 1, (7, 8, 9)),  # the partial block 9 (76 tokens): 64 of them
    ]
    bound = replay.reuse_bound(requests)
    assert bound.hit_tokens == 1024 + 1296 + (1024 + 64)
    assert bound.query_tokens == 1300 + 1200 + 1300 + 1100
    assert bound.hit_rate == pytest.approx(bound.hit_tokens / bound.query_tokens)


def test_the_window_drops_or_truncates_long_requests_and_counts_them(tmp_path):
    rows = [row(0, 600, [1, 2]), row(1000, 2000, [1, 3, 4, 5]), row(2000, 700, [6, 7])]
    rows += [row(4000, 100, [8])]
    requests = replay.read_trace(write_trace(tmp_path / "t.jsonl", rows))
    dropped = replay.window(requests, 0.0, 3, 1024)
    assert [r.input_len for r in dropped.requests] == [600, 700, 100]
    assert (dropped.dropped, dropped.truncated) == (1, 0)
    cut = replay.window(requests, 0.0, 3, 1024, "truncate")
    assert [r.input_len for r in cut.requests] == [600, 1024, 700]
    assert cut.requests[1].hash_ids == (1, 3) and cut.truncated == 1
    late = replay.window(requests, 1.5, 2, 1024)
    assert [r.timestamp_ms for r in late.requests] == [2000, 4000]
    with pytest.raises(replay.TraceError, match="has 2 requests within the input cap"):
        replay.window(requests, 1.0, 3, 1024)


def test_send_times_keep_the_arrival_pattern_scaled_to_the_qps(tmp_path):
    rows = [row(1000, 100, [1]), row(1000, 100, [2]), row(3000, 100, [3]), row(5000, 100, [4])]
    path = write_trace(tmp_path / "t.jsonl", rows)
    native = replay.native_rate(replay.read_trace(path))
    assert native == pytest.approx(3 / 4.0)
    w = trace_workload(path, 4)  # qps 1: a third faster than the trace
    assert measured_sends(w).tolist() == pytest.approx([0.0, 0.0, 1.5, 3.0])
    retimed = trace_workload(path, 4, trace_timing="qps")
    assert measured_sends(retimed).tolist() != measured_sends(w).tolist()
    assert [r.scheduled_s for r in build_requests(w, 100)] == pytest.approx([0, 0, 1.5, 3.0])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 1}', "line 2: missing hash_ids"),
        (json.dumps(row(5, -3, [])), "line 2: input_length must be an integer >= 1, got -3"),
        (json.dumps(row(5, 600, [1])), "line 2: input_length 600 is 2 blocks of 512 tokens but"),
        (json.dumps(row(0, 10, [1]) | {"timestamp": -1}), "line 2: timestamp must be an integer"),
        (json.dumps(row(1, 10, [1])).replace("[1]", '["a"]'), "line 2: hash_ids must be a list"),
    ],
)
def test_a_bad_trace_line_is_named_by_file_and_line(tmp_path, small_config, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, 10, [1])) + "\n" + text + "\n")
    with pytest.raises(replay.TraceError, match=re.escape(f"trace file {path} {message}")):
        replay.read_trace(path)
    with pytest.raises(WorkloadError, match=re.escape(message)):
        request_lengths(trace_workload(str(path), 1))
    # servematrix check and the workflow load the config the same way: one error naming it.
    with pytest.raises(ConfigError) as error:
        config.load(trace_config(small_config, str(path), num_prompts=1))
    assert error.value.key_path == "studies.trace.workload.dataset_path"
    assert f"{path} {message}" in str(error.value)


def trace_config(small_config: dict, path: str, **workload) -> dict:
    small_config["studies"] = {
        "trace": {
            "recipe": "v1",
            "models": [MODEL],
            "modes": ["single"],
            "qps": [0.5],
            "input_len": [8000],
            "workload": {
                "dataset": "mooncake",
                "dataset_path": path,
                "warmup_requests": 0,
                "output_len": 4,
                "prefix_caching": True,
                **workload,
            },
        }
    }
    small_config["defaults"]["max_model_len"] = 8192
    return small_config


def test_a_trace_cell_is_named_by_its_trace_and_refuses_warmups(small_config):
    cell = config.load(trace_config(small_config, str(TRACE), num_prompts=10)).all_cells()[0]
    assert cell.path.endswith("_w0_apc.parquet")
    assert "_mooncake-mooncake-conversation-1000_" in cell.path
    assert "trace_timing" not in cell.to_dict()["workload"]  # defaults left out
    small_config["studies"]["trace"]["workload"]["warmup_requests"] = 1
    with pytest.raises(ConfigError, match="must be 0 for the mooncake dataset"):
        config.load(small_config)
    small_config["studies"]["trace"]["workload"] |= {"warmup_requests": 0, "trace_start_s": 3}
    cell = config.load(small_config).all_cells()[0]
    assert "_t3_" in cell.path


SHORT_WINDOW = 12


def short_window_cell(small_config: dict):
    loaded = config.load(trace_config(small_config, str(TRACE), num_prompts=SHORT_WINDOW))
    return loaded.all_cells()[0]


def test_the_simulator_hits_every_block_the_trace_allows_when_served_one_at_a_time(
    small_config,
):
    cell = short_window_cell(small_config)
    window = request_lengths(cell.workload).trace
    bound = replay.reuse_bound(window.requests)
    assert bound.hit_tokens > 0 and window.dropped > 0  # the window reuses; the cap drops some
    result = simulate(cell)  # qps 0.5 on a 7B: every request ends before the next is sent
    parameters = result.engine_parameters
    assert parameters["prefix_cache_queries_tokens"] == bound.query_tokens
    assert parameters["prefix_cache_hits_tokens"] == bound.hit_tokens


def prefix_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics") as response:
        text = response.read().decode()
    values = {}
    for name in ("queries", "hits"):
        match = re.search(rf"^vllm:prefix_cache_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        assert match, text
        values[name] = float(match.group(1))
    return values["queries"], values["hits"]


async def _send_in_turn(url: str, model: str, prompts: list[list[int]], max_tokens: list[int]):
    async with aiohttp.ClientSession() as session:
        for prompt, tokens in zip(prompts, max_tokens, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()


@pytest.mark.slow
def test_the_emulator_reports_the_same_prefix_hits_as_the_simulator(small_config):
    from tests.test_emulator_e2e import MODEL as HF_MODEL
    from tests.test_emulator_e2e import emulator

    cell = short_window_cell(small_config)
    bound = replay.reuse_bound(request_lengths(cell.workload).trace.requests)
    simulated = simulate(cell).engine_parameters
    requests = build_requests(cell.workload, 150_000)  # the load generator's prompts
    flags = ("--max-model-len", "8192", "--recipe", "v1", "--enable-prefix-caching")
    with emulator(*flags) as (url, _):
        assert prefix_counters(url) == (0.0, 0.0)
        prompts = [r.prompt for r in requests]
        asyncio.run(_send_in_turn(url, HF_MODEL, prompts, [r.output_len for r in requests]))
        queries, hits = prefix_counters(url)
    counts = {k: v for k, v in simulated.items() if k.startswith("prefix_cache")}
    print(f"emulator {hits:.0f}/{queries:.0f}, simulator {counts}, bound {bound}")
    assert (queries, hits) == (bound.query_tokens, bound.hit_tokens)
    assert simulated["prefix_cache_hits_tokens"] == hits


def test_the_findings_say_how_much_of_the_possible_reuse_each_mode_got():
    import polars as pl

    from servematrix.reporting.findings.reuse import reuse_section

    summary = pl.DataFrame(
        {
            "mode": ["nondisagg", "nondisagg", "mooncake-tcp", "single"],
            "qps": [1.0, 2.0, 1.0, 1.0],
            "prefix_hit_rate": [0.126, 0.116, 0.107, None],
            "prefix_best_hit_rate": [0.231, 0.231, 0.231, 0.231],
            "trace_dropped_requests": [96, 96, 96, 96],
        }
    )
    section = reuse_section(summary, "qps", ["mode"])
    assert section.sentences == [
        "nondisagg: the prefix caches hit 11.6-12.6% of prompt tokens, of the 23.1% the trace "
        "allows (50-55% of the possible reuse).",
        "mooncake-tcp: the prefix caches hit 10.7% of prompt tokens, of the 23.1% the trace "
        "allows (46% of the possible reuse).",
        "single: no prefix caching; the trace allows 23.1%.",
        "The input cap dropped 96 trace requests from the window (the next ones were replayed "
        "instead).",
    ]
    random_cells = summary.with_columns(pl.lit(None, pl.Float64).alias("prefix_best_hit_rate"))
    assert reuse_section(random_cells.filter(pl.col("mode") == "single"), "qps", ["mode"]) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nondisagg", "mooncake-tcp"])
def test_an_emulator_cell_records_its_servers_hits_beside_the_best_possible(tmp_path, mode):
    """A real emulator cell (proxy and two instances): the hits of every instance that computes
    prompts (both round-robin ones; the prefill one of a disaggregated pair), summed, as the
    simulator counts them for the same cell; the window's bound beside them."""

    from servematrix.backends.cell import run_cell
    from servematrix.spec import trace
    from servematrix.spec.matrix import Serving
    from tests.test_emulator_cell import _cell

    # One request at a time (max_concurrency 1), so both backends route them in the same order.
    workload = replace(
        trace_workload(str(TRACE), 8, cap=8000), qps=math.inf, output_len=2, max_concurrency=1
    )
    cell = _cell(
        workload, tmp_path / "state", mode=mode, serving=Serving(8192, 0.9, None, False, True)
    )
    run_cell(cell, tmp_path / "cell.parquet")
    reuse = trace.read_metadata(tmp_path / "cell.parquet")["prefix_cache"]
    simulated = simulate(replace(cell, backend="simulator", deploy={})).engine_parameters
    bound = replay.reuse_bound(request_lengths(workload).trace.requests)
    print(mode, reuse, bound)
    assert reuse["queries_tokens"] == bound.query_tokens == simulated["prefix_cache_queries_tokens"]
    assert reuse["hits_tokens"] == simulated["prefix_cache_hits_tokens"] > 0
    assert (reuse["best_hits_tokens"], reuse["best_queries_tokens"]) == (
        bound.hit_tokens,
        bound.query_tokens,
    )


@pytest.mark.slow
def test_an_external_cell_records_the_servers_hits(small_config, tmp_path):
    from servematrix.backends.cell import run_cell
    from servematrix.spec import trace
    from tests.test_emulator_e2e import emulator

    flags = ("--max-model-len", "8192", "--recipe", "v1", "--enable-prefix-caching")
    with emulator(*flags) as (url, _):
        cfg = trace_config(small_config, str(TRACE), num_prompts=SHORT_WINDOW, max_concurrency=1)
        cfg.update(backend="external", base_url=f"{url}/v1")
        cell = config.load(cfg).all_cells()[0]
        run_cell(cell, tmp_path / "cell.parquet")
    reuse = trace.read_metadata(tmp_path / "cell.parquet")["prefix_cache"]
    assert (reuse["hits_tokens"], reuse["queries_tokens"]) == (5632, 63788)  # as the bound
    assert (reuse["best_hits_tokens"], reuse["best_queries_tokens"]) == (5632, 63788)


def test_a_trace_workload_with_warmups_is_refused():
    with pytest.raises(WorkloadError, match="replays no warm-up requests"):
        request_lengths(replace(trace_workload(str(TRACE), 4), warmup_requests=1))


def test_the_emulator_exports_v1s_prefix_cache_counters_and_v0_has_none():
    from servematrix.backends import prefixstats
    from servematrix.emulator import wire

    common = dict(running=0, waiting=0, kv_usage=0.0, prompt_tokens=9, generation_tokens=3)
    v1 = wire.metrics_text("v1", "m", preemptions=0, prefix_cache=(1000, 256), **common)
    assert 'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 1000.0' in v1
    assert 'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 256.0' in v1
    assert "# TYPE vllm:prefix_cache_hits_total counter" in v1
    assert prefixstats.parse_counters(v1) == (1000.0, 256.0)
    assert prefixstats.parse_counters(v1 + v1.replace('engine="0"', 'engine="1"')) == (2000, 512)
    v0 = wire.metrics_text("v0", "m", preemptions=0, **common)
    assert "prefix_cache" not in v0 and prefixstats.parse_counters(v0) is None
    assert prefixstats.served((10.0, 2.0), (110.0, 52.0)) == {
        "queries_tokens": 100,
        "hits_tokens": 50,
    }
    assert prefixstats.served(None, (110.0, 52.0)) == {}


def test_the_summary_page_shows_the_hit_rates_only_where_a_cell_has_them():
    import polars as pl

    from servematrix.results.aggregate import render_html

    rates = {"prefix_hit_rate": [0.126, None], "prefix_best_hit_rate": [0.231, 0.231]}
    page = render_html(pl.DataFrame({"mode": ["nondisagg", "chunked"], **rates}), "t")
    assert "<th>prefix-cache hit rate</th>" in page and "<th>best possible hit rate</th>" in page
    none = {name: pl.Series([None, None], dtype=pl.Float64) for name in rates}
    page = render_html(pl.DataFrame({"mode": ["nondisagg", "chunked"], **none}), "t")
    assert "hit rate" not in page
