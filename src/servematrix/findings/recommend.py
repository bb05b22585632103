"""The answer first: which configuration to run at the configured SLO, and how sure.

From the study's capacity table (``servematrix.capacity_run.study_table``): the configuration
with the highest capacity per GPU at each input length, its margin over the runner-up with
both intervals (the same within noise when they overlap), where the ranking flips (by input
length, or by latency at the study's own loads), what breaks first for the weakest
configuration, the winner's memory headroom, and the caveat that applies to the numbers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import polars as pl

from servematrix.findings.common import Section, Table, fmt_mib, fmt_ms, fmt_x


@dataclass(frozen=True)
class Context:
    """What the numbers answer (``slo.Slo.describe``) and how far to trust them."""

    slo: str
    caveat: str


def config_names(capacity: pl.DataFrame) -> list[str]:
    """A name per deployment row: the model and/or mode, whichever the study varies."""
    varied = [c for c in ("model", "mode") if capacity[c].n_unique() > 1] or ["model"]
    return [" / ".join(str(row[c]) for c in varied) for row in capacity.iter_rows(named=True)]


def _per_gpu(row: dict, end: str = "") -> float:
    return row[f"capacity{end}_rps"] / row["gpus"]


def fmt_rate(value: float) -> str:
    return f"{value:,.3g}"


def _interval(row: dict) -> str:
    return f"[{fmt_rate(_per_gpu(row, '_lo'))}, {fmt_rate(_per_gpu(row, '_hi'))}]"


def _interval_kind(rows: list[dict]) -> str:
    repeats = rows[0]["repeats"]
    if repeats > 1:
        return f"95 % intervals over {repeats} repeats"
    return "one seed: the intervals are the search's brackets, not noise estimates"


def fmt_margin(best: float, second: float) -> str:
    """``+20% more`` below twice the runner-up, ``8.6×`` from there."""
    if not second:
        return "more than"
    ratio = best / second
    return f"{ratio - 1:.0%} more than" if ratio < 2 else f"{ratio:.1f}× the capacity of"


def _winner_sentences(rows: list[dict], where: str, slo: str) -> list[str]:
    best = rows[0]
    cost = best["cost_per_mtok_usd"]
    priced = f", ${cost:,.2f} per million output tokens" if cost is not None else ""
    sentences = [
        f"At the SLO ({slo}){where}, run {best['name']}: {fmt_rate(_per_gpu(best))} req/s per "
        f"GPU ({fmt_rate(best['capacity_rps'])} req/s on {best['gpus']} GPU(s), "
        f"{fmt_rate(best['output_tokens_per_s_per_gpu'])} output tokens/s per GPU{priced})."
    ]
    if len(rows) < 2:
        return sentences
    second = rows[1]
    bands = f"{_interval(best)} vs {_interval(second)} req/s per GPU; {_interval_kind(rows)}"
    if _per_gpu(best, "_lo") <= _per_gpu(second, "_hi"):
        sentences.append(
            f"{best['name']} and the runner-up {second['name']} are the same within noise "
            f"({bands})."
        )
    else:
        sentences.append(
            f"Per GPU it carries {fmt_margin(_per_gpu(best), _per_gpu(second))} the runner-up "
            f"{second['name']} ({fmt_rate(_per_gpu(second))} req/s per GPU; {bands})."
        )
    return sentences


def _short_winner(rows: list[dict]) -> str:
    """Another input length's winner in one sentence."""
    best = rows[0]
    text = (
        f"At input {best['input_len']} tokens: {best['name']}, {fmt_rate(_per_gpu(best))} req/s "
        "per GPU"
    )
    if len(rows) > 1:
        second = rows[1]
        if _per_gpu(best, "_lo") <= _per_gpu(second, "_hi"):
            text += f", the same within noise as {second['name']} ({_interval(second)})"
        else:
            text += f", {fmt_margin(_per_gpu(best), _per_gpu(second))} {second['name']}"
    return text + "."


def _loser_sentence(rows: list[dict]) -> str | None:
    worst = rows[-1]
    if len(rows) < 2 or not worst["breaks_first"]:
        return None
    breaks = Counter(r["breaks_first"] for r in rows if r["breaks_first"])
    common, count = breaks.most_common(1)[0]
    return (
        f"{worst['name']} carries the least ({fmt_rate(_per_gpu(worst))} req/s per GPU): above "
        f"{fmt_rate(worst['capacity_rps'])} req/s its {worst['breaks_first']} breaks first "
        f"({common} is the first bound to break for {count} of {len(rows)} configurations)."
    )


def _latency_flip(summary: pl.DataFrame, names: dict[tuple, str], winner: str, x: str) -> str:
    """Where another configuration has the lowest mean E2E latency at the study's own loads."""
    others: dict[str, list[str]] = {}
    for (xv,), part in summary.sort(x).group_by([x], maintain_order=True):
        part = (
            part.filter(pl.col("mean_e2el_ms").is_not_null())
            if "mean_e2el_ms" in part.columns
            else part.head(0)
        )
        if part.height < 2:
            continue
        row = part.sort("mean_e2el_ms").row(0, named=True)
        name = names.get((row["model"], row["mode"], row["input_len"]))
        if name and name != winner:
            others.setdefault(name, []).append(f"{fmt_x(x, xv)} ({fmt_ms(row['mean_e2el_ms'])})")
    if not others:
        return ""
    listed = "; ".join(f"{name} at {', '.join(points)}" for name, points in others.items())
    return f"The ranking flips by load: the lowest mean E2E latency is {listed}."


def _headroom(summary: pl.DataFrame, best: dict) -> str | None:
    if "peak_kv_cache_usage" not in summary.columns:
        return None
    part = summary.filter(
        (pl.col("model") == best["model"])
        & (pl.col("mode") == best["mode"])
        & (pl.col("input_len") == best["input_len"])
    )
    kv = part["peak_kv_cache_usage"].drop_nulls()
    gpu = part["peak_gpu_memory_mib"].drop_nulls()
    if kv.is_empty() or gpu.is_empty():
        return None
    return (
        f"Memory headroom: {best['name']} fills at most {kv.max():.1%} of its KV cache at the "
        f"study's loads, {fmt_mib(gpu.max())} on its busiest GPU."
    )


def _table(rows: list[dict]) -> Table:
    header = ["rank", "configuration", "input", "capacity (req/s)", "per GPU", "interval per GPU"]
    header += ["output tok/s per GPU", "breaks first above", "$ per M output tokens"]
    return Table(
        header,
        [
            [
                str(i + 1),
                r["name"],
                str(r["input_len"]),
                fmt_rate(r["capacity_rps"]),
                fmt_rate(_per_gpu(r)),
                _interval(r),
                fmt_rate(r["output_tokens_per_s_per_gpu"]),
                r["breaks_first"] or "none up to the search's limit",
                "—" if r["cost_per_mtok_usd"] is None else f"{r['cost_per_mtok_usd']:,.2f}",
            ]
            for i, r in enumerate(rows)
        ],
    )


def recommendation_section(
    summary: pl.DataFrame, capacity: pl.DataFrame, x: str, context: Context
) -> Section | None:
    """The study's answer at its SLO, in a few sentences and one table."""
    if capacity.is_empty():
        return None
    table = capacity.with_columns(pl.Series("name", config_names(capacity)))
    names = {
        (r["model"], r["mode"], r["input_len"]): r["name"] for r in table.iter_rows(named=True)
    }
    lengths = sorted(table["input_len"].unique().to_list())
    sentences, winners, all_rows = [], {}, []
    for input_len in lengths:
        rows = (
            table.filter(pl.col("input_len") == input_len)
            .sort("capacity_per_gpu", descending=True)
            .to_dicts()
        )
        winners[input_len] = rows[0]["name"]
        all_rows += rows
        if input_len != lengths[0]:  # the first length in full, the others in one sentence
            sentences.append(_short_winner(rows))
            continue
        where = f" at input {input_len} tokens" if len(lengths) > 1 else ""
        sentences += _winner_sentences(rows, where, context.slo)
        loser = _loser_sentence(rows)
        sentences += [loser] if loser else []
    if len(set(winners.values())) > 1:
        flips = ", ".join(f"{name} at input {n}" for n, name in winners.items())
        sentences.append(f"The ranking flips with input length: {flips}.")
    if len(lengths) == 1:
        flip = _latency_flip(summary, names, winners[lengths[0]], x)
        sentences += [flip] if flip else []
    best = next(r for r in all_rows if r["name"] == winners[lengths[-1]])
    headroom = _headroom(summary, best)
    sentences += [headroom] if headroom else []
    sentences.append(context.caveat)
    return Section("Recommendation", sentences, [_table(all_rows)])


def caveat(backend: str, gpu: str, step_times: list[str]) -> str:
    """How far to trust the numbers: simulated or measured, and where the step times came
    from (measured operator tables, or the roofline's extrapolation: ``step_times``)."""
    if backend == "simulator":
        sources = f" {step_times[0]}" if step_times else ""
        return (
            f"Caveat: simulated, not measured — servematrix's engine model of {gpu} in virtual "
            f"time.{sources} Confirm the winner with a few measured probes around its capacity."
        )
    if backend == "emulator":
        return (
            f"Caveat: real processes and HTTP around the simulated engine ({gpu}): the serving "
            "path is measured, the GPU is still the model's."
        )
    return f"Caveat: measured on the {backend} backend (one machine, one run per seed)."
