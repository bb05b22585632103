"""Scoring shared by the fidelity benchmark's two sets: a published value beside the simulator's
value of it (`Point`), the band it must fall in, and the tables that count, per source, regime,
GPU and metric, how many fall inside it and their MAPE (`benchmarks/fidelity.py` prints them)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from servematrix.backends.cell import identity
from servematrix.engine.steptime import StepTimeModel
from servematrix.results.metrics import CellMetrics, compute
from servematrix.simulate import simulate
from servematrix.spec.matrix import Cell
from servematrix.spec.trace import RequestRecord, to_table

BAND = (0.77, 1.3)
FAMILIES = ("ttft", "tpot", "itl")
STATS = ("mean", "median", "p99")
METRICS = tuple(f"{stat}_{family}_ms" for family in FAMILIES for stat in STATS)
SERVE_METRICS = (*METRICS, *(f"{stat}_e2el_ms" for stat in STATS))
"""What a simulated ``serve`` row can be compared on: Mooncake's tables publish no E2E
latency, the spot check's per-request data give it (``validation_published.csv`` header)."""
REGIMES = ("low", "moderate", "saturated")
GOAL_IN_BAND = 0.85
GOAL_REGIME_IN_BAND = 0.70
GOAL_MODERATE_TTFT_MAPE_PERCENT = 20.0
"""Issue 19's targets on the validation set: the share in band overall and per regime, and the
moderate-load mean-TTFT MAPE."""
GOAL_GPU_IN_BAND = 0.70
"""Issue 42's: no GPU below this share in band (beside the 85 % overall)."""


def predict(
    cell: Cell,
    send_times_s: Sequence[float] | None = None,
    measured_from: int = 0,
    chat_stream: bool = False,
    step_time: StepTimeModel | None = None,
) -> CellMetrics:
    """Simulate one cell (at ``send_times_s`` if given) and compute the client's metrics.
    Requests before id ``measured_from`` stand for earlier runs on the same server: they are
    simulated, but not measured (counted as warm-ups). ``chat_stream``: the run's client read
    chat completion streams (`as_chat_stream`). ``step_time`` replaces the engine's step-time
    model (`servematrix.simulate.simulate`)."""
    records = simulate(cell, step_time, send_times_s=send_times_s).records
    if measured_from:
        records = [replace(r, warmup=r.warmup or r.request_id < measured_from) for r in records]
    if chat_stream:
        records = [as_chat_stream(r) for r in records]
    return compute(to_table(identity(cell), records, {}))


def as_chat_stream(record: RequestRecord) -> RequestRecord:
    """A request as ``vllm bench serve --backend openai-chat`` sees vLLM's chat stream: one
    event more than a completion stream, the role chunk, which vLLM 0.11's ``serving_chat``
    (``chat_completion_stream_generator``) yields from the first engine output just before that
    output's token chunk (``delta: {"role": "assistant", "content": ""}``, no tokens). The
    client (``async_request_openai_chat_completions``, ``vllm/benchmarks/lib/
    endpoint_request_func.py``) times every chunk with ``choices``: TTFT at the role chunk, an
    ITL for each later chunk, so a request of n tokens has n ITLs, the first about 0, and the
    mean ITL is (E2E - TTFT) / n where TPOT divides by n - 1. The servematrix client speaks
    ``/v1/completions``; this adds that event to a simulated request's stream."""
    if not record.chunk_s:
        return record
    return replace(
        record,
        chunk_s=[record.chunk_s[0], *record.chunk_s],
        chunk_tokens=[0, *record.chunk_tokens],
    )


def in_band(ratio: float | None) -> bool:
    return ratio is not None and BAND[0] <= ratio <= BAND[1]


def number(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "  -  "
    return f"{ratio:5.2f}{' ' if in_band(ratio) else '!'}"


@dataclass(frozen=True)
class Point:
    """One published value and the simulator's value of it at each seed (seed 0 first)."""

    set_name: str  # "calibration" | "validation"
    source: str
    regime: str
    gpu: str
    label: str
    metric: str
    published: float
    predicted: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return self.predicted[0] / self.published

    @property
    def ratio_range(self) -> tuple[float, float]:
        return min(self.predicted) / self.published, max(self.predicted) / self.published

    def in_band_at(self, seed_index: int) -> bool:
        return in_band(self.predicted[seed_index] / self.published)


def _share(points: Sequence[Point], seed_index: int = 0) -> tuple[int, int]:
    return sum(p.in_band_at(seed_index) for p in points), len(points)


def _share_text(points: Sequence[Point], seeds: int) -> str:
    inside, total = _share(points)
    text = f"{inside:>4}/{total:<4} {100 * inside / total:5.1f} %" if total else "   -"
    if seeds > 1 and total:
        per_seed = [_share(points, k)[0] for k in range(seeds)]
        median = statistics.median(per_seed)
        text += f"  seeds {min(per_seed)}-{max(per_seed)} (median {median:g}, "
        text += f"{100 * median / total:.0f} %)"
    return text


def _regime_shares(points: Sequence[Point], seeds: int) -> list[str]:
    """The in-band share overall and per regime."""
    lines = [f"{'all':<52} {_share_text(points, seeds)}"]
    for regime in REGIMES:
        subset = [p for p in points if p.regime == regime]
        if subset:
            lines.append(f"{'  regime ' + regime:<52} {_share_text(subset, seeds)}")
    return lines


def format_breakdown(points: Sequence[Point], seeds: int, title: str) -> list[str]:
    """In-band share per source, regime and metric, and overall (seed 0; seed range with
    ``--seeds``)."""
    low, high = BAND
    lines = [f"== {title}: ratios predicted/published within {low}-{high} (seed 0)"]
    if not points:
        return [*lines, "no simulated values"]
    lines += _regime_shares(points, seeds)
    groups: dict[tuple[str, str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.source, point.regime, point.metric), []).append(point)
    for (source, regime, metric), subset in groups.items():
        ratios = sorted(p.ratio for p in subset)
        median = statistics.median(ratios)
        name = f"  {source} / {regime} / {metric}"
        lines.append(
            f"{name:<52} {_share_text(subset, seeds)}  ratio median {median:.2f} "
            f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]"
        )
    return lines


def mape_percent(points: Sequence[Point]) -> float:
    """Mean absolute percentage error of the seed-0 predictions."""
    return 100 * statistics.fmean(abs(p.ratio - 1) for p in points)


def format_mape(points: Sequence[Point], title: str) -> list[str]:
    """MAPE and in-band share per regime and GPU, overall and per metric (seed 0): the table
    the issue compares with the best published simulator's figures."""
    low, high = BAND
    lines = [
        f"== {title}: MAPE and share of ratios within {low}-{high} per regime and GPU (seed 0)"
    ]
    lines.append(
        f"{'regime':<10} {'gpu':<16} {'metric':<26} {'values':>6} {'in band':>8} {'MAPE':>8}"
    )
    groups: dict[tuple[str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.regime, point.gpu), []).append(point)
    for (regime, gpu), subset in sorted(
        groups.items(), key=lambda item: (REGIMES.index(item[0][0]), item[0][1])
    ):
        by_metric: dict[str, list[Point]] = {"all": subset}
        for point in subset:
            by_metric.setdefault(point.metric, []).append(point)
        for metric, group in by_metric.items():
            inside, total = _share(group)
            lines.append(
                f"{regime:<10} {gpu:<16} {metric:<26} {total:>6} {100 * inside / total:>7.1f}% "
                f"{mape_percent(group):>7.1f}%"
            )
    return lines


BLIS_MEDIAN_MAPE_PERCENT = {"ttft": 17.6, "itl": 7.1, "e2el": 6.7}
"""The best published vLLM simulator's median MAPE over its 36 held-out experiments (BLIS, "how
BLIS learns latency", inference-sim), as issue 19 quotes it: its own runs, not these."""
BLIS_ISSUE_ROWS_MAPE_PERCENT = {
    "mean_ttft_ms": 15.1, "p99_ttft_ms": 47.8, "mean_tpot_ms": 8.7, "mean_e2el_ms": 7.5,
}  # fmt: skip
"""BLIS's MAPE on the held-out moderate-load vLLM 0.15 runs issue 19 was filed with (18.5 % over
all their metrics, 82 % in band): other runs again, held out from this project."""


def format_without_e2e(points: Sequence[Point]) -> list[str]:
    """The in-band counts without the E2E values: the spot check's fixed output lengths make its
    mean E2E TTFT + (output − 1) × TPOT, so those values mostly restate two counted already."""
    rest = [p for p in points if "_e2el_" not in p.metric]
    title = f"== VALIDATION without E2E latency ({len(points) - len(rest)} values left out)"
    return [title, *_regime_shares(rest, 1)]


def _percent(value: float | None, width: int) -> str:
    return f"{value:>{width - 1}.1f}%" if value is not None else f"{'-':>{width}}"


def format_vs_blis(points: Sequence[Point]) -> list[str]:
    """Per latency family and metric over the ``serve`` values: count, in-band share, MAPE, the
    median of the values' errors (one value per run and metric: BLIS's median over experiments),
    the moderate-load MAPE, and BLIS's published figures beside them. BLIS's figures are on other
    runs: a side-by-side, not a like-for-like score."""
    lines = [
        "== VALIDATION latency metrics next to the best published simulator's figures (seed 0; "
        "BLIS's are on its own held-out runs, not these)",
        f"{'metric':<16} {'values':>6} {'in band':>8} {'MAPE':>7} {'median':>7} {'moderate':>9} "
        f"{'BLIS 36 runs':>12} {'BLIS issue rows':>15}",
    ]
    for family in (*FAMILIES, "e2el"):
        metrics = [f"{stat}_{family}_ms" for stat in STATS]
        for name in (f"{family} (all)", *metrics):
            wanted = metrics if name.endswith("(all)") else [name]
            group = [p for p in points if p.metric in wanted]
            if not group:
                continue
            inside, total = _share(group)
            moderate = [p for p in group if p.regime == "moderate"]
            median = statistics.median(100 * abs(p.ratio - 1) for p in group)
            blis = BLIS_MEDIAN_MAPE_PERCENT.get(family) if name == f"mean_{family}_ms" else None
            lines.append(
                f"{name:<16} {total:>6} {100 * inside / total:>7.1f}% "
                f"{_percent(mape_percent(group), 7)} {_percent(median, 7)} "
                f"{_percent(mape_percent(moderate) if moderate else None, 9)} "
                f"{_percent(blis, 12)} {_percent(BLIS_ISSUE_ROWS_MAPE_PERCENT.get(name), 15)}"
            )
    return lines


def _goal_line(name: str, points: Sequence[Point], goal: float) -> str:
    inside, total = _share(points)
    missing = math.ceil(goal * total) - inside
    verdict = "met" if missing <= 0 else f"{missing} values short"
    share = f"{inside:>4}/{total:<4} {100 * inside / total:5.1f} %"
    return f"{name:<28} {share}  goal {goal:.0%}: {verdict}"


def format_goals(points: Sequence[Point]) -> list[str]:
    """Issues 19's and 42's goals against the validation set at seed 0, and where the values the
    missed ones lack are: the values outside the band per regime, source and GPU, how many of
    them are below and above it, and their ratios' median. Why each is off, where known, is
    docs/calibration.md."""
    lines = [
        "== VALIDATION against issue 19's and 42's goals (seed 0)",
        _goal_line("all", points, GOAL_IN_BAND),
    ]
    for regime in REGIMES:
        subset = [p for p in points if p.regime == regime]
        if subset:
            lines.append(_goal_line(f"regime {regime}", subset, GOAL_REGIME_IN_BAND))
    for gpu in sorted({p.gpu for p in points}):
        subset = [p for p in points if p.gpu == gpu]
        lines.append(_goal_line(f"gpu {gpu}", subset, GOAL_GPU_IN_BAND))
    ttft = [p for p in points if p.regime == "moderate" and p.metric == "mean_ttft_ms"]
    if ttft:
        mape = mape_percent(ttft)
        verdict = "met" if mape < GOAL_MODERATE_TTFT_MAPE_PERCENT else "not met"
        ratios = ", ".join(f"{p.ratio:.2f}" for p in ttft)
        lines.append(
            f"{'moderate mean-TTFT MAPE':<28} {mape:5.1f} % over {len(ttft)} values ({ratios})  "
            f"goal under {GOAL_MODERATE_TTFT_MAPE_PERCENT:.0f} %: {verdict}"
        )
    lines.append(
        "outside the band, per regime, source and GPU: out/values (below, above), median ratio"
    )
    groups: dict[tuple[str, str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.regime, point.source, point.gpu), []).append(point)
    rows = []
    for (regime, source, gpu), subset in groups.items():
        out = [p.ratio for p in subset if not in_band(p.ratio)]
        if out:
            below = sum(r < BAND[0] for r in out)
            rows.append(
                (regime, -len(out), source, gpu, len(subset), below, statistics.median(out))
            )
    for regime, minus_out, source, gpu, total, below, median in sorted(rows):
        name = f"  {regime} {source} {gpu}"
        lines.append(
            f"{name:<48} {-minus_out:>3}/{total:<3} ({below} below, {-minus_out - below} above)"
            f"  {median:.2f}"
        )
    return lines


def format_values(points: Sequence[Point], skipped, seeds: int, title: str) -> list[str]:
    """One line per value: published, predicted (seed 0), ratio, seed range."""
    lines = [
        f"== {title}: published, predicted at seed 0, ratio (! = outside band)"
        + (f", ratio range over {seeds} seeds (* = published inside it)" if seeds > 1 else "")
    ]
    width = max((len(p.label) for p in points), default=10)
    for point in points:
        low, high = point.ratio_range
        spread = ""
        if seeds > 1:
            inside = min(point.predicted) <= point.published <= max(point.predicted)
            spread = f"  [{low:.2f}-{high:.2f}]{'*' if inside else ''}"
        lines.append(
            f"{point.label:<{width}} {point.metric:<24} {number(point.published):>7} "
            f"{number(point.predicted[0]):>7} {ratio_text(point.ratio)}{spread}"
        )
    for run, why in skipped:
        lines.append(f"{run.label:<{width}} not simulated ({len(run.published)} values): {why}")
    return lines


def write_points_csv(points: Sequence[Point], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["set", "source", "regime", "row", "metric", "published", "predicted_seed0",
                         "ratio", "ratio_min", "ratio_max"])  # fmt: skip
        for p in points:
            low, high = p.ratio_range
            ratios = (f"{p.ratio:.4f}", f"{low:.4f}", f"{high:.4f}")
            writer.writerow([p.set_name, p.source, p.regime, p.label, p.metric, p.published,
                             p.predicted[0], *ratios])  # fmt: skip
