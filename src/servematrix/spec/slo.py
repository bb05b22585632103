"""Service-level objectives: the question a study answers ("which configuration carries the most
load at these latency targets?").

An SLO is a list of bounds, each a latency metric, a statistic over the cell's requests and a
limit in ms (``P99 TTFT ≤ 2000 ms``), plus an optional *attainment*: the share of measured
requests that must meet every per-request bound at once, as DistServe defines SLO attainment
(Zhong et al., OSDI 2024, §2). A cell meets the SLO when every statistic is within its bound
and, if given, the attainment is reached. Goodput counts the requests meeting every per-request
bound, as ``vllm bench serve --goodput`` does. ITL is pooled over chunks (vLLM), not a
per-request value, so an ITL bound is checked at its statistic only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")
PER_REQUEST = ("ttft", "tpot", "e2el")
"""The metrics a single request has a value of (``metrics.SLO_KEYS``)."""
STATISTICS = ("mean", "median", "p90", "p95", "p99")
ATTAINMENT = "attainment"
FAILED = "failed requests"


@dataclass(frozen=True)
class Bound:
    metric: str
    statistic: str
    max_ms: float

    @property
    def column(self) -> str:
        """The summary column holding the statistic (``p99_ttft_ms``)."""
        return f"{self.statistic}_{self.metric}_ms"

    @property
    def tolerated_failures(self) -> float:
        """The share of requests that may fail, infinitely slow, with the statistic still
        finite: above its percentile (none for a mean)."""
        if self.statistic == "mean":
            return 0.0
        return 0.5 if self.statistic == "median" else 1 - float(self.statistic[1:]) / 100

    @property
    def label(self) -> str:
        stat = self.statistic.upper() if self.statistic.startswith("p") else self.statistic
        return f"{stat} {self.metric.upper()}"

    def describe(self) -> str:
        return f"{self.label} ≤ {self.max_ms:g} ms"


@dataclass(frozen=True)
class Verdict:
    """Whether one cell meets the SLO; ``broken`` lists the violated bounds, the furthest over
    its limit first (the attainment counts as a bound, by its shortfall)."""

    met: bool
    broken: tuple[str, ...]


@dataclass(frozen=True)
class Slo:
    bounds: tuple[Bound, ...]
    attainment: float | None = None

    @classmethod
    def from_config(cls, data: Mapping[str, Any]) -> Slo:
        bounds = tuple(
            Bound(metric, data[metric]["statistic"], float(data[metric]["max_ms"]))
            for metric in METRICS
            if metric in data
        )
        attainment = data.get(ATTAINMENT)
        return cls(bounds, None if attainment is None else float(attainment))

    @property
    def defined(self) -> bool:
        return bool(self.bounds)

    def per_request_ms(self) -> dict[str, float]:
        """The limits a request is judged by for goodput (``metrics.compute``'s ``slo_ms``)."""
        return {b.metric: b.max_ms for b in self.bounds if b.metric in PER_REQUEST}

    def check(self, row: Mapping[str, Any]) -> Verdict:
        """Judge one summary row (``good_fraction`` is its attainment). A summary's statistics
        cover the successful requests (vLLM's), so failures are added back as infinitely slow:
        a bound breaks when more requests failed than its statistic lets through (any for a
        mean, over 1 % for a P99); and without an attainment any failed request breaks the
        SLO (``FAILED``), as a capacity probe's (``servematrix.results.steady``)."""
        over: list[tuple[float, str]] = []
        failed = row.get("failed") or 0
        failed_share = failed / max(failed + (row.get("completed") or 0), 1)
        for bound in self.bounds:
            value = row.get(bound.column)
            if failed_share > bound.tolerated_failures:
                over.append((math.inf, bound.label))
            elif value is None or not value <= bound.max_ms:  # NaN (no request) breaks it
                ratio = value / bound.max_ms if value is not None and value == value else 1e9
                over.append((ratio, bound.label))
        if self.attainment is None and failed:
            over.append((math.inf, FAILED))
        if self.attainment is not None and row["good_fraction"] < self.attainment:
            shortfall = (1 - row["good_fraction"]) / max(1 - self.attainment, 1e-9)
            over.append((shortfall, ATTAINMENT))
        broken = tuple(label for _, label in sorted(over, key=lambda item: -item[0]))
        return Verdict(not broken, broken)

    def describe(self) -> str:
        parts = [b.describe() for b in self.bounds]
        if self.attainment is not None:
            parts.append(f"{self.attainment:.0%} of requests meeting every per-request bound")
        return ", ".join(parts) if parts else "no SLO"


def replacement_for_slo_ms(slo_ms: Any) -> str:
    """What to write instead of the retired ``slo_ms`` (one line)."""
    limits = slo_ms if isinstance(slo_ms, Mapping) else {}
    bounds = (
        ", ".join(f"{key}: {{statistic: p99, max_ms: {value}}}" for key, value in limits.items())
        or "ttft: {statistic: p99, max_ms: 2000}, tpot: {statistic: p99, max_ms: 100}"
    )
    return (
        "slo_ms is replaced by slo (per metric a statistic and a bound, plus attainment); "
        f"write slo: {{{bounds}, attainment: 0.9}}"
    )
