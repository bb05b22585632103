"""The capacity search of one deployment, run through the ordinary cell code.

A deployment is a model × mode × recipe × workload without its rate, request count and seed,
so its capacity is the same whichever study (and ``num_prompts``) asks. Each probe is a real
cell (``servematrix.backends.cell.run_cell``) at the probed rate, sized to a steady-state run:
arrivals for at least ``capacity.min_duration_s`` (by default 600 s of virtual time on the
simulator, as MLPerf's Server scenario; 120 s of wall time on a measured backend) and enough
requests for the SLO's percentiles (`probe_requests`), judged over its steady window by
``servematrix.results.steady``. Its trace lands at the cell's usual path under ``results/``, so
probes are cached and resumable like any cell. A search steps around a first guess: the simulator
twin's capacity on a measured run, else a scouting search's, with probes a quarter as long and
a tenth of the tail (`scout_settings`). The study's own cells (a fixed number of requests
each) are not probes. With repeats, one search per seed; the capacity is their mean with a 95 %
interval. Results are one JSON document per deployment and a table per study.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from servematrix import capacity
from servematrix.backends import backend_of
from servematrix.backends.cell import run_cell
from servematrix.capacity.loads import Axis, axis_of
from servematrix.common.files import write_text
from servematrix.results import aggregate, intervals, steady
from servematrix.spec import trace
from servematrix.spec.matrix import Cell
from servematrix.spec.slo import Slo

log = logging.getLogger(__name__)


def gpus_of(cell: Cell) -> int:
    return cell.topology.gpus


SIMULATED_DURATION_S = 600.0
MEASURED_DURATION_S = 120.0
"""``capacity.min_duration_s`` when the config leaves it out: virtual time is cheap (a
600 s probe of thousands of requests simulates in well under a second); wall time is not."""
SCOUT_TOLERANCE = 0.2
"""A scouting search stops once its bracket is this narrow (its short probes are noisier)."""
CEILING_MARGIN = 2.0
"""The search probes up to this multiple of the physical ceiling (an upper bound that mixed
steps or cached prefixes may beat) before it says the SLO never broke."""
RESIZES = 2
"""A closed-loop probe shorter than the duration is lengthened at most this many times."""


def deployment_token(cell: Cell) -> str:
    """The workload's file name without its load level, request count and seed (``in1024_out6``,
    then the workload's suffixes; `servematrix.capacity.loads`)."""
    return axis_of(cell).token(cell) + ("_apc" if cell.serving.prefix_caching else "")


def deployment_path(cell: Cell) -> str:
    return (
        f"results/{cell.backend}/capacity/{cell.recipe}/{cell.model.name}/{cell.mode.name}/"
        f"{deployment_token(cell)}.json"
    )


def deployments(cells: Iterable[Cell]) -> dict[str, list[Cell]]:
    """Deployment document path → one template cell per seed (its load level and request
    count neutral: each probe sets its own), in a stable order. So the search, and the rule
    that runs it, depend on the deployment alone, not on the rates or ``num_prompts`` a
    study lists."""
    found: dict[str, list[Cell]] = {}
    for cell in cells:
        group = found.setdefault(deployment_path(cell), [])
        template = axis_of(cell).template(cell)
        if template not in group:
            group.append(template)
    return found


def _reusable(cell: Cell) -> pa.Table | None:
    """The trace at the cell's path if it was written for exactly these settings."""
    if not os.path.isfile(cell.path):
        return None
    try:
        table = trace.read(cell.path)
        reusable = trace.metadata_of(table.schema, cell.path).get("cell") == cell.to_dict()
    except trace.TraceError:
        return None
    return table if reusable else None


def run_probe(cell: Cell) -> pa.Table:
    """Run (or reuse) one probe cell."""
    table = _reusable(cell)
    if table is None:
        log.info("probe %s (%d requests)", cell.path, cell.workload.num_prompts)
        table = run_cell(cell, cell.path, keep_failed=True)  # failures are its verdict
    return table


def _setting(
    settings: Mapping[str, Any], key: str, cell: Cell, measured: Any, simulated: Any
) -> Any:
    """``capacity.{key}`` as configured, else the default for the cell's backend."""
    configured = settings.get(key)
    if configured is not None:
        return configured
    return measured if backend_of(cell.backend).MEASURED else simulated


def min_duration_s(cell: Cell, settings: Mapping[str, Any]) -> float:
    return float(
        _setting(settings, "min_duration_s", cell, MEASURED_DURATION_S, SIMULATED_DURATION_S)
    )


def probe_at(template: Cell, level: float, slo: Slo, settings: Mapping[str, Any]) -> capacity.Probe:
    """One probe of the deployment at a load level, sized by the search's settings and
    judged over its steady window against the SLO. A verdict within noise of flipping
    (`near_flip`) takes another run at the level with a fresh seed, its window pooled with
    the first (`steady.judge_runs`), up to ``capacity.extra_runs`` more runs."""
    axis = axis_of(template)
    tail = int(settings.get("tail_requests", steady.TAIL_REQUESTS))
    duration_s = min_duration_s(template, settings)
    runs = [_sized_run(axis, template, level, slo, duration_s, tail)]
    shape = steady.shape_of(runs[0][0].to_dict()["workload"])
    verdict = steady.judge_runs([t for _, t in runs], slo, tail, shape)
    while len(runs) <= extra_runs(template, settings) and near_flip(verdict):
        reseeded = _reseeded(template, len(runs))
        runs.append(_sized_run(axis, reseeded, level, slo, duration_s, tail))
        verdict = steady.judge_runs([t for _, t in runs], slo, tail, shape)
    return capacity.Probe(
        level,
        verdict.met,
        verdict.broken,
        verdict.output_tokens_per_s,
        runs[0][0].path,
        sum(c.workload.num_prompts for c, _ in runs),
        verdict.requests_per_s,
        verdict.edge_ratio,
        verdict.edge_se,
        len(runs),
    )


def _sized_run(
    axis: Axis, template: Cell, level: float, slo: Slo, duration_s: float, tail: int
) -> tuple[Cell, pa.Table]:
    """One run of a probe: its cell and trace, lengthened while a closed loop fell short of
    the duration (`Axis.resize`)."""
    cell = axis.probe_cell(template, level, slo, duration_s, tail)
    table = run_probe(cell)
    for _ in range(RESIZES):
        longer = axis.resize(cell, table, duration_s)
        if longer is None:
            break
        cell, table = longer, run_probe(longer)
    return cell, table


NEAR_FLIP_SE = 2.0
"""A verdict is near flipping when its binding check is within this many of its standard
errors of the limit (`steady.Judgement.edge_se`)."""
SEED_STRIDE = 1_000_003
"""Run k of a probe uses the workload's seed + k × this, far from any seed a study repeats."""


SIMULATED_EXTRA_RUNS = 4
"""``capacity.extra_runs`` when the config leaves it out, on the simulator (on a measured
backend 0: each extra run costs what the first did, ``min_duration_s`` of wall time)."""


def extra_runs(cell: Cell, settings: Mapping[str, Any]) -> int:
    """``capacity.extra_runs``, else `SIMULATED_EXTRA_RUNS` on the simulator and none on a
    measured backend. On the default config 4 keeps every capacity within the tolerance of
    the one from probes twice as long, for 2.4 times the search's CPU
    (``benchmarks/capacity_search.py``; 4 was chosen on that same check)."""
    return int(_setting(settings, "extra_runs", cell, 0, SIMULATED_EXTRA_RUNS))


def near_flip(verdict: steady.Judgement | capacity.Probe) -> bool:
    """Whether the probe's binding check is within noise of its limit (a verdict another run
    could turn); a check without a finite edge or a noise estimate is never near."""
    return (
        verdict.edge_se is not None
        and math.isfinite(verdict.edge_ratio)
        and abs(verdict.edge_ratio - 1) < NEAR_FLIP_SE * verdict.edge_se
    )


def _reseeded(template: Cell, run: int) -> Cell:
    if not run:
        return template
    seed = template.workload.seed + run * SEED_STRIDE
    return replace(template, workload=replace(template.workload, seed=seed))


def scout_settings(settings: Mapping[str, Any], cell: Cell) -> dict[str, Any]:
    """The scouting search's: a quarter of the duration, a tenth of the tail, a wide bracket."""
    tail = int(settings.get("tail_requests", steady.TAIL_REQUESTS))
    return {
        **settings,
        "min_duration_s": min_duration_s(cell, settings) / 4,
        "tail_requests": max(tail // 10, 5),
        "tolerance": max(SCOUT_TOLERANCE, settings["tolerance"]),
        "extra_runs": 0,
    }


def search_seed(
    cells: list[Cell], slo: Slo, settings: Mapping[str, Any], hint: float | None = None
) -> tuple[capacity.Search | None, capacity.Search]:
    """One seed's search: (the scouting search, the search). The search steps ``WARM_FACTOR``
    around a first guess: the simulator's capacity level (``hint``), else a scouting search's,
    which brackets the capacity with short probes, doubling from half the physical ceiling
    or, without one, from 1."""
    template = cells[0]
    axis = axis_of(template)
    ceiling = axis.ceiling(template)
    limit = CEILING_MARGIN * ceiling if ceiling else capacity.MAX_LEVEL
    scout = None
    if not hint:
        quick = scout_settings(settings, template)
        scout = capacity.search(
            lambda level: probe_at(template, level, slo, quick),
            ceiling / 2 if ceiling else 1.0,
            capacity.BLIND_FACTOR,
            quick["tolerance"],
            settings["max_probes"],
            limit,
            axis.integer,
        )
    guess = hint or scout.capacity or scout.failing or capacity.MIN_LEVEL
    found = capacity.search(
        lambda level: probe_at(template, level, slo, settings),
        guess,
        capacity.WARM_FACTOR,
        settings["tolerance"],
        settings["max_probes"],
        limit,
        axis.integer,
    )
    return scout, found


def _probe_dict(probe: capacity.Probe) -> dict[str, Any]:
    return {
        "level": probe.level,
        "met": probe.met,
        "broken": list(probe.broken),
        "output_tokens_per_s": probe.output_tokens_per_s,
        "requests_per_s": probe.requests_per_s,
        "requests": probe.requests,
        "runs": probe.runs,
        "trace": probe.trace,
        "edge_ratio": probe.edge_ratio if math.isfinite(probe.edge_ratio) else None,
        "edge_se": probe.edge_se,
    }


def capacity_in_unit(template: Cell, searches: Sequence[capacity.Search]) -> intervals.Interval:
    """The capacity in its axis's unit (`servematrix.capacity.loads`) from the searches' levels:
    over repeats their mean and t interval; one search, its capacity and its interval in levels
    (`capacity.capacity_interval`: the bracket widened by the probes' noise) scaled to the
    same unit."""
    axis = axis_of(template)
    values = [
        axis.capacity(s.capacity, s.at_capacity.trace) if s.at_capacity else 0.0 for s in searches
    ]
    if len(searches) > 1:
        return intervals.t_interval(values)
    s, value = searches[0], values[0]
    if not s.capacity:
        return intervals.Interval(value, value, value)
    levels = capacity.capacity_interval([s])
    scale = value / s.capacity
    return intervals.Interval(value, levels.lo * scale, levels.hi * scale)


def search_deployment(
    cells: list[Cell], slo: Slo, settings: Mapping[str, Any], hint: float | None = None
) -> dict[str, Any]:
    """Every seed's search and the deployment's capacity, as a JSON-ready document."""
    started = time.monotonic()
    by_seed: dict[int, list[Cell]] = {}
    for cell in sorted(cells, key=lambda c: c.workload.seed):
        by_seed.setdefault(cell.workload.seed, []).append(cell)
    both = {seed: search_seed(group, slo, settings, hint) for seed, group in by_seed.items()}
    searches = {seed: found for seed, (_, found) in both.items()}
    scouted = [p for scout, _ in both.values() if scout for p in scout.probes]
    every = scouted + [p for s in searches.values() for p in s.probes]
    first, gpus = cells[0], gpus_of(cells[0])
    axis = axis_of(first)
    ceiling = axis.ceiling(first)
    interval = capacity_in_unit(first, list(searches.values()))
    at_capacity = [s.at_capacity for s in searches.values() if s.at_capacity]
    tokens = (
        intervals.t_interval([p.output_tokens_per_s for p in at_capacity]) if at_capacity else None
    )
    breaks = Counter(s.breaks_first[0] for s in searches.values() if s.breaks_first)
    price = settings.get("gpu_hour_usd")
    return {
        "backend": first.backend,
        "recipe": first.recipe,
        "model": first.model.name,
        "mode": first.mode.name,
        "topology": first.topology.spelling,
        "input_len": first.workload.input_len,
        "output_len": first.workload.output_len,
        "gpus": gpus,
        "slo": slo.describe(),
        "repeats": len(searches),
        "load": axis.name,
        "capacity_unit": axis.unit,
        "capacity": interval.value,
        "capacity_lo": interval.lo,
        "capacity_hi": interval.hi,
        "capacity_per_gpu": interval.value / gpus,
        "capacity_level": capacity.capacity_interval(searches.values()).value,
        "edge_resolution": (
            capacity.edge_resolution(next(iter(searches.values()))) if len(searches) == 1 else None
        ),
        "level_unit": axis.level_unit,
        "requests_per_s": (
            float(sum(p.requests_per_s for p in at_capacity) / len(at_capacity))
            if at_capacity
            else 0.0
        ),
        "output_tokens_per_s_per_gpu": tokens.value / gpus if tokens else 0.0,
        "breaks_first": breaks.most_common(1)[0][0] if breaks else None,
        "limited": any(s.limited for s in searches.values()),
        "ceiling": ceiling,
        "min_duration_s": min_duration_s(first, settings),
        "extra_runs": extra_runs(first, settings),
        "cost_per_mtok_usd": (
            capacity.cost_per_million_tokens(price, gpus, tokens.value)
            if price and tokens
            else None
        ),
        "probes": len(every),
        "probe_runs": sum(p.runs for p in every),
        "probe_requests": sum(p.requests for p in every),
        "search_wall_s": time.monotonic() - started,
        "started_from": "simulator" if hint else ("ceiling" if ceiling else "blind"),
        "simulated_capacity_level": hint,
        "searches": [
            {
                "seed": seed,
                "capacity_level": s.capacity,
                "failing_level": s.failing,
                "limit_level": s.limit,
                "breaks_first": list(s.breaks_first),
                "probes": [_probe_dict(p) for p in s.probes],
                "scout_probes": [_probe_dict(p) for p in scout.probes] if scout else [],
            }
            for seed, (scout, s) in both.items()
        ],
    }


def write_deployment(document: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    write_text(path, json.dumps(document, indent=1, sort_keys=True) + "\n")


def capacity_job(
    cells_json: str,
    slo_config: Mapping[str, Any],
    settings: Mapping[str, Any],
    simulated: Sequence[str],
    output: str | os.PathLike[str],
) -> None:
    """One capacity job (rules/capacity.smk): the deployment's cells as JSON, the config's `slo`
    and `capacity`; on a measured run ``simulated`` holds the simulator twin's capacity document
    for the deployment, and the search starts from it."""
    cells = [Cell.from_dict(data) for data in json.loads(cells_json)]
    twin = None
    if simulated:
        with open(simulated[0], encoding="utf-8") as document:
            twin = json.load(document)
    hint = (twin["capacity_level"] or None) if twin else None
    document = search_deployment(cells, Slo.from_config(slo_config), settings, hint)
    if twin:
        document.update(simulated_fields(twin))
    write_deployment(document, output)


def simulated_fields(twin: Mapping[str, Any]) -> dict[str, float]:
    """The simulator twin's capacity per GPU and its interval, kept in the measured document:
    the deployment's row of the error ledger (`capacity.LedgerRow`)."""
    gpus = twin["gpus"]
    return {
        "simulated_capacity_per_gpu": twin["capacity_per_gpu"],
        "simulated_capacity_lo_per_gpu": twin["capacity_lo"] / gpus,
        "simulated_capacity_hi_per_gpu": twin["capacity_hi"] / gpus,
    }


TABLE_COLUMNS = (
    "model", "mode", "topology", "recipe", "input_len", "output_len", "gpus", "repeats", "capacity",
    "capacity_lo", "capacity_hi", "capacity_unit", "capacity_per_gpu", "requests_per_s",
    "output_tokens_per_s_per_gpu", "breaks_first", "limited", "ceiling", "level_unit",
    "min_duration_s", "cost_per_mtok_usd", "probes", "probe_requests", "search_wall_s",
    "simulated_capacity_per_gpu", "predicted_lo_per_gpu", "predicted_hi_per_gpu",
)  # fmt: skip
"""The study's capacity table. On a measured backend each row is also the deployment's entry
in the error ledger: the simulator's capacity per GPU for it, and the range the simulator
alone predicted (`capacity.predicted_ranges`: its interval scaled by how far off it was on
the study's other deployments); empty on the simulator, and left out of its HTML table."""
LEDGER_COLUMNS = TABLE_COLUMNS[-3:]

TABLE_SCHEMA = {
    **dict.fromkeys(
        ("model", "mode", "topology", "recipe", "breaks_first", "capacity_unit", "level_unit"),
        pl.String(),
    ),
    "limited": pl.Boolean(),
    **dict.fromkeys(
        ("input_len", "output_len", "gpus", "repeats", "probes", "probe_requests"), pl.Int64()
    ),
    **dict.fromkeys(
        (
            "capacity", "capacity_lo", "capacity_hi", "capacity_per_gpu", "requests_per_s",
            "output_tokens_per_s_per_gpu", "ceiling", "min_duration_s", "cost_per_mtok_usd",
            "search_wall_s", "simulated_capacity_per_gpu", "predicted_lo_per_gpu",
            "predicted_hi_per_gpu",
        ),
        pl.Float64(),
    ),
}  # fmt: skip


def write_study_table(
    paths: Iterable[str | os.PathLike[str]], title: str, parquet: str, csv: str, html: str
) -> None:
    """One capacity_table job (rules/capacity.smk): the study's table as Parquet, CSV, HTML."""
    table = study_table(paths)
    columns = [
        (name, name.replace("_", " "))
        for name in TABLE_COLUMNS
        if name not in LEDGER_COLUMNS or table[name].null_count() < table.height
    ]
    aggregate.write_summary(
        table, parquet, csv, html, title=f"Capacity at the SLO — {title}", columns=columns
    )


def study_table(paths: Iterable[str | os.PathLike[str]]) -> pl.DataFrame:
    """One row per deployment of a study, highest capacity per GPU first."""
    rows = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    ledger = [
        capacity.LedgerRow(
            r["capacity_per_gpu"],
            r.get("simulated_capacity_per_gpu"),
            r.get("simulated_capacity_lo_per_gpu"),
            r.get("simulated_capacity_hi_per_gpu"),
        )
        for r in rows
    ]
    for row, span in zip(rows, capacity.predicted_ranges(ledger), strict=True):
        row["predicted_lo_per_gpu"], row["predicted_hi_per_gpu"] = span or (None, None)
    frame = pl.DataFrame([{k: r.get(k) for k in TABLE_COLUMNS} for r in rows], schema=TABLE_SCHEMA)
    return frame.sort(["input_len", "capacity_per_gpu"], descending=[False, True])
