"""Topologies: the spelling that parses back, the named modes as topologies, pins per role."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest

from servematrix.capacity.confirm import confirmed, read_candidates, write_candidates
from servematrix.deploy.layout import decoding_instances
from servematrix.deploy.recipes import plan
from servematrix.proxy.cli import build
from servematrix.proxy.cli import parser as proxy_parser
from servematrix.reporting.findings.recommend import Ranking, split_sentence
from servematrix.simulate import simulate
from servematrix.spec import config
from servematrix.spec.config import read_yaml
from servematrix.spec.matrix import (
    MODES,
    Cell,
    ConfigError,
    ModelSpec,
    Serving,
    Workload,
    topology_mode,
)
from servematrix.spec.topology import DECODE, PREFILL, Topology, TopologyError, parse, within_budget
from servematrix.workflow import check_config, predicted_config
from tests.conftest import ROOT

H100_70B = ModelSpec("m", "org/m", "qwen2.5-72b", "none", 4, ((0, 1, 2, 3), (4, 5, 6, 7)))


def cell(mode) -> Cell:
    return Cell(
        backend="simulator",
        recipe="v1",
        model=H100_70B,
        mode=mode,
        workload=Workload(4.0, 1024, 6, 20, 0, "random", 1.0, 1),
        serving=Serving(10_000, 0.8),
    )


@pytest.mark.parametrize("spelling", ["4x(TP2)", "1x(TP8)", "2P(TP2)+1D(TP4)", "1P(TP1)+2D(TP1)"])
def test_spelling_parses_back(spelling):
    assert parse(spelling).spelling == spelling == str(parse(spelling))


def test_xpyd_roles_and_sizes():
    t = Topology.xpyd(2, 2, 1, 4)
    assert t.spelling == "2P(TP2)+1D(TP4)" and t.disaggregated
    assert (t.instances, t.gpus) == (3, 8)
    assert (t.role(PREFILL).count, t.role(DECODE).tp) == (2, 4)
    assert not Topology.aggregated(4, 2).disaggregated


@pytest.mark.parametrize("bad", ["4x(TP0)", "2P(TP2)", "1D(TP1)+1P(TP1)", "4x", "2x(TP2)+1x(TP2)"])
def test_bad_spellings_are_refused(bad):
    with pytest.raises(TopologyError, match=r"topology|roles|at least"):
        parse(bad)


def test_named_modes_are_topologies_at_the_model_tp():
    spelled = {name: cell(mode).topology.spelling for name, mode in MODES.items()}
    assert spelled["nondisagg"] == spelled["chunked"] == "2x(TP4)"
    assert spelled["mooncake-rdma"] == spelled["mooncake-tcp"] == "1P(TP4)+1D(TP4)"
    assert spelled["single"] == "1x(TP4)"
    assert cell(MODES["nondisagg"]).instance_gpus == H100_70B.gpus
    assert cell(MODES["single"]).instance_gpus == H100_70B.gpus[:1]


def test_pins_are_carved_per_role_from_the_model_gpus():
    mode = topology_mode(parse("2P(TP2)+1D(TP4)"))
    assert (mode.name, mode.instances, mode.disaggregated, mode.kv_protocol) == (
        "2P(TP2)+1D(TP4)",
        3,
        True,
        "rdma",
    )
    assert cell(mode).instance_gpus == ((0, 1), (2, 3), (4, 5, 6, 7))
    with pytest.raises(TopologyError, match="needs 16 GPUs, 8 are pinned"):
        _ = cell(topology_mode(parse("4x(TP4)"))).instance_gpus


def test_a_topology_mode_round_trips_through_the_cell_parameters():
    c = cell(topology_mode(parse("4x(TP2)")))
    assert Cell.from_dict(c.to_dict()) == c
    named = cell(MODES["mooncake-rdma"])
    assert "topology" not in named.to_dict()["mode"]
    assert Cell.from_dict(named.to_dict()) == named


GPTQ_7B_NODE = ModelSpec(
    "Qwen2.5-7B-Instruct-GPTQ-Int4",
    "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4",
    "qwen2.5-7b",
    "gptq-int4",
    1,
    tuple((g,) for g in range(8)),
)


def simulated(spelling: str, qps: float = 12.0, one_queue: bool = False):
    c = dataclasses.replace(
        cell(topology_mode(parse(spelling))),
        model=GPTQ_7B_NODE,
        workload=Workload(qps, 1024, 32, 80, 0, "random", 1.0, 1),
        engine={"gpu": "H100-SXM5-80GB", "jitter_cv": 0.05},
    )
    return simulate(c, one_queue=one_queue)


@pytest.mark.parametrize(
    "spelling", ["4x(TP1)", "2x(TP2)", "1P(TP1)+2D(TP1)", "2P(TP1)+1D(TP1)", "1P(TP1)+1D(TP2)"]
)
def test_the_simulator_drives_any_topology(spelling):
    result = simulated(spelling)
    assert len(result.records) == 81 and all(r.success for r in result.records)
    assert all(r.completion_tokens == 32 for r in result.records)
    instances = parse(spelling).instances
    assert len(result.peak_kv_blocks) == instances and all(result.peak_kv_blocks)
    assert result.records == simulated(spelling).records


@pytest.mark.parametrize("spelling", ["1P(TP1)+2D(TP1)", "2P(TP1)+1D(TP1)", "2P(TP1)+3D(TP2)"])
def test_xpyd_pipelined_equals_one_queue(spelling):
    assert simulated(spelling).records == simulated(spelling, one_queue=True).records


def test_more_decoders_lower_the_decode_load():
    def mean_tpot(spelling):
        rows = [r for r in simulated(spelling, qps=40.0).records if not r.warmup]
        return sum((r.end_s - r.first_token_s) / 31 for r in rows) / len(rows)

    assert mean_tpot("1P(TP1)+3D(TP1)") < mean_tpot("1P(TP1)+1D(TP1)")


def test_a_budget_enumerates_every_topology_that_fits():
    found = [t.spelling for t in within_budget(8, (2, 4))]
    assert len(found) == len(set(found)) == 17
    assert all(parse(s).gpus <= 8 for s in found)
    assert {"4x(TP2)", "2x(TP4)", "1P(TP2)+2D(TP2)", "2P(TP2)+1D(TP2)", "2P(TP2)+1D(TP4)"} <= set(
        found
    )
    assert found[0] == "1x(TP2)" and parse(found[-1]).disaggregated


def budget_config(**study) -> dict:
    xpyd = read_yaml(ROOT / "config" / "examples" / "xpyd.yaml")
    xpyd["studies"]["xpyd"].update(study)
    return xpyd


def test_a_gpu_budget_study_expands_into_topology_cells():
    cfg = config.load(budget_config())
    study = cfg.studies["xpyd"]
    assert len(study.modes) == 17 == len(study.cells)
    by_mode = {c.mode.name: c for c in study.cells}
    c = by_mode["2P(TP2)+1D(TP4)"]
    assert c.topology.spelling == c.mode.name and c.instance_gpus == ((0, 1), (2, 3), (4, 5, 6, 7))
    assert "/2P(TP2)+1D(TP4)/" in c.path
    assert cfg.mode_names()[: len(MODES)] == list(MODES)


@pytest.mark.parametrize(
    ("study", "key_path", "words"),
    [
        ({"recipe": "v0"}, "studies.xpyd.gpu_budget", "needs recipe v1"),
        ({"tp": [2, 16]}, "studies.xpyd.tp[1]", "exceeds the gpu_budget 8"),
        ({"gpu_budget": 16}, "studies.xpyd.gpu_budget", "pins only 8"),
        ({"modes": ["single"]}, "studies.xpyd", "valid"),
    ],
)
def test_a_bad_budget_names_its_key(study, key_path, words):
    with pytest.raises(ConfigError) as error:
        config.load(budget_config(**study))
    assert error.value.key_path == key_path and words in str(error.value)


def test_the_recommendation_names_the_split_and_its_margin_over_aggregated():
    def row(spelling, per_gpu, spread=0.01):
        gpus = parse(spelling).gpus
        return {"mode": spelling, "topology": spelling, "capacity": per_gpu * gpus,
                "capacity_lo": per_gpu * gpus * (1 - spread),
                "capacity_hi": per_gpu * gpus * (1 + spread),
                "gpus": gpus, "capacity_unit": "req/s"}  # fmt: skip

    split = Ranking("", "mode", [row("2P(TP2)+1D(TP4)", 1.5), row("4x(TP2)", 1.2)])
    assert split_sentence(split) == (
        "The best split, 2P(TP2)+1D(TP4) (1.5 req/s per GPU), has 25% more than the best "
        "aggregated setup, 4x(TP2) (1.2)."
    )
    named = Ranking("", "mode", [{**r, "mode": "chunked"} for r in split.rows])
    assert split_sentence(named) is None
    noisy = Ranking("", "mode", [row("2P(TP2)+1D(TP4)", 1.5, 0.2), row("4x(TP2)", 1.2, 0.2)])
    assert split_sentence(noisy) == (
        "The best split, 2P(TP2)+1D(TP4), and the best aggregated setup, 4x(TP2), are the same "
        "within noise ([1.2, 1.8] vs [0.96, 1.44] req/s per GPU)."
    )


def vllm_plan(spelling: str):
    cfg = config.load(budget_config())
    cell = next(c for c in cfg.studies["xpyd"].cells if c.mode.name == spelling)
    deploy = config.deploy_settings({**cfg.raw, "backend": "vllm"})
    return plan(dataclasses.replace(cell, backend="vllm", deploy=deploy))


def test_the_vllm_recipe_renders_xpyd_with_lists_for_the_proxy():
    processes = {p.name: p for p in vllm_plan("2P(TP2)+1D(TP4)").processes}
    assert list(processes) == ["prefill0", "prefill1", "decode0", "proxy"]
    prefill1, decode0 = processes["prefill1"], processes["decode0"]
    assert (prefill1.port, prefill1.gpus, prefill1.extra_ports) == (8101, (2, 3), (9000, 9001))
    assert prefill1.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "9000"
    assert decode0.argv[decode0.argv.index("-tp") + 1] == "4" and decode0.gpus == (4, 5, 6, 7)
    assert '"kv_role":"kv_consumer"' in decode0.argv[decode0.argv.index("--kv-transfer-config") + 1]
    args = proxy_parser().parse_args(list(processes["proxy"].argv[3:]))
    assert args.prefill == [["http://127.0.0.1:8100", "8998"], ["http://127.0.0.1:8101", "9000"]]
    assert args.decode == ["http://127.0.0.1:8200"]
    assert len(build(args).prefillers) == 2


def test_aggregated_replicas_sit_behind_one_round_robin_proxy():
    processes = vllm_plan("4x(TP2)").processes
    assert [p.port for p in processes] == [8100, 8101, 8102, 8103, 8090]
    args = proxy_parser().parse_args(list(processes[-1].argv[3:]))
    assert args.kind == "round-robin" and len(args.upstream) == 4


def test_a_study_may_list_topologies_as_modes():
    listed = budget_config(modes=["4x(TP2)", "2P(TP2)+1D(TP4)"])
    del listed["studies"]["xpyd"]["gpu_budget"], listed["studies"]["xpyd"]["tp"]
    cfg = config.load(listed)
    assert [c.topology.spelling for c in cfg.studies["xpyd"].cells] == [
        "4x(TP2)",
        "2P(TP2)+1D(TP4)",
    ]
    listed["studies"]["xpyd"]["modes"] = ["4x(TP4)"]
    with pytest.raises(ConfigError, match=r"4x\(TP4\) needs 16 GPUs but .* pins 8"):
        config.load(listed)


def test_only_decode_instances_are_left_out_of_prefix_counts():
    cfg = config.load(budget_config())
    cells = {c.mode.name: c for c in cfg.studies["xpyd"].cells}
    assert decoding_instances(cells["1P(TP2)+2D(TP2)"]) == {"decode0", "decode1"}
    assert decoding_instances(cells["4x(TP2)"]) == set()
    assert decoding_instances(cell(MODES["mooncake-tcp"])) == {"decode"}
    assert decoding_instances(cell(MODES["chunked"])) == set()


def test_a_bad_confirm_top_names_its_key():
    with pytest.raises(ConfigError) as error:
        config.load(budget_config(confirm_top=18))
    assert error.value.key_path == "studies.xpyd.confirm_top"
    assert "18 but the gpu_budget gives only 17 topologies" in str(error.value)
    listed = budget_config(modes=["4x(TP2)", "2x(TP4)"], confirm_top=1)
    del listed["studies"]["xpyd"]["gpu_budget"], listed["studies"]["xpyd"]["tp"]
    with pytest.raises(ConfigError, match="'gpu_budget' is a dependency of 'confirm_top'"):
        config.load(listed)


def test_confirm_top_is_for_a_measured_backend_and_its_twin_searches_every_topology():
    with pytest.raises(ConfigError, match=r"measured backend \(.*\); backend simulator"):
        check_config(budget_config(confirm_top=2))
    measured = check_config({**budget_config(confirm_top=2), "backend": "emulator"})
    assert measured.studies["xpyd"].confirm_top == 2
    twin = predicted_config(measured)
    assert twin.studies["xpyd"].confirm_top is None
    assert len(twin.studies["xpyd"].cells) == len(measured.studies["xpyd"].cells) == 17


def test_the_simulator_top_n_are_the_only_cells_confirmed(tmp_path):
    table = pl.DataFrame(
        {
            "model": ["m"] * 4,
            "input_len": [1024] * 4,
            "topology": ["2x(TP4)", "1P(TP2)+1D(TP2)", "4x(TP2)", "1P(TP4)+1D(TP4)"],
            "gpus": [8, 4, 8, 8],
            "capacity_per_gpu": [1.0, 1.2, 1.2, 0.5],
            "capacity_unit": ["req/s"] * 4,
            "limited": [False, False, True, False],
        }
    )
    table.write_parquet(tmp_path / "twin.parquet")
    write_candidates(str(tmp_path / "twin.parquet"), 2, tmp_path / "picks.json")
    picks = read_candidates(tmp_path / "picks.json")
    (comparison,) = picks.comparisons
    # a tie goes to the topology on fewer GPUs
    assert [(c.topology, c.simulated_rank) for c in comparison.picked] == [
        ("1P(TP2)+1D(TP2)", 1),
        ("4x(TP2)", 2),
    ]
    assert [c.simulated_lower_bound for c in comparison.picked] == [False, True]
    assert comparison.topologies == 4 and picks.unit == "req/s"
    assert comparison.best_aggregated.topology == "4x(TP2)"
    assert comparison.best_split.simulated_rank == 1
    cells = [cell(topology_mode(parse(c))) for c in ("4x(TP2)", "2x(TP4)", "1P(TP2)+1D(TP2)")]
    for c in cells:  # the module's model and input length
        assert (c.model.name, c.workload.input_len) == ("m", 1024)
    kept = confirmed(cells, picks)
    assert [c.mode.name for c in kept] == ["4x(TP2)", "1P(TP2)+1D(TP2)"]
