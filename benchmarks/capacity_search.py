"""Capacity search over every deployment of a config: probes and wall time per deployment.

Runs ``servematrix.capacity.run.search_deployment`` for every deployment of every study (each
deployment once, as the workflow does) in a fresh scratch directory, so every probe is a new
cell (nothing cached), one process, one thread. Prints one row per deployment (study, model,
mode, input length, capacity per GPU and the bracket it was found in, its interval (the
bracket widened by the probes' noise, ``capacity.edge_resolution``), the physical ceiling,
what broke first above it, probes and their requests, wall time of the search), how far
the capacity moves when the probes are twice as long (``min_duration_s`` and
``tail_requests`` doubled) and whether it stays inside the interval, then the totals.
``--extra-runs N`` sets ``capacity.extra_runs`` (a probe within noise of its limit pools up
to N more runs at its rate) for both searches.

``--emulator-study NAME`` instead measures, per deployment of that study, the emulator's
capacity (its search started from the simulator's), what a probe cost in wall time, and long
emulator runs (``--long-s``) at 0.9x and 1.2x that capacity, beside the simulator's answer.
Probes on the emulator take ``capacity.min_duration_s`` of wall time each (120 s by default):
set it and ``tail_requests`` in the config to trade precision for time.

Usage (from the repository root)::

    .venv/bin/python benchmarks/capacity_search.py                      # config/config.yaml
    .venv/bin/python benchmarks/capacity_search.py --config my.yaml
    .venv/bin/python benchmarks/capacity_search.py --extra-runs 3
    .venv/bin/python benchmarks/capacity_search.py --config small.yaml --emulator-study s
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from servematrix.capacity import run as capacity_run
from servematrix.spec import config
from servematrix.spec.matrix import Config
from servematrix.workflow import check_config, stop_deployments


def _settings(cfg: Config) -> dict:
    return dict(cfg.raw["capacity"])


def simulator_table(cfg: Config) -> None:
    print(f"{'study':<16} {'model':<30} {'mode':<14} {'in':>5} {'per GPU':>8} "
          f"{'bracket':>15} {'ceiling':>8} {'breaks first':<16} {'probes':>6} {'requests':>8} "
          f"{'wall s':>7} {'interval':>15} {'2x long':>8} {'inside':>6}")  # fmt: skip
    total_s, total_probes, total_runs, seen, within, inside = 0.0, 0, 0, set(), 0, 0
    for name, study in cfg.studies.items():
        for path, cells in capacity_run.deployments(study.cells).items():
            if path in seen:
                continue
            seen.add(path)
            started = time.perf_counter()
            doc = capacity_run.search_deployment(cells, cfg.slo, _settings(cfg))
            wall_s = time.perf_counter() - started
            total_s, total_probes = total_s + wall_s, total_probes + doc["probes"]
            total_runs += doc["probe_runs"]
            doubled = capacity_run.search_deployment(
                cells,
                cfg.slo,
                {
                    **_settings(cfg),
                    "min_duration_s": 2 * doc["min_duration_s"],
                    "tail_requests": 2 * _settings(cfg)["tail_requests"],
                },
            )
            change = doubled["capacity"] / doc["capacity"] - 1 if doc["capacity"] else 0
            held = doc["capacity_lo"] <= doubled["capacity"] <= doc["capacity_hi"]
            within, inside = within + (abs(change) <= _settings(cfg)["tolerance"]), inside + held
            interval = (
                f"[{doc['capacity_lo'] / doc['gpus']:.3g}, {doc['capacity_hi'] / doc['gpus']:.3g}]"
            )
            s = doc["searches"][0]
            failing = "none" if s["failing_level"] is None else f"{s['failing_level']:g}"
            bracket = f"[{s['capacity_level']:g}, {failing}]"
            ceiling = f"{doc['ceiling']:.1f}" if doc["ceiling"] else "-"
            print(f"{name:<16} {doc['model']:<30} {doc['mode']:<14} {doc['input_len']:>5} "
                  f"{doc['capacity_per_gpu']:>8.3f} {bracket:>15} {ceiling:>8} "
                  f"{doc['breaks_first']!s:<16} {doc['probes']:>6} "
                  f"{doc['probe_requests']:>8} {wall_s:>7.2f} {interval:>15} {change:>+8.1%} "
                  f"{'yes' if held else 'NO':>6}")  # fmt: skip
    print(f"{len(seen)} deployments, {total_probes} probes ({total_runs} runs), "
          f"{total_s:.1f} s in all")  # fmt: skip
    print(f"twice as long: {within} of {len(seen)} within the tolerance, {inside} of {len(seen)} "
          "inside the interval")  # fmt: skip


def emulator_table(cfg: Config, study: str, long_s: float) -> None:
    """Per deployment of the study: the simulator's capacity, the emulator's (its search
    started from the simulator's), what a probe cost in wall time, and long emulator runs at
    0.9x and 1.2x the measured capacity."""
    twin = check_config({**cfg.raw, "backend": "simulator"})
    measured = check_config({**cfg.raw, "backend": "emulator"})
    settings = _settings(measured)
    print(f"{'model':<30} {'mode':<10} {'simulated':>9} {'measured':>8} {'probes':>6} "
          f"{'s/probe':>7} {'0.9x run':<22} {'1.2x run':<22}")  # fmt: skip
    pairs = zip(
        capacity_run.deployments(twin.studies[study].cells).values(),
        capacity_run.deployments(measured.studies[study].cells).values(),
        strict=True,
    )
    for sim_cells, cells in pairs:
        hint = capacity_run.search_deployment(sim_cells, cfg.slo, _settings(twin))["capacity_level"]
        started = time.perf_counter()
        doc = capacity_run.search_deployment(cells, cfg.slo, settings, hint or None)
        per_probe_s = (time.perf_counter() - started) / max(doc["probes"], 1)
        runs = []
        for factor in (0.9, 1.2):
            long = {**settings, "min_duration_s": long_s}
            verdict = capacity_run.probe_at(cells[0], doc["capacity_level"] * factor, cfg.slo, long)
            runs.append("met" if verdict.met else "broken: " + verdict.broken[0])
        first = cells[0]
        print(f"{first.model.name:<30} {first.mode.name:<10} {hint:>9.3g} "
              f"{doc['capacity_level']:>8.3g} {doc['probes']:>6} {per_probe_s:>7.1f} "
              f"{runs[0]:<22} {runs[1]:<22}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--emulator-study")
    parser.add_argument("--long-s", type=float, default=600.0, help="emulator long runs")
    parser.add_argument("--extra-runs", type=int, help="capacity.extra_runs for every search")
    args = parser.parse_args()
    raw = config.read_yaml(args.config)
    if args.extra_runs is not None:
        raw.setdefault("capacity", {})["extra_runs"] = args.extra_runs
    cfg = check_config(raw)
    with tempfile.TemporaryDirectory(prefix="servematrix-capacity-") as scratch:
        os.chdir(scratch)
        if args.emulator_study:
            try:
                emulator_table(cfg, args.emulator_study, args.long_s)
            finally:
                stop_deployments(check_config({**cfg.raw, "backend": "emulator"}))
        else:
            simulator_table(cfg)


if __name__ == "__main__":
    main()
