"""Study findings: the answer first (a recommendation at the configured SLO), then the
comparisons the published studies drew, as tables and sentences with numbers.

Nothing here knows a study by name. The recommendation answers the study's question (the
config's, or what varies: ``recommend.study_question``); which comparisons follow depends only
on what the summary contains: several modes are compared within each model (plain vs chunked
prefill on two instances or on one, RDMA vs TCP, aggregated vs disaggregated when those modes
are present); several models of one mode are ranked against each other. Latencies are
compared between steady points only: a point the summary marks overloaded (``steady`` False,
its queue growing) is named as such, never compared as if steady. Every number is computed
from the summary and the capacity table. Modules: ``common`` (metrics, groups, formats),
``recommend`` (the answer), ``compare`` (configurations against each other), ``health``
(limits and the harness), ``reuse`` (prefix reuse against what a trace allows), ``render``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import polars as pl

from servematrix.backends import backend_of
from servematrix.capacity.confirm import read_candidates
from servematrix.common.files import write_text
from servematrix.reporting import steptimes
from servematrix.reporting.findings.common import (
    MEAN_TPOT,
    MEAN_TTFT,
    P99_ITL,
    P99_TPOT,
    P99_TTFT,
    REQUIRED,
    Findings,
    Section,
    groups,
    overloaded,
)
from servematrix.reporting.findings.compare import (
    disaggregation_section,
    models_section,
    pair_section,
    winner_section,
)
from servematrix.reporting.findings.health import (
    health_section,
    memory_section,
    overloaded_section,
    preemption_section,
    saturation_section,
)
from servematrix.reporting.findings.recommend import (
    Context,
    capacity_section,
    no_slo_section,
    recommendation_section,
    study_question,
)
from servematrix.reporting.findings.render import recommendation_json, to_html, to_markdown
from servematrix.reporting.findings.reuse import reuse_section
from servematrix.results.aggregate import check_one_row_per_point
from servematrix.spec import trace

__all__ = [
    "Context",
    "Findings",
    "Section",
    "study_findings",
    "to_html",
    "to_markdown",
    "write_findings",
]


def _check(summary: pl.DataFrame, x: str) -> None:
    if x not in ("qps", "input_len"):
        raise ValueError(f"x must be 'qps' or 'input_len', got {x!r}")
    missing = [c for c in REQUIRED if c not in summary.columns]
    if missing:
        raise ValueError(f"study summary lacks column(s): {', '.join(missing)}")
    check_one_row_per_point(summary, x)


def _clean(summary: pl.DataFrame) -> pl.DataFrame:
    """NaN or infinite metrics (no successful request) are treated as missing values.

    ``achieved_qps`` keeps its infinity: it means every request went out at one instant; so
    do ``qps`` and ``scheduled_qps`` (``qps: inf``, every request scheduled at t = 0).
    """
    keep = ("qps", "scheduled_qps", "achieved_qps")
    floats = [c for c, t in summary.schema.items() if t.is_float() and c not in keep]
    return summary.with_columns(
        pl.when(pl.col(c).is_finite()).then(pl.col(c)).alias(c) for c in floats
    )


def study_findings(
    summary: pl.DataFrame,
    title: str,
    x: str,
    capacity: pl.DataFrame | None = None,
    context: Context | None = None,
) -> Findings:
    """Turn one study's summary (and its capacity table, with the SLO, caveat and question of
    ``context``) into sections: the recommendation first, then tables and sentences. With a
    context but no capacity table, the config sets no SLO: the recommendation says so."""
    _check(summary, x)
    if summary.is_empty():
        return Findings(title, x, [Section("No data", ["The study summary has no cells."])])
    summary = _clean(summary)
    steady = groups(summary.filter(~overloaded(summary)), x)  # latencies: steady points only
    series = [c for c in ("model", "mode") if summary[c].n_unique() > 1] or ["model"]
    answer = detail = None
    if context is not None and capacity is None:
        answer = no_slo_section()
    elif context is not None:
        answer = recommendation_section(summary, capacity, x, context)
        detail = capacity_section(capacity, study_question(capacity, context.question))
    sections = [
        answer,
        detail,
        overloaded_section(summary, x, series),
        winner_section(steady),
        pair_section(
            "Plain vs chunked prefill",
            "nondisagg",
            "chunked",
            [MEAN_TTFT, P99_TPOT, P99_ITL],
            steady,
        ),
        pair_section(
            "Plain vs chunked prefill, one instance",
            "single-plain",
            "single-chunked",
            [MEAN_TTFT, P99_TPOT, P99_ITL],
            steady,
        ),
        pair_section(
            "Mooncake RDMA vs TCP",
            "mooncake-rdma",
            "mooncake-tcp",
            [MEAN_TTFT, P99_TTFT, MEAN_TPOT],
            steady,
        ),
        disaggregation_section(steady),
        models_section(steady),
        memory_section(groups(summary, x)),
        saturation_section(summary, x, series),
        preemption_section(summary, x, series),
        reuse_section(summary, x, series),
        health_section(summary, x, series),
    ]
    return Findings(title, x, [s for s in sections if s and (s.sentences or s.tables)])


def write_findings(
    summary_path: str | os.PathLike[str],
    capacity_paths: Sequence[str],
    study: dict[str, str],
    outputs: dict[str, str],
    candidates_paths: Sequence[str] = (),
) -> None:
    """One findings job (rules/report.smk): the study's findings as Markdown (``outputs["md"]``)
    and HTML (``"html"``), its Recommendation as JSON for the front page (``"json"``).
    ``study`` holds its title, x, slo (described), gpu, profile (the engine's hardware profile,
    "" for none), backend and question (None: derived); ``capacity_paths`` its capacity
    table, when there is an SLO to search against; ``candidates_paths`` the simulator's picks
    when the study measured only those (``confirm_top``, `servematrix.capacity.confirm`)."""
    summary = pl.read_parquet(summary_path)
    capacity = pl.read_parquet(capacity_paths[0]) if capacity_paths else None
    step_times = []
    backend = backend_of(study["backend"])
    if not backend.MEASURED and not summary.is_empty():
        try:
            cells = [steptimes.cell_step_times(path) for path in summary["trace"]]
            step_times = steptimes.step_time_sentences(steptimes.group_setups(cells))
        except trace.TraceError:  # a trace from before step-time sources were recorded
            step_times = []
    caveat = backend.caveat(study["gpu"], step_times, study.get("profile") or None)
    candidates = read_candidates(candidates_paths[0]) if candidates_paths else None
    context = Context(study["slo"], caveat, study.get("question"), candidates)
    findings = study_findings(summary, study["title"], study["x"], capacity, context)
    write_text(outputs["md"], to_markdown(findings))
    write_text(outputs["html"], to_html(findings))
    write_text(outputs["json"], recommendation_json(findings))
