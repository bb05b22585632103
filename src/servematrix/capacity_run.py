"""The capacity search of one deployment, run through the ordinary cell code.

A deployment is a model × mode × recipe × workload without its rate and seed. Each probe is a
real cell (``servematrix.cell.run_cell``) whose trace lands at the cell's usual path under
``results/``, so probes are cached and resumable like any cell: a trace already there for the
same cell settings is reused, not rerun. The study's own rates are free probes (their traces
are the rule's inputs). With repeats, one search per seed; the capacity is their mean with a
95 % interval. Results are one JSON document per deployment and a table per study.
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

from servematrix import aggregate, capacity, intervals, trace
from servematrix.cell import run_cell
from servematrix.files import write_text
from servematrix.matrix import Cell, Config, workload_token
from servematrix.slo import Slo

log = logging.getLogger(__name__)


def gpus_of(cell: Cell) -> int:
    return cell.model.tensor_parallel * cell.mode.instances


def deployment_token(cell: Cell) -> str:
    """The workload's file name without its rate and seed (``in1024_out6_n200``, suffixes)."""
    w = cell.workload
    head = f"qps{w.qps:g}_"
    token = workload_token(w).removeprefix(head)
    core = f"in{w.input_len}_out{w.output_len}_n{w.num_prompts}"
    return (
        core
        + token.removeprefix(f"{core}_s{w.seed}")
        + ("_apc" if cell.serving.prefix_caching else "")
    )


def deployment_path(cell: Cell) -> str:
    return (
        f"results/{cell.backend}/capacity/{cell.recipe}/{cell.model.name}/{cell.mode.name}/"
        f"{deployment_token(cell)}.json"
    )


def deployments(cells: Iterable[Cell]) -> dict[str, list[Cell]]:
    """Deployment document path → its cells (every rate and seed), in a stable order.

    A workload with ``max_concurrency`` is left out: its client holds requests back, so a
    higher offered rate is not more load and there is no rate at which the SLO breaks."""
    found: dict[str, list[Cell]] = {}
    for cell in cells:
        if cell.workload.max_concurrency is not None:
            continue
        group = found.setdefault(deployment_path(cell), [])
        if cell not in group:
            group.append(cell)
    return found


def study_deployments(cfg: Config, study: str) -> list[str]:
    return list(deployments(cfg.studies[study].cells))


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


def probe_cell(cell: Cell, slo: Slo) -> capacity.Probe:
    """Run (or reuse) one cell and judge it against the SLO."""
    table = _reusable(cell)
    if table is None:
        log.info("probe %s", cell.path)
        table = run_cell(cell, cell.path)
    row = aggregate.table_summary_row(table, cell.path, slo.per_request_ms(), with_intervals=False)
    verdict = slo.check(row)
    return capacity.Probe(
        cell.workload.qps, verdict.met, verdict.broken, row["output_throughput"], cell.path
    )


def at_rate(cell: Cell, rate_rps: float) -> Cell:
    return replace(cell, workload=replace(cell.workload, qps=float(rate_rps)))


def search_seed(
    cells: list[Cell], slo: Slo, settings: Mapping[str, Any], hint_rps: float | None = None
) -> capacity.Search:
    """One seed's search: the configured rates first, then from the simulator's capacity
    (``hint_rps``, steps of ``WARM_FACTOR``) or by doubling from the highest passing rate."""
    # qps: .inf (everything at once) is a configured point but no rate to bracket with.
    known = [probe_cell(cell, slo) for cell in cells if math.isfinite(cell.workload.qps)]
    guess = hint_rps or max((p.rate_rps for p in known), default=1.0)
    factor = capacity.WARM_FACTOR if hint_rps else capacity.BLIND_FACTOR
    if hint_rps:
        known = []  # around the hint alone: configured rates would widen its first bracket
    return capacity.search(
        lambda rate: probe_cell(at_rate(cells[0], rate), slo),
        guess,
        factor,
        settings["tolerance"],
        settings["max_probes"],
        known,
    )


def _probe_dict(probe: capacity.Probe) -> dict[str, Any]:
    return {
        "rate_rps": probe.rate_rps,
        "met": probe.met,
        "broken": list(probe.broken),
        "output_tokens_per_s": probe.output_tokens_per_s,
        "trace": probe.trace,
    }


def search_deployment(
    cells: list[Cell], slo: Slo, settings: Mapping[str, Any], hint_rps: float | None = None
) -> dict[str, Any]:
    """Every seed's search and the deployment's capacity, as a JSON-ready document."""
    started = time.monotonic()
    by_seed: dict[int, list[Cell]] = {}
    for cell in sorted(cells, key=lambda c: (c.workload.seed, c.workload.qps)):
        by_seed.setdefault(cell.workload.seed, []).append(cell)
    searches = {
        seed: search_seed(group, slo, settings, hint_rps) for seed, group in by_seed.items()
    }
    started_from = "simulator" if hint_rps else "blind"
    first, gpus = cells[0], gpus_of(cells[0])
    interval = capacity.capacity_interval(searches.values())
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
        "input_len": first.workload.input_len,
        "output_len": first.workload.output_len,
        "gpus": gpus,
        "slo": slo.describe(),
        "repeats": len(searches),
        "capacity_rps": interval.value,
        "capacity_lo_rps": interval.lo,
        "capacity_hi_rps": interval.hi,
        "capacity_per_gpu": interval.value / gpus,
        "output_tokens_per_s_per_gpu": tokens.value / gpus if tokens else 0.0,
        "breaks_first": breaks.most_common(1)[0][0] if breaks else None,
        "cost_per_mtok_usd": (
            capacity.cost_per_million_tokens(price, gpus, tokens.value)
            if price and tokens
            else None
        ),
        "probes": sum(len(s.probes) for s in searches.values()),
        "new_probes": sum(s.new_probes for s in searches.values()),
        "search_wall_s": time.monotonic() - started,
        "started_from": started_from,
        "simulated_capacity_rps": hint_rps,
        "searches": [
            {
                "seed": seed,
                "capacity_rps": s.capacity_rps,
                "failing_rps": s.failing_rps,
                "breaks_first": list(s.breaks_first),
                "probes": [_probe_dict(p) for p in s.probes],
            }
            for seed, s in searches.items()
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
    hint = None
    if simulated:
        with open(simulated[0], encoding="utf-8") as document:
            hint = json.load(document)["capacity_rps"] or None
    document = search_deployment(cells, Slo.from_config(slo_config), settings, hint)
    write_deployment(document, output)


TABLE_COLUMNS = (
    "model", "mode", "recipe", "input_len", "output_len", "gpus", "repeats", "capacity_rps",
    "capacity_lo_rps", "capacity_hi_rps", "capacity_per_gpu", "output_tokens_per_s_per_gpu",
    "breaks_first", "cost_per_mtok_usd", "probes", "new_probes", "search_wall_s",
)  # fmt: skip

TABLE_SCHEMA = {
    **dict.fromkeys(("model", "mode", "recipe", "breaks_first"), pl.String()),
    **dict.fromkeys(
        ("input_len", "output_len", "gpus", "repeats", "probes", "new_probes"), pl.Int64()
    ),
    **dict.fromkeys(
        (
            "capacity_rps", "capacity_lo_rps", "capacity_hi_rps", "capacity_per_gpu",
            "output_tokens_per_s_per_gpu", "cost_per_mtok_usd", "search_wall_s",
        ),
        pl.Float64(),
    ),
}  # fmt: skip


def write_study_table(
    paths: Iterable[str | os.PathLike[str]], title: str, parquet: str, csv: str, html: str
) -> None:
    """One capacity_table job (rules/capacity.smk): the study's table as Parquet, CSV, HTML."""
    columns = [(name, name.replace("_", " ")) for name in TABLE_COLUMNS]
    table = study_table(paths)
    aggregate.write_summary(
        table, parquet, csv, html, title=f"Capacity at the SLO — {title}", columns=columns
    )


def study_table(paths: Iterable[str | os.PathLike[str]]) -> pl.DataFrame:
    """One row per deployment of a study, highest capacity per GPU first."""
    rows = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    frame = pl.DataFrame([{k: r[k] for k in TABLE_COLUMNS} for r in rows], schema=TABLE_SCHEMA)
    return frame.sort(["input_len", "capacity_per_gpu"], descending=[False, True])
