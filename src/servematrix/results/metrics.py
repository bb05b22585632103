"""Per-cell metrics from a trace, with the semantics of vLLM's benchmark client.

`compute` follows ``calculate_metrics`` of vLLM's ``benchmark_serving.py`` / ``vllm bench serve``
(reference/vllm-mooncake-spec.md §3.2) over the successful, non-warm-up requests of one cell:

- TTFT = ``first_token_s - sent_s``; E2EL = ``end_s - sent_s``.
- TPOT = ``(E2EL - TTFT) / (completion_tokens - 1)``, only for requests with more than one output
  token; a one-token request still counts in TTFT, E2EL and throughput.
- ITL = every gap between consecutive ``chunk_s`` of every request, pooled into one flat list
  (long requests weigh more). A chunk carrying several tokens is one gap, as in vLLM, which
  timestamps streamed chunks, not tokens; TPOT divides by ``completion_tokens`` and so does see
  every token. ``chunk_s`` holds every chunk that has ``choices``, empty text included, as
  vLLM 0.33's client counts them. **This differs from vLLM 0.6's client**, which skipped a chunk
  whose text is empty: real vLLM streams ``"text": ""`` for special tokens and partial UTF-8
  characters, and under the 0.6 rule such a token's time was merged into the next chunk's
  (one ITL gap fewer, a later TTFT when it was the first) and a request whose chunks were all
  empty became a failure although the server counted every token. On the emulator and the
  simulator nothing changes: the simulator writes one chunk per token event, and the
  emulator's empty-text chunks carry their usage like any other (``servematrix.client.sse``).
- Output tokens are the server's ``completion_tokens``, as ``vllm bench serve`` uses when usage is
  present (older clients re-tokenized the text).
- Statistics are NumPy's mean, median, population std and default (linear) percentiles, computed
  in seconds and reported in ms; an empty list gives 0, as vLLM's ``np.mean(x or 0)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from servematrix.spec.trace import REQUEST_COLUMNS

SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (90, 95, 99)
REQUIRED_COLUMNS = tuple(REQUEST_COLUMNS)


class MetricsError(ValueError):
    """A trace from which no meaningful metrics can be computed (e.g. every request failed)."""


@dataclass(frozen=True)
class CellMetrics:
    """One cell's summary; latencies in ms, durations in s, throughputs per second."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float
    good_fraction: float
    scheduled_qps: float
    achieved_qps: float
    send_lag_p50_ms: float
    send_lag_p99_ms: float
    send_lag_max_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p90_ttft_ms: float
    p95_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p90_tpot_ms: float
    p95_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p90_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    std_e2el_ms: float
    p90_e2el_ms: float
    p95_e2el_ms: float
    p99_e2el_ms: float


@dataclass(frozen=True)
class Latencies:
    """Per-request latencies of the successful requests, in seconds, in request order.

    ``all_tpot_s`` has one entry per request (0 for a one-token request, as vLLM's ``all_tpots``
    used for goodput); ``tpot_s`` only the requests with more than one output token.
    """

    ttft_s: np.ndarray
    e2el_s: np.ndarray
    tpot_s: np.ndarray
    all_tpot_s: np.ndarray
    itl_s: np.ndarray


def compute(
    trace: pa.Table | pl.DataFrame,
    slo_ms: Mapping[str, float] | None = None,
    source: str | os.PathLike[str] | None = None,
) -> CellMetrics:
    """Metrics of one cell's trace (as returned by `servematrix.spec.trace.read`).

    ``slo_ms`` maps any of ``ttft``, ``tpot``, ``e2el`` to a limit in ms; a request is good when
    it meets every given limit (no limits: every successful request is good). ``good_fraction``
    is good requests over all measured requests, so failures count against it. Duration, send
    lag and achieved QPS cover every measured request, failed ones included. ``source`` (the
    trace's path) only makes error messages name the file.
    """
    slos = _check_slos(slo_ms or {}, source)
    frame = _frame(trace, source)
    measured = frame.filter(~pl.col("warmup"))
    ok = measured.filter(pl.col("success"))
    _check_usable(measured, ok, source)
    latencies = latencies_of(ok)
    duration_s = _duration_s(measured)
    _check_positive(duration_s, source)
    completed = ok.height
    input_tokens = int(ok["prompt_tokens"].sum())
    output_tokens = int(ok["completion_tokens"].sum())
    good = _good_count(latencies, slos)
    return CellMetrics(
        completed=completed,
        failed=measured.height - completed,
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=completed / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        request_goodput=good / duration_s,
        good_fraction=good / measured.height,
        scheduled_qps=achieved_qps(measured["scheduled_s"].to_numpy()),
        achieved_qps=achieved_qps(measured["sent_s"].to_numpy()),
        **_send_lag_ms(measured),
        **_stats_ms("ttft", latencies.ttft_s),
        **_stats_ms("tpot", latencies.tpot_s),
        **_stats_ms("itl", latencies.itl_s),
        **_stats_ms("e2el", latencies.e2el_s),
    )


def latencies_of(ok: pl.DataFrame) -> Latencies:
    """Per-request latencies of successful rows (which must have first_token_s and end_s)."""
    ttft = (ok["first_token_s"] - ok["sent_s"]).to_numpy()
    e2el = (ok["end_s"] - ok["sent_s"]).to_numpy()
    tokens = ok["completion_tokens"].to_numpy()
    multi = tokens > 1
    tpot = (e2el[multi] - ttft[multi]) / (tokens[multi] - 1)
    all_tpot = np.zeros(len(tokens))
    all_tpot[multi] = tpot
    gaps = ok.select(pl.col("chunk_s").list.diff(null_behavior="ignore").list.slice(1))
    itl = gaps.explode("chunk_s")["chunk_s"].drop_nulls().to_numpy()
    return Latencies(ttft_s=ttft, e2el_s=e2el, tpot_s=tpot, all_tpot_s=all_tpot, itl_s=itl)


def achieved_qps(sent_s: np.ndarray) -> float:
    """Request rate of a list of send times: (n - 1) gaps over their span.

    Applied to ``sent_s`` it is the rate the client delivered; applied to ``scheduled_s`` the
    rate the seeded schedule offered (a sample, so not exactly the cell's QPS).

    0 for a single request (no gap to measure); infinite if several went out at one instant.
    """
    if len(sent_s) < 2:
        return 0.0
    span = float(sent_s.max() - sent_s.min())
    return (len(sent_s) - 1) / span if span > 0 else math.inf


def _frame(trace: pa.Table | pl.DataFrame, source: str | os.PathLike[str] | None) -> pl.DataFrame:
    frame = trace if isinstance(trace, pl.DataFrame) else pl.from_arrow(trace)
    missing = [name for name in REQUIRED_COLUMNS if name not in frame.columns]
    if missing:
        raise MetricsError(f"{_where(source)}trace lacks column(s) {', '.join(missing)}")
    return frame.select(REQUIRED_COLUMNS).sort("request_id")


def _check_slos(
    slo_ms: Mapping[str, float], source: str | os.PathLike[str] | None
) -> dict[str, float]:
    unknown = sorted(set(slo_ms) - set(SLO_KEYS))
    if unknown:
        raise MetricsError(
            f"{_where(source)}unknown SLO key(s) {', '.join(unknown)} "
            f"(known: {', '.join(SLO_KEYS)})"
        )
    return {key: float(value) for key, value in slo_ms.items()}


def _check_usable(
    measured: pl.DataFrame, ok: pl.DataFrame, source: str | os.PathLike[str] | None
) -> None:
    if measured.is_empty():
        raise MetricsError(f"{_where(source)}no measured (non-warm-up) requests in the trace")
    if ok.is_empty():
        errors = measured["error"].drop_nulls()
        first = errors[0] if len(errors) else "(no error text recorded)"
        raise MetricsError(
            f"{_where(source)}all {measured.height} measured requests failed; first error: {first}"
        )
    untimed = ok.filter(pl.col("first_token_s").is_null() | pl.col("end_s").is_null())
    if not untimed.is_empty():
        raise MetricsError(
            f"{_where(source)}request {untimed['request_id'][0]} succeeded "
            "but has no first_token_s or end_s"
        )


def _check_positive(duration_s: float, source: str | os.PathLike[str] | None) -> None:
    if not duration_s > 0:
        raise MetricsError(
            f"{_where(source)}benchmark duration is {duration_s} s; "
            "the last completion must come after the first send"
        )


def _duration_s(measured: pl.DataFrame) -> float:
    """First measured send to the last measured event.

    The last event is the latest ``end_s``, or a later ``sent_s`` of a failed request that has
    no end time: the benchmark lasted at least until every request was sent.
    """
    first_send = measured["sent_s"].min()
    last_end = measured["end_s"].max()
    last_send = measured["sent_s"].max()
    last = last_send if last_end is None else max(last_end, last_send)
    return float(last - first_send)


def _good_count(latencies: Latencies, slos: Mapping[str, float]) -> int:
    """Requests meeting every SLO, compared in seconds as vLLM does (``slo / 1000 >= value``)."""
    values = {"ttft": latencies.ttft_s, "tpot": latencies.all_tpot_s, "e2el": latencies.e2el_s}
    good = np.ones(len(latencies.ttft_s), dtype=bool)
    for key, limit_ms in slos.items():
        good &= limit_ms / 1000 >= values[key]
    return int(good.sum())


def _send_lag_ms(measured: pl.DataFrame) -> dict[str, float]:
    lag_s = (measured["sent_s"] - measured["scheduled_s"]).to_numpy()
    return {
        "send_lag_p50_ms": float(np.percentile(lag_s, 50)) * 1000,
        "send_lag_p99_ms": float(np.percentile(lag_s, 99)) * 1000,
        "send_lag_max_ms": float(lag_s.max()) * 1000,
    }


def _stats_ms(name: str, values_s: np.ndarray) -> dict[str, float]:
    """vLLM's statistics of one latency list, in ms; an empty list is treated as [0]."""
    values = values_s if len(values_s) else np.zeros(1)
    stats = {
        f"mean_{name}_ms": np.mean(values),
        f"median_{name}_ms": np.median(values),
        f"std_{name}_ms": np.std(values),
    }
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = np.percentile(values, p)
    return {key: float(value) * 1000 for key, value in stats.items()}


def _where(source: str | os.PathLike[str] | None) -> str:
    return f"{os.fspath(source)}: " if source is not None else ""
