"""How sure: 95 % intervals for a cell's metrics, over repeats or over requests.

With ``repeats: K`` (K seeds per point) a metric's interval is the Student-t interval of its K
per-seed values around their mean. With one seed it is a percentile bootstrap over the cell's
requests (``BOOTSTRAP_RESAMPLES`` resamples, seeded, so a rerun gives the same interval); a
bootstrap sees the noise of which requests were drawn, not of the arrival schedule, so it is
the narrower of the two. Two values whose intervals overlap are "the same within noise".
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl

from servematrix.results import metrics

T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
)  # fmt: skip
"""Student's t 97.5 % quantile for 1..29 degrees of freedom (``repeats`` is at most 30): the
95 % two-sided interval, without a SciPy dependency."""

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
LATENCIES = ("ttft", "tpot", "e2el")
STATISTICS = ("mean", "median", "p99")
BOOTSTRAPPED = tuple(f"{s}_{m}_ms" for m in LATENCIES for s in STATISTICS)
"""Per-request latency statistics: the ones a bootstrap over requests can give."""
REPEATED = (*BOOTSTRAPPED, "mean_itl_ms", "p99_itl_ms", "output_throughput", "request_goodput")
"""Every column that gets an interval over repeats."""


@dataclass(frozen=True)
class Interval:
    """A value and its 95 % interval."""

    value: float
    lo: float
    hi: float

    def overlaps(self, other: Interval) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi


def t_interval(values: Iterable[float]) -> Interval:
    """Mean and 95 % Student-t interval of repeated measurements (one value: no width)."""
    data = np.asarray(list(values), dtype=float)
    mean = float(data.mean())
    if len(data) < 2:
        return Interval(mean, mean, mean)
    half = T_975[len(data) - 2] * float(data.std(ddof=1)) / math.sqrt(len(data))
    return Interval(mean, mean - half, mean + half)


def _statistic(resamples: np.ndarray, ordered: np.ndarray, name: str) -> np.ndarray:
    """The statistic of each resample (a row of ``resamples``; ``ordered`` the same rows
    sorted), as NumPy's ``mean``, ``median`` and linear ``percentile`` give it to the last bit,
    the quantiles read from the sorted rows: one sort per metric instead of a partition per
    statistic (a summary job's main cost)."""
    n = ordered.shape[1]
    if name == "mean":
        return resamples.mean(axis=1)
    if name == "median":
        middle = ordered[:, n // 2]
        return middle if n % 2 else (ordered[:, n // 2 - 1] + middle) / 2
    position = 0.99 * (n - 1)
    below = math.floor(position)
    fraction = position - below
    lo, hi = ordered[:, below], ordered[:, min(below + 1, n - 1)]
    with np.errstate(invalid="ignore"):
        step = hi - lo
        return hi - step * (1 - fraction) if fraction >= 0.5 else lo + step * fraction


def bootstrap_columns(latencies: metrics.Latencies) -> dict[str, float | None]:
    """``{column}_lo`` / ``{column}_hi`` of every `BOOTSTRAPPED` column, in ms."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    values = {"ttft": latencies.ttft_s, "tpot": latencies.tpot_s, "e2el": latencies.e2el_s}
    out: dict[str, float | None] = {}
    for metric, data in values.items():
        columns = [f"{stat}_{metric}_ms" for stat in STATISTICS]
        if not len(data):
            out.update({f"{column}_{end}": None for column in columns for end in ("lo", "hi")})
            continue
        resamples = data[rng.integers(0, len(data), (BOOTSTRAP_RESAMPLES, len(data)))]
        ordered = np.sort(resamples, axis=1)
        for stat, column in zip(STATISTICS, columns, strict=True):
            spread = _statistic(resamples, ordered, stat) * 1000
            out[f"{column}_lo"] = float(np.percentile(spread, 2.5))
            out[f"{column}_hi"] = float(np.percentile(spread, 97.5))
    return out


INTERVAL_COLUMNS = {f"{column}_{end}": pl.Float64() for column in REPEATED for end in ("lo", "hi")}


def merge_repeats(summary: pl.DataFrame) -> pl.DataFrame:
    """One row per point (the identity columns but the seed): numbers averaged over the
    seeds, `REPEATED` columns with their t interval; ``repeats`` counts the seeds. A point
    measured once keeps its row (and its bootstrap interval)."""
    point = [c for c in ("backend", "recipe", "model", "mode", "dataset", "qps", "input_len",
                         "output_len", "num_prompts") if c in summary.columns]  # fmt: skip
    counted = summary.with_columns(pl.len().over(point).cast(pl.Int64).alias("repeats"))
    single = counted.filter(pl.col("repeats") == 1)
    many = counted.filter(pl.col("repeats") > 1)
    if many.is_empty():
        return counted
    skip = {*point, *INTERVAL_COLUMNS, "seed", "repeats"}
    numeric = [c for c, t in summary.schema.items() if t.is_numeric() and c not in skip]
    means = [pl.col(c).mean().cast(summary.schema[c]) for c in numeric]
    rows = []
    for _, part in many.group_by(point, maintain_order=True):
        row = part.row(0, named=True)
        for column in REPEATED:
            values = [v for v in part[column].to_list() if v is not None and math.isfinite(v)]
            interval = t_interval(values) if values else None
            row[f"{column}_lo"] = interval.lo if interval else None
            row[f"{column}_hi"] = interval.hi if interval else None
        row.update(part.select(means).row(0, named=True))
        if "steady" in part.columns:  # steady only if every seed's run was
            row["steady"] = bool(part["steady"].all())
            row["steady_reason"] = next((r for r in part["steady_reason"] if r), None)
        row["seed"], row["repeats"] = int(part["seed"].min()), part.height
        rows.append(row)
    merged = pl.DataFrame(rows, schema=counted.schema)
    return pl.concat([single, merged])
