"""The split question confirmed: a measured run deploys only the simulator's top topologies.

A ``gpu_budget`` study with ``confirm_top: N`` on a measured backend first searches every
topology on its simulator twin (seconds each), then picks, per comparison (a model at an input
length), the N topologies with the highest simulated capacity per GPU (`pick`). Only those
are deployed and searched for real (`confirmed`); the others never start. The picks are one
JSON document per study (rules/capacity.smk's checkpoint writes it, the findings say it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import polars as pl

from servematrix.common.files import write_text
from servematrix.spec.matrix import Cell
from servematrix.spec.topology import parse


@dataclass(frozen=True)
class Candidate:
    """One picked topology, with its rank and capacity per GPU on the simulator;
    ``simulated_lower_bound`` when that search met the SLO at every load it tried (the
    capacity is at least this, and its rank may be higher)."""

    topology: str
    simulated_rank: int
    simulated_capacity_per_gpu: float
    simulated_lower_bound: bool = False


@dataclass(frozen=True)
class Comparison:
    """The picks among the ``topologies`` a model has at one input length, and the simulator's
    best aggregated setup and best split among them all (picked or not)."""

    model: str
    input_len: int
    topologies: int
    picked: tuple[Candidate, ...]
    best_aggregated: Candidate | None
    best_split: Candidate | None


@dataclass(frozen=True)
class Candidates:
    """A study's picks: the top ``top`` of each comparison, capacities in ``unit`` per GPU."""

    top: int
    unit: str
    comparisons: tuple[Comparison, ...]

    def keys(self) -> set[tuple[str, int, str]]:
        """(model, input length, topology) of every pick."""
        return {
            (c.model, c.input_len, candidate.topology)
            for c in self.comparisons
            for candidate in c.picked
        }


def pick(table: pl.DataFrame, top: int) -> Candidates:
    """The ``top`` topologies of each (model, input length) of the simulator's capacity table
    (`servematrix.capacity.run.study_table`), highest capacity per GPU first; a tie goes to
    the topology on fewer GPUs, then to its spelling (so a rerun picks the same)."""
    comparisons = []
    for (model, input_len), rows in table.group_by(["model", "input_len"], maintain_order=True):
        ranked = [
            Candidate(row["topology"], rank, row["capacity_per_gpu"], bool(row["limited"]))
            for rank, row in enumerate(
                rows.sort(
                    ["capacity_per_gpu", "gpus", "topology"], descending=[True, False, False]
                ).iter_rows(named=True),
                start=1,
            )
        ]
        split = [c for c in ranked if parse(c.topology).disaggregated]
        together = [c for c in ranked if not parse(c.topology).disaggregated]
        comparisons.append(
            Comparison(
                model,
                input_len,
                len(ranked),
                tuple(ranked[:top]),
                together[0] if together else None,
                split[0] if split else None,
            )
        )
    unit = table["capacity_unit"][0] if table.height else ""
    return Candidates(top, unit, tuple(comparisons))


def write_candidates(table_path: str, top: int, output: str | os.PathLike[str]) -> None:
    """The checkpoint job (rules/capacity.smk): the twin's table in, the picks out."""
    candidates = pick(pl.read_parquet(table_path), top)
    write_text(output, json.dumps(asdict(candidates), indent=1) + "\n")


def read_candidates(path: str | os.PathLike[str]) -> Candidates:
    with open(path, encoding="utf-8") as document:
        data = json.load(document)
    comparisons = tuple(
        Comparison(
            c["model"],
            c["input_len"],
            c["topologies"],
            tuple(Candidate(**candidate) for candidate in c["picked"]),
            Candidate(**c["best_aggregated"]) if c["best_aggregated"] else None,
            Candidate(**c["best_split"]) if c["best_split"] else None,
        )
        for c in data["comparisons"]
    )
    return Candidates(data["top"], data["unit"], comparisons)


def confirmed(cells: Iterable[Cell], candidates: Candidates) -> list[Cell]:
    """The study cells of the picked topologies: the ones the measured backend runs."""
    keys = candidates.keys()
    return [
        cell for cell in cells if (cell.model.name, cell.workload.input_len, cell.mode.name) in keys
    ]
