"""The capacity search (pure logic) and one deployment's search on the simulator."""

from __future__ import annotations

import json
import math

import pyarrow.compute as pc
import pytest

from servematrix import capacity
from servematrix.capacity import Probe
from servematrix.capacity import run as capacity_run
from servematrix.results import intervals
from servematrix.spec import config, trace
from servematrix.spec.slo import Slo


def edge_probe(edge: float, calls: list[float]):
    def probe(level: float) -> Probe:
        calls.append(level)
        met = level <= edge
        return Probe(level, met, () if met else ("P99 TTFT",), level * 6, "")

    return probe


@pytest.mark.parametrize("edge", [0.37, 5.3, 41.0])
def test_blind_search_brackets_then_bisects_to_the_tolerance(edge):
    calls: list[float] = []
    found = capacity.search(edge_probe(edge, calls), 1.0, tolerance=0.02, max_probes=40)
    assert found.capacity <= edge < found.failing
    assert found.failing - found.capacity <= 0.02 * found.capacity + 0.01
    assert found.breaks_first == ("P99 TTFT",)
    assert len(calls) == len(found.probes) == len(set(calls))


def test_a_search_from_a_close_hint_needs_fewer_probes():
    blind, warm = [], []
    capacity.search(edge_probe(5.3, blind), 1.0, capacity.BLIND_FACTOR, max_probes=40)
    found = capacity.search(edge_probe(5.3, warm), 4.9, capacity.WARM_FACTOR, max_probes=40)
    assert found.capacity <= 5.3 < found.failing
    assert len(warm) < len(blind)


def test_the_probe_budget_holds():
    calls: list[float] = []
    found = capacity.search(edge_probe(5.3, calls), 1.0, max_probes=5)
    assert len(found.probes) == len(calls) == 5


def test_never_met_is_capacity_zero_and_never_broken_is_open():
    never = capacity.search(edge_probe(0.0, []), 1.0, max_probes=40)
    assert never.capacity == 0.0 and never.failing == capacity.MIN_LEVEL
    assert not never.limited
    always = capacity.search(edge_probe(1e9, []), 1.0, max_probes=40)
    assert always.failing is None and always.capacity == capacity.MAX_LEVEL
    assert always.limited


def test_a_search_stops_at_its_limit_and_says_so():
    calls: list[float] = []
    found = capacity.search(edge_probe(1e9, calls), 3.0, max_probes=40, limit=20.0)
    assert max(calls) == 20.0 and found.capacity == 20.0 and found.limited
    below = capacity.search(edge_probe(7.0, []), 3.0, max_probes=40, limit=20.0)
    assert not below.limited and below.capacity <= 7.0 < below.failing


def test_intervals_and_cost():
    interval = intervals.t_interval([10.0, 12.0, 11.0])
    assert interval.value == 11.0
    assert interval.hi - interval.value == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-3)
    assert intervals.t_interval([3.0]) == intervals.Interval(3.0, 3.0, 3.0)
    # 2 GPUs at $2/h = $4/h for 1000 tokens/s = 3.6 M tokens/h: $1.11 per million.
    assert capacity.cost_per_million_tokens(2.0, 2, 1000.0) == pytest.approx(4 / 3.6)


def test_slo_check_names_the_bound_furthest_over_first():
    slo = Slo.from_config(
        {
            "ttft": {"statistic": "p99", "max_ms": 100},
            "tpot": {"statistic": "mean", "max_ms": 10},
            "attainment": 0.9,
        }
    )
    row = {"p99_ttft_ms": 150.0, "mean_tpot_ms": 30.0, "good_fraction": 0.95}
    assert slo.check(row).broken == ("mean TPOT", "P99 TTFT")
    assert slo.check({**row, "p99_ttft_ms": 90, "mean_tpot_ms": 9}).met
    assert slo.check({"p99_ttft_ms": 1, "mean_tpot_ms": 1, "good_fraction": 0.5}).broken == (
        "attainment",
    )
    assert slo.per_request_ms() == {"ttft": 100.0, "tpot": 10.0}


def test_a_deployment_search_writes_its_probes_as_cells_and_reuses_them(
    small_config, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cfg = config.load(small_config)
    path, cells = next(iter(capacity_run.deployments(cfg.studies["disagg"].cells).items()))
    model = "Qwen2.5-7B-Instruct-GPTQ-Int4"
    assert path == f"results/simulator/capacity/v0/{model}/nondisagg/in1024_out6.json"
    settings = {**cfg.raw["capacity"], "max_probes": 12, "gpu_hour_usd": 2.0}
    document = capacity_run.search_deployment(cells, cfg.slo, settings)
    probes = document["searches"][0]["probes"]
    assert all((tmp_path / p["trace"]).is_file() for p in probes)
    # Each run of a probe sends 60 s of arrivals at its rate, or the 5 x 100 + ramp a P99
    # needs; on the simulator a probe near its limit takes up to 5 runs (4 extra).
    assert all(p["requests"] == p["runs"] * max(math.ceil(p["level"] * 60), 625) for p in probes)
    assert document["extra_runs"] == capacity_run.SIMULATED_EXTRA_RUNS
    assert any(p["runs"] > 1 for p in probes) and document["probe_runs"] > document["probes"]
    assert document["searches"][0]["scout_probes"]  # the first guess came from a scout
    assert document["load"] == "rate" and document["capacity_unit"] == "req/s"
    assert document["capacity"] > 0 and document["cost_per_mtok_usd"] > 0
    assert 0 < document["capacity"] < document["ceiling"]
    at = next(p for p in probes if p["level"] == document["capacity"])
    assert at["requests_per_s"] == pytest.approx(document["capacity"], rel=0.05)
    tokens_per_request = at["output_tokens_per_s"] / document["capacity"]
    assert tokens_per_request == pytest.approx(6, rel=0.1)  # capacity x mean output
    capacity_run.write_deployment(document, path)
    written = {p["trace"]: (tmp_path / p["trace"]).stat().st_mtime_ns for p in probes}
    again = capacity_run.search_deployment(cells, cfg.slo, settings)
    assert again["searches"] == document["searches"]
    assert {t: (tmp_path / t).stat().st_mtime_ns for t in written} == written  # reused, not rerun
    table = capacity_run.study_table([path])
    assert table.row(0, named=True)["capacity_per_gpu"] == document["capacity"] / 2
    assert json.loads((tmp_path / path).read_text())["gpus"] == 2


def test_a_deployments_capacity_does_not_depend_on_the_studys_num_prompts(
    small_config, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    answers = set()
    for num_prompts in (20, 2000):
        small_config["defaults"]["num_prompts"] = num_prompts
        cfg = config.load(small_config)
        ((path, cells),) = capacity_run.deployments(cfg.studies["sizes"].cells[:1]).items()
        document = capacity_run.search_deployment(cells, cfg.slo, cfg.raw["capacity"])
        answers.add((path, document["capacity"]))
    assert len(answers) == 1


def test_an_integer_axis_searches_whole_levels_from_one():
    calls: list[float] = []
    found = capacity.search(edge_probe(13.4, calls), 1.0, max_probes=40, integer=True)
    assert found.capacity == 13 and found.failing == 14
    assert all(level == int(level) >= 1 for level in calls)
    never = capacity.search(edge_probe(0.5, []), 4.0, max_probes=40, integer=True)
    assert never.capacity == 0 and never.failing == 1


def test_a_closed_loop_capacity_is_in_concurrent_users(small_config, tmp_path, monkeypatch):
    """``max_concurrency``: the search raises the users (each sends its next request when the
    last is answered), every probe runs at least the duration, and the capacity is users."""
    monkeypatch.chdir(tmp_path)
    small_config["studies"]["disagg"]["workload"] = {"max_concurrency": 4}
    cfg = config.load(small_config)
    deployments = capacity_run.deployments(cfg.studies["disagg"].cells)
    path, cells = next(iter(deployments.items()))
    assert path.endswith("/nondisagg/in1024_out6_users.json")
    document = capacity_run.search_deployment(cells, cfg.slo, cfg.raw["capacity"])
    assert document["load"] == "users" and document["capacity_unit"] == "users"
    assert document["capacity"] == int(document["capacity"]) > 0
    assert document["capacity"] <= 2 * document["ceiling"]
    probes = document["searches"][0]["probes"]
    for probe in probes:
        table = trace.read(probe["trace"])
        cell = trace.metadata_of(table.schema, probe["trace"])["cell"]["workload"]
        assert cell["max_concurrency"] == probe["level"] and cell["qps"] == "inf"
        sent = table.filter(~pc.field("warmup"))["sent_s"].to_numpy()
        assert sent.max() - sent.min() >= 60  # the duration, lengthened from the rate it got
    at = next(p for p in probes if p["level"] == document["capacity"])
    assert document["requests_per_s"] == at["requests_per_s"] > 0
    above = next(p for p in probes if p["level"] == document["searches"][0]["failing_level"])
    assert above["broken"] and "throughput below offered" not in above["broken"]


def test_a_sessions_capacity_is_in_concurrent_sessions(small_config, tmp_path, monkeypatch):
    """Sessions arrive on a schedule and run their turns: the search raises the arrival rate
    and reports the sessions in progress it holds (Little's law over the steady window)."""
    monkeypatch.chdir(tmp_path)
    sessions = {"users": 4, "turns": 3, "think_time_s": 2.0}
    small_config["studies"]["sizes"]["workload"] = {"sessions": sessions}
    cfg = config.load(small_config)
    path, cells = next(iter(capacity_run.deployments(cfg.studies["sizes"].cells).items()))
    assert "_sess3-t2" in path  # the deployment leaves the number of sessions out
    document = capacity_run.search_deployment(cells, cfg.slo, cfg.raw["capacity"])
    assert document["load"] == "sessions" and document["level_unit"] == "sessions/s"
    level, concurrent = document["capacity_level"], document["capacity"]
    # Little's law: concurrent sessions = arrival rate x session lifetime; a session of three
    # turns lives at least its two think times (mean 2 s each, exponential).
    assert concurrent > level * 2.0
    assert document["requests_per_s"] == pytest.approx(3 * level, rel=0.15)


def test_the_ledger_predicts_each_deployment_from_the_others_only():
    rows = [
        capacity.LedgerRow(10.0, 8.0, 7.5, 9.0),  # measured 1.25x the simulator
        capacity.LedgerRow(8.0, 10.0),  # 0.8x
        capacity.LedgerRow(5.0, 5.0),  # 1.0x
        capacity.LedgerRow(3.0),  # not simulated first
    ]
    ranges = capacity.predicted_ranges(rows)
    assert ranges[0] == pytest.approx((7.5 * 0.8, 9.0 * 1.0))  # its own 1.25 held out
    assert ranges[1] == pytest.approx((10.0 * 1.0, 10.0 * 1.25))
    assert ranges[2] == pytest.approx((5.0 * 0.8, 5.0 * 1.25))
    assert ranges[3] is None
    assert capacity.predicted_ranges([capacity.LedgerRow(10.0, 8.0)]) == [None]


def _edge_probe(level: float, ratio: float, se: float | None = 0.005) -> Probe:
    return Probe(
        level, ratio <= 1, () if ratio <= 1 else ("P99 TPOT",), 0.0, "", 0, level, ratio, se
    )


def test_the_interval_of_one_search_is_its_bracket_widened_by_the_noise_at_its_edge():
    # The check rises 0.1 per unit of log level; a 0.01 standard error is 10 % of the level.
    steep = [
        _edge_probe(level, 1 + 0.1 * math.log(level / 0.6), 0.01)
        for level in (0.5, 0.58, 0.62, 0.7)
    ]
    found = capacity.Search(0.58, 0.62, tuple(steep))
    assert capacity.edge_resolution(found) == pytest.approx(0.1)
    interval = capacity.capacity_interval([found])
    widen = math.exp(capacity.EDGE_T * 0.1)
    assert (interval.lo, interval.hi) == pytest.approx((0.58 / widen, 0.62 * widen))
    # Flat: the check does not rise across the probes, so the edge is not resolved.
    flat = [_edge_probe(0.58, 0.999), _edge_probe(0.62, 1.001), _edge_probe(0.7, 0.998)]
    assert (
        capacity.edge_resolution(capacity.Search(0.58, 0.62, tuple(flat)))
        == capacity.EDGE_UNRESOLVED
    )
    # Sharp: the failing probe's queue grew (no finite ratio), so the bracket is the interval.
    sharp = capacity.Search(0.58, 0.62, (_edge_probe(0.58, 0.9), _edge_probe(0.62, math.inf, None)))
    assert capacity.edge_resolution(sharp) == 0.0
    assert capacity.capacity_interval([sharp]) == intervals.Interval(0.58, 0.58, 0.62)


def test_a_probe_near_its_limit_pools_extra_runs_with_fresh_seeds(
    small_config, tmp_path, monkeypatch
):
    """With ``extra_runs``, a probe whose verdict is within two standard errors of its limit
    runs again at its rate with seed + k × SEED_STRIDE, and the verdict is over the pooled
    windows; far from the limit, or without ``extra_runs``, one run is all."""
    monkeypatch.chdir(tmp_path)
    cfg = config.load(small_config)
    _, cells = next(iter(capacity_run.deployments(cfg.studies["disagg"].cells).items()))
    settings = {**cfg.raw["capacity"], "max_probes": 12, "extra_runs": 0}
    failing = capacity_run.search_deployment(cells, cfg.slo, settings)["searches"][0][
        "failing_level"
    ]
    one = capacity_run.probe_at(cells[0], failing, cfg.slo, settings)
    assert one.runs == 1 and capacity_run.near_flip(one)
    extra = {**settings, "extra_runs": 2}
    pooled = capacity_run.probe_at(cells[0], failing, cfg.slo, extra)
    assert pooled.runs > 1 and pooled.requests == pooled.runs * one.requests
    assert pooled.trace == one.trace
    assert pooled.runs == 3 or not capacity_run.near_flip(pooled)  # the pooled verdict settled
    seed = cells[0].workload.seed
    stems = {p.stem for p in tmp_path.rglob(f"qps{failing:g}_*.parquet")}
    assert {int(stem.rsplit("_s", 1)[1]) for stem in stems} == {
        seed + k * capacity_run.SEED_STRIDE for k in range(pooled.runs)
    }
    far = capacity_run.probe_at(cells[0], failing / 4, cfg.slo, extra)
    assert far.runs == 1


@pytest.mark.parametrize("edge", [0.37, 5.3, 41.0])
def test_searches_from_other_guesses_meet_on_the_same_levels(edge):
    """The grid: wherever a search starts and however it steps, a sharp edge gives one
    capacity (a longer probe's search, a scout's guess or the simulator's find the same)."""
    found = {
        capacity.search(edge_probe(edge, []), guess, factor, max_probes=100).capacity
        for guess in (0.05, 1.0, 4.9, 77.0)
        for factor in (capacity.BLIND_FACTOR, capacity.WARM_FACTOR)
    }
    assert len(found) == 1


@pytest.mark.parametrize("tolerance", [0.01, 0.02, 0.05, 0.2])
def test_the_grids_neighbours_lie_within_the_tolerance(tolerance):
    levels = [capacity.next_level(None, None, 10**x, 2.0, tolerance) for x in range(-2, 4)]
    for level in levels:
        above = capacity.next_level(level, None, level, 1.0, tolerance)
        assert 0 < above / level - 1 <= tolerance
        assert capacity.next_level(level, above, level, 1.0, tolerance) is None  # neighbours
