"""What every findings module shares: the metrics, the groups compared, number formats, and
when two values are "the same" (within the sentences' precision, or within noise when the
summary carries 95 % intervals, see ``servematrix.results.intervals``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import polars as pl

SAME_MS = 0.05
SAME_FRACTION = 0.001
"""Two values closer than SAME_MS or than SAME_FRACTION of the larger one are "the same": a
difference the sentences' precision (0.1 ms, 0.1%) would print as zero is never a win, a loss
or a gap that grows."""


def same(a: float, b: float) -> bool:
    diff = abs(a - b)
    return diff < SAME_MS or diff < SAME_FRACTION * max(abs(a), abs(b))


REQUIRED = (
    "model",
    "mode",
    "qps",
    "input_len",
    "num_prompts",
    "completed",
    "failed",
    "scheduled_qps",
    "achieved_qps",
    "send_lag_p99_ms",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "p99_itl_ms",
)


@dataclass(frozen=True)
class Metric:
    column: str
    label: str


MEAN_TTFT = Metric("mean_ttft_ms", "mean TTFT")
P99_TTFT = Metric("p99_ttft_ms", "P99 TTFT")
MEAN_TPOT = Metric("mean_tpot_ms", "mean TPOT")
P99_TPOT = Metric("p99_tpot_ms", "P99 TPOT")
P99_ITL = Metric("p99_itl_ms", "P99 ITL")
PEAK_GPU_MEMORY = Metric("peak_gpu_memory_mib", "peak GPU memory")
PEAK_KV_USAGE = Metric("peak_kv_cache_usage", "peak KV-cache usage")
WEIGHTS_MIB = Metric("weights_mib_per_gpu", "weights per GPU")
KV_POOL_MIB = Metric("kv_pool_mib_per_gpu", "KV pool per GPU")

Curve = dict[float, float]
"""x value → metric value, only where the value is known."""


Band = dict[float, tuple[float, float]]
"""x value → the 95 % interval of a metric, where the summary has one."""


@dataclass(frozen=True)
class Table:
    """Rows of text under a header (and a title, when a section has several), rendered as a
    Markdown or HTML table."""

    header: list[str]
    rows: list[list[str]]
    title: str = ""


@dataclass(frozen=True)
class Section:
    title: str
    sentences: list[str]
    tables: list[Table] = field(default_factory=list)


@dataclass(frozen=True)
class Findings:
    title: str
    x: str
    sections: list[Section]


@dataclass(frozen=True)
class Group:
    """Configurations compared with each other: one model's modes, or the models of one mode."""

    label: str | None
    series: str
    rows: pl.DataFrame
    x: str

    @property
    def names(self) -> list[str]:
        return self.rows[self.series].unique(maintain_order=True).to_list()

    @property
    def xs(self) -> list[float]:
        return sorted(self.rows[self.x].unique().to_list())

    def curve(self, name: str, metric: Metric) -> Curve:
        part = self.rows.filter(pl.col(self.series) == name)
        return {
            float(xv): float(v)
            for xv, v in zip(part[self.x], part[metric.column], strict=True)
            if v is not None
        }

    def band(self, name: str, metric: Metric) -> Band:
        """The metric's interval at each x (none when the summary has no interval columns)."""
        lo, hi = f"{metric.column}_lo", f"{metric.column}_hi"
        if lo not in self.rows.columns:
            return {}
        part = self.rows.filter(pl.col(self.series) == name)
        return {
            float(xv): (float(a), float(b))
            for xv, a, b in zip(part[self.x], part[lo], part[hi], strict=True)
            if a is not None and b is not None
        }

    def scope(self) -> str:
        return f" for {self.label}" if self.label else ""


def fmt_value(value: float) -> str:
    """A configured value as written, never in scientific notation: 1024, 0.5, 1000000000."""
    if not math.isfinite(value) or value == int(value):
        return f"{value:.0f}"
    return f"{value:f}".rstrip("0")


def fmt_sig(value: float, digits: int = 3) -> str:
    """``digits`` significant figures with thousands separators, never in scientific notation
    (``f"{v:,.3g}"`` prints 1e+04): 10,000; 351; 0.0279; 10.5."""
    if value == 0 or not math.isfinite(value):
        return f"{value:.0f}"
    decimals = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    text = f"{rounded:,.{max(decimals, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_x(x: str, value: float) -> str:
    return f"QPS {fmt_value(value)}" if x == "qps" else f"input {fmt_value(value)} tokens"


CAPACITY_TITLE = "Capacity at the SLO"
"""The findings section below the Recommendation: its ranking tables, the front page's too."""

OVERLOADED_NOTE = "overloaded: queue growing, latency depends on run length"


def overloaded(summary: pl.DataFrame) -> pl.Series:
    """Per row, whether the point was overloaded (the summary's ``steady`` is False: its queue
    grew, so its latencies depend on how long the run was); all False without the column."""
    if "steady" not in summary.columns:
        return pl.Series("overloaded", [False] * summary.height, dtype=pl.Boolean)
    return (summary["steady"] == False).fill_null(False).alias("overloaded")  # noqa: E712


def fmt_ms(value: float) -> str:
    return f"{value:,.1f} ms"


def overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    """Two 95 % intervals that overlap: the values are the same within noise."""
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def fmt_band(band: tuple[float, float]) -> str:
    return f"[{band[0]:,.1f}, {band[1]:,.1f}]"


def noise_text(a: float, band_a: tuple[float, float], b: float, band_b: tuple[float, float]) -> str:
    """``the same within noise (120.1 ms [118.0, 122.3] vs 121.0 ms [119.2, 122.9])``."""
    return (
        f"the same within noise ({fmt_ms(b)} {fmt_band(band_b)} vs {fmt_ms(a)} {fmt_band(band_a)})"
    )


def fmt_change(new: float, old: float) -> str:
    """``+12.0 ms (+15.0%)``, or ``the same``; the percentage is left out when ``old`` is 0."""
    if same(new, old):
        return "the same"
    text = f"{new - old:+,.1f} ms"
    return f"{text} ({(new - old) / old:+.1%})" if old else text


def groups(summary: pl.DataFrame, x: str) -> list[Group]:
    """Modes are compared within each model; models are compared when the mode is fixed."""
    if summary["mode"].n_unique() > 1:
        models = summary["model"].unique(maintain_order=True).to_list()
        return [
            Group(
                model if len(models) > 1 else None,
                "mode",
                summary.filter(pl.col("model") == model),
                x,
            )
            for model in models
        ]
    return [Group(None, "model", summary, x)]


def ranking(group: Group, metric: Metric, xv: float) -> list[tuple[float, str]]:
    values = ((group.curve(name, metric).get(xv), name) for name in group.names)
    return sorted((v, name) for v, name in values if v is not None)


def label_of(row: dict, series: list[str]) -> str:
    return " / ".join(str(row[c]) for c in series)


def fmt_mib(value: float) -> str:
    return f"{value:,.0f} MiB"
