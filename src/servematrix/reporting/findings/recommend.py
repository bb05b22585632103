"""The answer first: what to run at the configured SLO, answering the study's own question.

A study compares something, its *question*: the modes of each model (``modes``: one
recommendation per model, never a ranking that mixes a 7B and a 72B), the models at each input
length (``models``), or how each configuration's capacity falls with input length
(``input_len``). The config may name it (``studies.<name>.question``); otherwise it is what
varies: modes, else models, else input lengths.

From the study's capacity table (``servematrix.capacity.run.study_table``), per comparison: the
configuration with the highest capacity per GPU and its margin over the runner-up (the same
within noise when their intervals overlap); whether the winner changes between comparisons or
with the study's loads (a flip is claimed only when no winner is shared); what breaks first;
the winners' memory headroom; the caveat. The answer stays within ANSWER_WORDS words (the
sentences that matter least go first when it would not); the ranking tables are the detail
below it (``capacity_section``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import polars as pl

from servematrix.capacity.confirm import Candidates
from servematrix.reporting.findings.common import (
    CAPACITY_TITLE,
    Section,
    Table,
    fmt_mib,
    fmt_ms,
    fmt_sig,
    fmt_x,
    overloaded,
    same,
)
from servematrix.reporting.findings.confirm import (
    candidates_sentences,
    confirmation_sentence,
    ledger_sentence,
)
from servematrix.spec import topology

QUESTIONS = ("modes", "models", "input_len")
ANSWER_WORDS = 250
"""At most this many words of sentences: the answer fits one screen."""
SLO_EXAMPLE = (
    "slo: {ttft: {statistic: p99, max_ms: 2000}, tpot: {statistic: p99, max_ms: 100}, "
    "attainment: 0.9}"
)
COMPARED = {"modes": "mode", "models": "model", "input_len": "model"}
"""The column each question ranks; the others (and the input length) split the rankings."""


@dataclass(frozen=True)
class Context:
    """What the numbers answer (``slo.Slo.describe``), how far to trust them, the study's
    question when the config names it, and the simulator's picks when only those were
    measured (``confirm_top``)."""

    slo: str
    caveat: str
    question: str | None = None
    candidates: Candidates | None = None


@dataclass(frozen=True)
class Ranking:
    """Configurations compared with each other at the SLO (``rows``, best first, each with the
    ``name`` of its value in ``column``, what the question compares), within ``label`` (a model,
    an input length, or nothing when the study is one comparison)."""

    label: str
    column: str
    rows: list[dict]


def study_question(table: pl.DataFrame, configured: str | None = None) -> str:
    """The question the config names, or what varies in ``table`` (a summary or capacity
    table): modes, else models, else input lengths."""
    if configured is not None:
        if configured not in QUESTIONS:
            raise ValueError(f"question must be one of {', '.join(QUESTIONS)}, got {configured!r}")
        return configured
    for question, column in (("modes", "mode"), ("models", "model"), ("input_len", "input_len")):
        if table[column].n_unique() > 1:
            return question
    return "models"


def config_names(capacity: pl.DataFrame) -> list[str]:
    """A name per deployment row: the model and/or mode, whichever the study varies."""
    varied = _varied(capacity)
    return [" / ".join(str(row[c]) for c in varied) for row in capacity.iter_rows(named=True)]


def fmt_rate(value: float) -> str:
    """Three significant figures, never in scientific notation (10,000; 351; 0.0279)."""
    return fmt_sig(value)


def _per_gpu(row: dict, end: str = "") -> float:
    return row[f"capacity{end}"] / row["gpus"]


def _unit(row: dict) -> str:
    """The capacity's unit (`servematrix.capacity.loads`): req/s, users or sessions."""
    return row["capacity_unit"]


def _interval(row: dict) -> str:
    return f"[{fmt_rate(_per_gpu(row, '_lo'))}, {fmt_rate(_per_gpu(row, '_hi'))}]"


def _tied(a: dict, b: dict) -> bool:
    """Capacities whose intervals overlap: the same within noise."""
    return _per_gpu(a, "_lo") <= _per_gpu(b, "_hi") and _per_gpu(b, "_lo") <= _per_gpu(a, "_hi")


def fmt_margin(best: float, second: float) -> str:
    """``20% more than`` below twice the runner-up, ``8.6× the capacity of`` from there."""
    if not second:
        return "more than"
    ratio = best / second
    return f"{ratio - 1:.0%} more than" if ratio < 2 else f"{ratio:.1f}× the capacity of"


def _spell(column: str, value: object) -> str:
    return f"input {value} tokens" if column == "input_len" else str(value)


def rankings(capacity: pl.DataFrame, question: str) -> list[Ranking]:
    """The comparisons the question makes, each best first: per model (``modes``), per input
    length (``models``, ``input_len``), never across what the question holds apart."""
    compared = COMPARED[question]
    keys = [
        c for c in ("model", "mode", "input_len") if c != compared and capacity[c].n_unique() > 1
    ]
    named = capacity.with_columns(pl.col(compared).cast(pl.String).alias("name"))
    if not keys:
        return [Ranking("", compared, named.sort("capacity_per_gpu", descending=True).to_dicts())]
    return [
        Ranking(
            ", ".join(_spell(c, v) for c, v in zip(keys, key, strict=True)),
            compared,
            part.sort("capacity_per_gpu", descending=True).to_dicts(),
        )
        for key, part in named.sort("input_len").group_by(keys, maintain_order=True)
    ]


def _asked(capacity: pl.DataFrame, question: str) -> str:
    if question == "input_len":
        return "how capacity falls with input length"
    several = {"modes": ("model", " for each model"), "models": ("input_len", " at each input")}
    column, scope = several[question]
    return f"the best {question[:-1]}{scope if capacity[column].n_unique() > 1 else ''}"


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _winner_sentence(ranking: Ranking) -> str:
    best = ranking.rows[0]
    scope = f"For {ranking.label}, " if ranking.label else ""
    if not best["capacity"]:
        return (
            f"{scope}no configuration meets the SLO, not even at the lowest load probed "
            f"({best['name']}'s {best['breaks_first']} breaks first): nothing to recommend."
        )
    if best.get("limited"):
        ceiling, level = best["ceiling"], best["level_unit"]
        up_to = f" up to {fmt_rate(2 * ceiling)} {level} (twice its ceiling)" if ceiling else ""
        return (
            f"{scope}{best['name']} met the SLO at every load probed{up_to}: its capacity is "
            "above that, not measured."
        )
    cost = best["cost_per_mtok_usd"]
    priced = f", ${cost:,.2f} per million output tokens" if cost is not None else ""
    text = (
        f"{'For ' + ranking.label + ', run' if ranking.label else 'Run'} {best['name']}: "
        f"{fmt_rate(_per_gpu(best))} {_unit(best)} per GPU ({fmt_rate(best['capacity'])} "
        f"{_unit(best)} on {_gpus(best['gpus'])}, "
        f"{fmt_rate(best['output_tokens_per_s_per_gpu'])} output "
        f"tokens/s per GPU{priced})"
    )
    if len(ranking.rows) > 1:
        second = ranking.rows[1]
        if _tied(best, second):
            text += (
                f", the same within noise as {second['name']} ({_interval(best)} vs "
                f"{_interval(second)} {_unit(best)} per GPU)"
            )
        else:
            text += (
                f", {fmt_margin(_per_gpu(best), _per_gpu(second))} {second['name']} "
                f"({fmt_rate(_per_gpu(second))})"
            )
    return text + "."


def split_sentence(ranking: Ranking) -> str | None:
    """The split question (a ``gpu_budget`` study, whose modes are topologies): the best
    disaggregated topology against the best aggregated one (capacity per GPU), when the
    ranking has both meeting the SLO."""
    rows = [r for r in ranking.rows if r["capacity"] and r["mode"] == r["topology"]]
    split = [r for r in rows if topology.parse(r["topology"]).disaggregated]
    together = [r for r in rows if not topology.parse(r["topology"]).disaggregated]
    if not (split and together):
        return None
    best_split, best_agg = split[0], together[0]
    scope = f"For {ranking.label}, the" if ranking.label else "The"
    unit = _unit(best_split)
    if _tied(best_split, best_agg):
        return (
            f"{scope} best split, {best_split['topology']}, and the best aggregated setup, "
            f"{best_agg['topology']}, are the same within noise ({_interval(best_split)} vs "
            f"{_interval(best_agg)} {unit} per GPU)."
        )
    if _per_gpu(best_split) > _per_gpu(best_agg):
        return (
            f"{scope} best split, {best_split['topology']} "
            f"({fmt_rate(_per_gpu(best_split))} {unit} per GPU), has "
            f"{fmt_margin(_per_gpu(best_split), _per_gpu(best_agg))} the best aggregated "
            f"setup, {best_agg['topology']} ({fmt_rate(_per_gpu(best_agg))})."
        )
    return (
        f"{scope} best aggregated setup, {best_agg['topology']} "
        f"({fmt_rate(_per_gpu(best_agg))} {unit} per GPU), beats every disaggregated split: "
        f"it has {fmt_margin(_per_gpu(best_agg), _per_gpu(best_split))} the best, "
        f"{best_split['topology']} ({fmt_rate(_per_gpu(best_split))})."
    )


def _loser_sentence(ranking: Ranking) -> str | None:
    """The weakest of three or more (of two, the runner-up sentence said it)."""
    worst = ranking.rows[-1]
    if len(ranking.rows) < 3 or not worst["breaks_first"] or _tied(worst, ranking.rows[0]):
        return None
    return (
        f"{worst['name']} carries the least{' for ' + ranking.label if ranking.label else ''} "
        f"({fmt_rate(_per_gpu(worst))} {_unit(worst)} per GPU; above "
        f"{fmt_rate(worst['capacity'])} {_unit(worst)} its {worst['breaks_first']} breaks first)."
    )


def _breaks_sentence(capacity: pl.DataFrame) -> str | None:
    breaks = Counter(b for b in capacity["breaks_first"].to_list() if b)
    if len(breaks) == 0 or capacity.height < 2:
        return None
    common, count = breaks.most_common(1)[0]
    return f"{common} is the first bound to break for {count} of {capacity.height} configurations."


def _top(ranking: Ranking) -> set[str]:
    """The winner and every configuration the same within noise as it."""
    return {r["name"] for r in ranking.rows if _tied(r, ranking.rows[0])}


def agreement_sentence(ranks: list[Ranking], question: str) -> str | None:
    """Whether the comparisons share a winner; a flip only when none is shared by all (a
    winner tied within noise with another comparison's winner is no flip)."""
    compared = [r for r in ranks if len(r.rows) > 1]
    if len(compared) < 2:
        return None
    shared = set.intersection(*(_top(r) for r in compared))
    what = "mode" if question == "modes" else "model"
    where = "every model" if question == "modes" else "every input length"
    if shared:
        winners = {r.rows[0]["name"] for r in compared}
        if len(winners) == 1 and winners <= shared:
            return f"{winners.pop()} is the best {what} for {where}."
        wins = Counter(r.rows[0]["name"] for r in compared)
        name = sorted(shared, key=lambda n: (-wins[n], n))[0]
        return f"{name} is the best {what}, or the same within noise as the best, for {where}."
    winners = "; ".join(f"{r.rows[0]['name']} for {r.label}" for r in compared)
    return f"The best {what} is not the same for {where}: {winners}."


def _scaling_sentences(capacity: pl.DataFrame) -> list[str]:
    """How each configuration's capacity falls with input length (question ``input_len``)."""
    sentences = []
    names = dict(zip(config_names(capacity), capacity.iter_rows(named=True), strict=True))
    for name in dict.fromkeys(names):
        row = names[name]
        part = capacity.filter(
            (pl.col("model") == row["model"]) & (pl.col("mode") == row["mode"])
        ).sort("input_len")
        points = part.to_dicts()
        if len(points) < 2:
            continue
        spelled = ", ".join(f"{fmt_rate(_per_gpu(p))} at {p['input_len']}" for p in points)
        first, last = _per_gpu(points[0]), _per_gpu(points[-1])
        fall = (
            f"{first / last:.1f}× less at {points[-1]['input_len']}"
            if last
            else "none at the longest"
        )
        sentences.append(f"{name}: {spelled} input tokens, in {_unit(row)} per GPU ({fall}).")
    return sentences


def _latency_flip(summary: pl.DataFrame, ranking: Ranking, x: str) -> str | None:
    """Where another configuration of the ranking has a lower mean E2E latency than its winner
    at the study's own loads, beyond the sentences' precision and any interval, and is not tied
    with the winner at the SLO; overloaded points (queue growing) are never compared as if they
    were steady."""
    if x != "qps" or len(ranking.rows) < 2 or "mean_e2el_ms" not in summary.columns:
        return None
    best, column = ranking.rows[0], ranking.column
    held = [c for c in ("model", "mode", "input_len") if c != column]
    part = summary.filter(pl.all_horizontal(pl.col(c) == best[c] for c in held))
    part = part.filter(pl.col("mean_e2el_ms").is_not_null())
    steady = part.filter(~overloaded(part))
    top, flips = _top(ranking), []
    for (xv,), points in steady.sort(x).group_by([x], maintain_order=True):
        mine = points.filter(pl.col(column) == best["name"])
        if mine.is_empty() or points.height < 2:
            continue
        low, own = points.sort("mean_e2el_ms").row(0, named=True), mine.row(0, named=True)
        if str(low[column]) in top or same(low["mean_e2el_ms"], own["mean_e2el_ms"]):
            continue
        if _e2el_overlap(low, own):
            continue
        flips.append(
            f"{low[column]} at {fmt_x(x, xv)} ({fmt_ms(low['mean_e2el_ms'])}; {best['name']} "
            f"{fmt_ms(own['mean_e2el_ms'])})"
        )
    if not flips:
        return None
    scope = f" for {ranking.label}" if ranking.label else ""
    skipped = part.height - steady.height
    left_out = f"; {skipped} overloaded point(s) are left out" if skipped else ""
    return (
        f"By mean E2E latency at the study's loads the winner changes{scope}: "
        f"{'; '.join(flips)}{left_out}."
    )


def _e2el_overlap(a: dict, b: dict) -> bool:
    """Both points' mean E2E latency intervals (with repeats) overlap: the same within noise."""
    lo, hi = "mean_e2el_ms_lo", "mean_e2el_ms_hi"
    if any(row.get(c) is None for row in (a, b) for c in (lo, hi)):
        return False
    return a[lo] <= b[hi] and b[lo] <= a[hi]


def _varied(capacity: pl.DataFrame) -> list[str]:
    return [c for c in ("model", "mode") if capacity[c].n_unique() > 1] or ["model"]


def _headroom(summary: pl.DataFrame, ranks: list[Ranking], varied: list[str]) -> str | None:
    """The winners' peak KV-cache use and GPU memory at the study's loads (each winner once)."""
    if "peak_kv_cache_usage" not in summary.columns:
        return None
    parts: dict[str, str] = {}
    for ranking in ranks:
        best = ranking.rows[0]
        name = " / ".join(str(best[c]) for c in varied)
        rows = summary.filter((pl.col("model") == best["model"]) & (pl.col("mode") == best["mode"]))
        kv, gpu = rows["peak_kv_cache_usage"].drop_nulls(), rows["peak_gpu_memory_mib"].drop_nulls()
        if name in parts or kv.is_empty() or gpu.is_empty():
            continue
        parts[name] = f"{name} fills at most {kv.max():.1%} of its KV cache ({fmt_mib(gpu.max())})"
    if not parts:
        return None
    return f"Memory headroom at the study's loads, busiest GPU: {'; '.join(parts.values())}."


def answer_words(sentences: list[str]) -> int:
    """The length of an answer in words (what ANSWER_WORDS bounds)."""
    return sum(len(sentence.split()) for sentence in sentences)


ESSENTIAL, FLIP, BREAKS, LOSER, HEADROOM = range(5)
"""Kinds of sentence: when the answer would exceed ANSWER_WORDS, HEADROOM goes first, then
LOSER, BREAKS and FLIP; ESSENTIAL ones stay."""


def _fit(lead: list[str], body: list[str], rest: list[tuple[int, str]]) -> list[str]:
    """The sentences in order, within ANSWER_WORDS: the least important kinds of ``rest``
    dropped first; if the per-comparison sentences (``body``) alone are too long, the last of
    them give way to a pointer to the tables below."""

    def whole(shown: int) -> list[str]:
        more = len(body) - shown
        note = [f"The other {more} comparison(s) are in the tables below."] if more else []
        return lead + body[:shown] + note + [s for _, s in rest]

    for level in (HEADROOM, LOSER, BREAKS, FLIP):
        if answer_words(whole(len(body))) <= ANSWER_WORDS:
            break
        rest = [(p, s) for p, s in rest if p != level]
    shown = len(body)
    while shown > 1 and answer_words(whole(shown)) > ANSWER_WORDS:
        shown -= 1
    return whole(shown)


def recommendation_section(
    summary: pl.DataFrame, capacity: pl.DataFrame, x: str, context: Context
) -> Section | None:
    """The study's answer at its SLO, in sentences (the tables: ``capacity_section``)."""
    if capacity.is_empty():
        return None
    question = study_question(capacity, context.question)
    ranks = rankings(capacity, question)
    lead = [f"The question: {_asked(capacity, question)}, at the SLO ({context.slo})."]
    if question == "input_len":
        body = _scaling_sentences(capacity)
    else:
        body = [_winner_sentence(r) for r in ranks]
    rest = [
        *((ESSENTIAL, split_sentence(r)) for r in ranks if question == "modes"),
        *((ESSENTIAL, sentence) for sentence in candidates_sentences(context.candidates)),
        *((LOSER, _loser_sentence(r)) for r in ranks if question != "input_len"),
        (ESSENTIAL, agreement_sentence(ranks, question)),
        *((ESSENTIAL, confirmation_sentence(r.label, r.rows, _top(r))) for r in ranks),
        *((FLIP, _latency_flip(summary, r, x)) for r in ranks),
        (BREAKS, _breaks_sentence(capacity)),
        (HEADROOM, _headroom(summary, ranks, _varied(capacity))),
        (ESSENTIAL, context.caveat),
    ]
    return Section("Recommendation", _fit(lead, body, [(p, s) for p, s in rest if s]))


def _interval_kind(capacity: pl.DataFrame) -> str:
    repeats = capacity["repeats"].max()
    if repeats > 1:
        return f"Intervals: 95 % over {repeats} repeats."
    return (
        "Intervals: one seed, so each is the search's bracket, widened by the noise of the "
        "SLO's statistic at its ends over how fast that statistic rises there (95 %)."
    )


def capacity_section(capacity: pl.DataFrame, question: str) -> Section | None:
    """The detail below the answer: one ranking table per comparison the question makes."""
    if capacity.is_empty():
        return None
    unit = _unit(capacity.row(0, named=True))
    header = ["rank", "configuration", f"capacity ({unit})", "GPUs", "per GPU", "interval per GPU"]
    header += ["output tok/s per GPU", "breaks first above", "$ per M output tokens"]
    ledger = ledger_sentence(capacity)
    if ledger:
        header += ["simulated per GPU", "predicted from the others"]
    tables = [
        Table(
            header,
            [
                [
                    str(i + 1),
                    r["name"],
                    fmt_rate(r["capacity"]),
                    str(r["gpus"]),
                    fmt_rate(_per_gpu(r)),
                    _interval(r),
                    fmt_rate(r["output_tokens_per_s_per_gpu"]),
                    r["breaks_first"] or "none up to the search's limit",
                    "—" if r["cost_per_mtok_usd"] is None else f"{r['cost_per_mtok_usd']:,.2f}",
                    *(_ledger_cells(r) if ledger else []),
                ]
                for i, r in enumerate(ranking.rows)
            ],
            ranking.label,
        )
        for ranking in rankings(capacity, question)
    ]
    return Section(
        CAPACITY_TITLE, [_interval_kind(capacity), *([ledger] if ledger else [])], tables
    )


def _ledger_cells(row: dict) -> list[str]:
    """The simulator's capacity per GPU and the range it predicted from the other deployments."""
    lo, hi = row["predicted_lo_per_gpu"], row["predicted_hi_per_gpu"]
    predicted = "—" if lo is None else f"[{fmt_rate(lo)}, {fmt_rate(hi)}]"
    return [fmt_rate(row["simulated_capacity_per_gpu"]), predicted]


def no_slo_section() -> Section:
    """Without ``slo:`` there is no capacity, so nothing to recommend by: say so, and how."""
    return Section(
        "Recommendation",
        [
            "No SLO is set, so there is no recommendation: a configuration's capacity is the "
            "highest rate that meets the latency targets, and the config states none.",
            f"Add the targets to the config and run again, e.g. {SLO_EXAMPLE}",
        ],
    )
