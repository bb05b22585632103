"""Capacity search over every deployment of a config: probes and wall time per deployment.

Runs ``servematrix.capacity_run.search_deployment`` for every deployment of every study (each
deployment once, as the workflow does) in a fresh scratch directory, so every probe is a new
cell (nothing cached), one process, one thread. Prints one row per deployment (study, model,
mode, input length, capacity and its bracket, probes in all, of which the study's configured
rates, wall time of the whole search including those) and the total.

``--emulator-study NAME`` instead compares, on the emulator, a search started from the
simulator's capacity (probes ``WARM_FACTOR`` apart around it) with a blind one (from the
study's lowest configured rate, doubling), per deployment of that study: measured probes and
capacities side by side, with the simulator's answer. Keep that study small (few prompts).

Usage (from the repository root)::

    .venv/bin/python benchmarks/capacity_search.py                      # config/config.yaml
    .venv/bin/python benchmarks/capacity_search.py --config my.yaml
    .venv/bin/python benchmarks/capacity_search.py --config small.yaml --emulator-study s
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from servematrix import capacity, capacity_run, config
from servematrix.deploy.order import stop_deployments
from servematrix.matrix import Config
from servematrix.workflow import check_config


def _settings(cfg: Config) -> dict:
    return dict(cfg.raw["capacity"])


def simulator_table(cfg: Config) -> None:
    print(f"{'study':<16} {'model':<30} {'mode':<14} {'in':>5} {'capacity':>9} "
          f"{'bracket':>17} {'probes':>6} {'config':>6} {'wall s':>7}")  # fmt: skip
    total_s, total_probes, seen = 0.0, 0, set()
    for name, study in cfg.studies.items():
        for path, cells in capacity_run.deployments(study.cells).items():
            if path in seen:
                continue
            seen.add(path)
            started = time.perf_counter()
            doc = capacity_run.search_deployment(cells, cfg.slo, _settings(cfg))
            wall_s = time.perf_counter() - started
            total_s, total_probes = total_s + wall_s, total_probes + doc["probes"]
            s = doc["searches"][0]
            bracket = f"[{s['capacity_rps']:g}, {s['failing_rps']:g}]"
            configured = doc["probes"] - doc["new_probes"]
            print(f"{name:<16} {doc['model']:<30} {doc['mode']:<14} {doc['input_len']:>5} "
                  f"{doc['capacity_rps']:>9.3g} {bracket:>17} {doc['probes']:>6} "
                  f"{configured:>6} {wall_s:>7.2f}")  # fmt: skip
    print(f"{len(seen)} deployments, {total_probes} probes (cells), {total_s:.1f} s in all")


def emulator_table(cfg: Config, study: str, scratch: Path) -> None:
    """Blind vs simulated-then-confirmed searches on the emulator, one deployment at a time."""
    twin = check_config({**cfg.raw, "backend": "simulator"})
    measured = check_config({**cfg.raw, "backend": "emulator"})
    settings = _settings(cfg)
    print(f"{'model':<30} {'mode':<10} {'simulator':>9} {'blind':>7} {'probes':>6} {'wall s':>7} "
          f"{'warm':>7} {'probes':>6} {'wall s':>7}")  # fmt: skip
    pairs = zip(
        capacity_run.deployments(twin.studies[study].cells).values(),
        capacity_run.deployments(measured.studies[study].cells).values(),
        strict=True,
    )
    for sim_cells, cells in pairs:
        hint = capacity_run.search_deployment(sim_cells, cfg.slo, settings)["capacity_rps"]
        lowest = min(c.workload.qps for c in cells)
        row = []
        for start in (None, hint):
            # Each search in its own directory: neither reuses the other's probes.
            workdir = tempfile.mkdtemp(prefix="blind-" if start is None else "warm-", dir=scratch)
            os.chdir(workdir)
            started = time.perf_counter()
            found = capacity.search(
                lambda rate, base=cells[0]: capacity_run.probe_cell(
                    capacity_run.at_rate(base, rate), cfg.slo
                ),
                start or lowest,
                capacity.WARM_FACTOR if start else capacity.BLIND_FACTOR,
                settings["tolerance"],
                settings["max_probes"],
            )
            row += [found.capacity_rps, len(found.probes), time.perf_counter() - started]
        first = cells[0]
        print(f"{first.model.name:<30} {first.mode.name:<10} {hint:>9.3g} {row[0]:>7.3g} "
              f"{row[1]:>6} {row[2]:>7.1f} {row[3]:>7.3g} {row[4]:>6} {row[5]:>7.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("config/config.yaml"))
    parser.add_argument("--emulator-study")
    args = parser.parse_args()
    cfg = check_config(config.read_yaml(args.config))
    with tempfile.TemporaryDirectory(prefix="servematrix-capacity-") as scratch:
        os.chdir(scratch)
        if args.emulator_study:
            try:
                emulator_table(cfg, args.emulator_study, Path(scratch))
            finally:
                stop_deployments(check_config({**cfg.raw, "backend": "emulator"}))
        else:
            simulator_table(cfg)


if __name__ == "__main__":
    main()
