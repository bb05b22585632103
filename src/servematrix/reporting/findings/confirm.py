"""Simulated, then confirmed: what measuring changed in the answer, and how far off the
simulator was (the error ledger, issue 44).

On a measured backend every deployment's search starts from the simulator twin's capacity, and
its row of the capacity table keeps that prediction (``simulated_capacity_per_gpu``) and the range
the simulator alone predicted (``predicted_lo_per_gpu``/``predicted_hi_per_gpu``,
`servematrix.capacity.predicted_ranges`). The ranking the answer gives is the measured one; these
sentences say when it differs from the ranking the simulator gave, and how close its predictions
were. On the simulator the columns are empty and nothing is said. A study that confirmed only
the simulator's top topologies (``confirm_top``, `servematrix.capacity.confirm`) also says
which they were and what was left undeployed (`candidates_sentences`).
"""

from __future__ import annotations

import polars as pl

from servematrix.capacity.confirm import Candidate, Candidates, Comparison
from servematrix.reporting.findings.common import fmt_sig


def _simulated(rows: list[dict]) -> bool:
    return len(rows) > 1 and all(r.get("simulated_capacity_per_gpu") for r in rows)


def confirmation_sentence(label: str, rows: list[dict], top: set[str]) -> str | None:
    """When the configuration the simulator ranked first is not among the measured winners
    (``top``: the winner and those the same within noise as it), say that measuring changed
    the answer; None when it did not or there is no simulated ranking (``rows``: the measured
    ranking, best first, each with its ``name``)."""
    if not _simulated(rows):
        return None
    predicted = max(rows, key=lambda r: r["simulated_capacity_per_gpu"])
    if predicted["name"] in top:
        return None
    best, unit = rows[0], rows[0]["capacity_unit"]
    scope = f" for {label}" if label else ""
    return (
        f"Measuring changed the answer{scope}: the simulator ranked {predicted['name']} first "
        f"({fmt_sig(predicted['simulated_capacity_per_gpu'])} {unit} per GPU predicted, "
        f"{fmt_sig(predicted['capacity_per_gpu'])} measured); measured, {best['name']} carries "
        f"the most ({fmt_sig(best['capacity_per_gpu'])}; predicted "
        f"{fmt_sig(best['simulated_capacity_per_gpu'])})."
    )


def ledger_sentence(capacity: pl.DataFrame) -> str | None:
    """How far the simulator's capacities were from the measured ones over the study, and how
    many measured capacities fell inside the range predicted for them from the others."""
    rows = capacity.to_dicts()
    if not _simulated(rows):
        return None
    ratios = [r["capacity_per_gpu"] / r["simulated_capacity_per_gpu"] for r in rows]
    ranged = [r for r in rows if r["predicted_lo_per_gpu"] is not None]
    inside = sum(
        r["predicted_lo_per_gpu"] <= r["capacity_per_gpu"] <= r["predicted_hi_per_gpu"]
        for r in ranged
    )
    held_out = (
        f"; {inside} of {len(ranged)} inside the range the simulator predicted from the others"
        if ranged
        else ""
    )
    return (
        f"Measured capacity was {min(ratios):.2f}–{max(ratios):.2f}× the simulator's over the "
        f"{len(rows)} deployments{held_out}."
    )


def candidates_sentences(candidates: Candidates | None) -> list[str]:
    """One sentence per comparison of a confirming study: the simulator's top N of M that were
    measured, with their simulated ranks, and the kind of setup none of them is (none when
    the study measured every topology, ``candidates`` None)."""
    if candidates is None:
        return []
    several = len(candidates.comparisons) > 1
    return [_candidates_sentence(c, candidates.unit, several) for c in candidates.comparisons]


def _ranked(candidate: Candidate, unit: str = "") -> str:
    """``4x(TP2) (simulated rank 1, 1.29 req/s per GPU)``, or without the unit after the first
    of a list: ``2x(TP4) (rank 2, 1.25)``; a lower bound reads ``at least 1.25``."""
    value = fmt_sig(candidate.simulated_capacity_per_gpu)
    if candidate.simulated_lower_bound:
        value = f"at least {value}"
    if unit:
        return (
            f"{candidate.topology} (simulated rank {candidate.simulated_rank}, "
            f"{value} {unit} per GPU)"
        )
    return f"{candidate.topology} (rank {candidate.simulated_rank}, {value})"


def _candidates_sentence(c: Comparison, unit: str, several: bool) -> str:
    scope = f"For {c.model} at input {c.input_len} tokens, the" if several else "The"
    listed = [_ranked(p, unit if i == 0 else "") for i, p in enumerate(c.picked)]
    joined = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
    text = (
        f"{scope} measured candidates were the simulator's top {len(c.picked)} of "
        f"{c.topologies} topologies by capacity per GPU: {joined}"
    )
    left = c.topologies - len(c.picked)
    if left:
        text += (
            "; the other one was not deployed"
            if left == 1
            else f"; the other {left} were not deployed"
        )
    picked = {p.topology for p in c.picked}
    for kind, best in (("aggregated setup", c.best_aggregated), ("split", c.best_split)):
        if best is not None and best.topology not in picked:  # the picks are the top ranks
            text += (
                f"; no {kind} was among them (the simulator's best is {best.topology}, rank "
                f"{best.simulated_rank}, {fmt_sig(best.simulated_capacity_per_gpu)})"
            )
    return text + "."
