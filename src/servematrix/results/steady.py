"""Steady state: whether a run measured a rate the server sustains, and its SLO over that part.

A burst of requests can finish before a queue builds, so a run's latencies say nothing about
a rate unless the run reached steady state (issue 40). Over the *steady window* — the
requests sent after the first ``RAMP_FRACTION`` of them (the ramp-up from an empty server),
up to the last send (the drain after it is left out) — a run is steady when:

- **the server keeps up**: the requests it finished in the window, shifted by the typical
  latency, are within ``THROUGHPUT_TOLERANCE`` of the requests the schedule offered (departures
  in [start + D, end] against arrivals in [start, end − D], D the median E2E latency of the
  window's first quarter: in steady state both count the same requests' flow);
- **the queue is not growing**: the median E2E latency of the window's last quarter is not
  above its first quarter's by more than ``QUEUE_TOLERANCE`` of it and the noise of the two
  medians (three standard errors).

How the load was offered changes two of these (`Shape`, from the workload): a closed loop
(``max_concurrency``: the client sends a request only when a slot frees) offers what the server
serves by construction, so the throughput check does not apply; a sessions workload's window
ends at the last session's first turn, since the later turns of the sessions begun before it
follow with nothing new arriving: a load that only decays, the sessions' drain.

Its SLO is judged over the same window (`judge`): failed requests count as infinitely slow in
every statistic, the attainment counts them as missing every bound, and without an
attainment a single failed request breaks the SLO (``FAILED``): a server that drops requests
at a rate does not sustain it, whatever its percentiles. A percentile is
vLLM's (NumPy's linear interpolation) and is only claimed from enough requests to hold a
``tail_requests`` of them beyond it (`requests_needed`; a P99 from 80 requests is its second
largest value, not a P99). Fewer breaks the bound, naming the count it needs. Why a tail count
and not a confidence bound: the P99 of a short output is often set by rare events (a request
decoding across two or three prefills), so it moves in steps with the rate; a confidence
bound then shifts the capacity with the run's length, and it takes tens of requests beyond
the percentile before doubling the run moves the capacity by less than the search's
tolerance (``benchmarks/capacity_search.py`` shows it per deployment).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from servematrix.results.metrics import REQUIRED_COLUMNS
from servematrix.spec.slo import ATTAINMENT, FAILED, PER_REQUEST, Bound, Slo

RAMP_FRACTION = 0.2
THROUGHPUT_TOLERANCE = 0.05
QUEUE_TOLERANCE = 0.25
TAIL_REQUESTS = 100
"""``capacity.tail_requests`` when the config leaves it out (see `requests_needed`)."""
BATCHES = 8
"""The steady window is cut into this many consecutive batches to estimate how noisy the
binding check is (`Judgement.edge_se`): batch means, since neighbouring requests share a queue
and are not independent samples, while batches far longer than a request's life nearly are."""
QUEUE_GROWING = "queue growing"
BELOW_OFFERED = "throughput below offered"
TOO_SHORT = "run too short"


@dataclass(frozen=True)
class Shape:
    """How a run offered its load: ``closed_loop`` when the client holds requests back;
    ``scheduled_requests`` the measured requests on the arrival schedule, the rest following
    them (a sessions workload's first turns, which come first; None: every request)."""

    closed_loop: bool = False
    scheduled_requests: int | None = None


def shape_of(workload: Mapping[str, Any]) -> Shape:
    """The `Shape` of a workload as a cell's JSON holds it (``Cell.to_dict()["workload"]``)."""
    sessions = workload.get("sessions")
    return Shape(
        closed_loop=workload.get("max_concurrency") is not None,
        scheduled_requests=sessions["users"] if sessions else None,
    )


@dataclass(frozen=True)
class Steadiness:
    """One run's steady-state verdict; ``reason`` is empty when steady. Rates are per second
    over the window (``completed_rps`` the shifted departures, see the module)."""

    steady: bool
    reason: str
    window_requests: int
    window_s: float
    offered_rps: float
    completed_rps: float
    e2el_rise_ms: float


@dataclass(frozen=True)
class Judgement:
    """A probe's verdict: ``broken`` names every failed check, the worst first (a bound by its
    label, or a steady-state reason). ``output_tokens_per_s`` and ``requests_per_s`` are the
    rates achieved in the window: what the requests that finished in it produced, over its
    length."""

    met: bool
    broken: tuple[str, ...]
    steadiness: Steadiness
    output_tokens_per_s: float
    requests_per_s: float
    edge_ratio: float = math.inf
    edge_se: float | None = None
    """The binding check (the check furthest towards its limit) as its `Check.edge` (> 1:
    broken; for a percentile bound the share of requests over the limit over the share
    allowed; infinite when a request failed without an attainment or the run was not
    steady), and its standard error over `BATCHES` batches of the window (None when a batch
    is too small for the statistic): how sharply the probe says where the SLO's edge is
    (`servematrix.capacity.edge_resolution`, `servematrix.capacity.run.near_flip`)."""


def measured_frame(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    """The measured (non-warm-up) requests in send order."""
    frame = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    frame = frame.select(REQUIRED_COLUMNS).filter(~pl.col("warmup"))
    return frame.sort("sent_s")


def steady_window(measured: pl.DataFrame, shape: Shape = Shape()) -> pl.DataFrame:
    """The requests sent after the ramp: all but the first ``RAMP_FRACTION`` of them (by
    count, so a probe sized for a window gets it exactly; at a held rate, the same share of
    the send span), up to the last one on the arrival schedule."""
    window = measured.slice(math.floor(RAMP_FRACTION * measured.height))
    if shape.scheduled_requests is None:
        return window
    first_id = int(measured["request_id"].min())
    scheduled = measured.filter(pl.col("request_id") < first_id + shape.scheduled_requests)
    return window.filter(pl.col("sent_s") <= scheduled["sent_s"].max())


def requests_needed(percentile: float, tail_requests: int = TAIL_REQUESTS) -> int:
    """The fewest requests a percentile is judged from: ``tail_requests`` beyond it (P99 with
    the default 100: 10,000; P90: 1,000; the median: 200)."""
    return math.ceil(tail_requests / (1 - percentile / 100) - 1e-9)


def steadiness(measured: pl.DataFrame, shape: Shape = Shape()) -> Steadiness:
    """Whether the run (its measured requests, `measured_frame`) reached steady state."""
    window = steady_window(measured, shape)
    start, end = float(window["sent_s"].min()), float(window["sent_s"].max())
    span = end - start
    served = window.filter(pl.col("success"))
    e2el = (served["end_s"] - served["sent_s"]).to_numpy()
    quarter = max(len(e2el) // 4, 1)
    head, tail = e2el[:quarter], e2el[-quarter:]
    lag_s = float(np.median(head)) if len(head) else math.inf
    rise_s = float(np.median(tail) - lag_s) if len(tail) else 0.0
    base = dict(window_requests=window.height, window_s=span, e2el_rise_ms=rise_s * 1000)
    if len(tail) and rise_s > max(QUEUE_TOLERANCE * lag_s, 3 * _median_noise_s(head, tail)):
        return Steadiness(False, QUEUE_GROWING, offered_rps=0.0, completed_rps=0.0, **base)
    if served.height < 8 or not span > 2 * lag_s:
        return Steadiness(False, TOO_SHORT, offered_rps=0.0, completed_rps=0.0, **base)
    shifted = span - lag_s
    offered = window.filter(pl.col("scheduled_s") <= end - lag_s).height / shifted
    done = (
        measured.filter(pl.col("success") & pl.col("end_s").is_between(start + lag_s, end)).height
        / shifted
    )
    below = done < (1 - THROUGHPUT_TOLERANCE) * offered and not shape.closed_loop
    reason = BELOW_OFFERED if below else ""
    return Steadiness(not reason, reason, offered_rps=offered, completed_rps=done, **base)


def _median_noise_s(head: np.ndarray, tail: np.ndarray) -> float:
    """The standard error of the difference of two medians (robust spread: IQR / 1.349)."""
    if min(len(head), len(tail)) < 2:
        return 0.0
    errors = [1.2533 * np.subtract(*np.percentile(x, [75, 25])) / 1.349 / math.sqrt(len(x))
              for x in (head, tail)]  # fmt: skip
    return float(math.hypot(*errors))


def judge(
    table: pa.Table | pl.DataFrame,
    slo: Slo,
    tail_requests: int = TAIL_REQUESTS,
    shape: Shape = Shape(),
) -> Judgement:
    """A capacity probe's verdict: steady, and every SLO check met over the steady window."""
    return judge_runs([table], slo, tail_requests, shape)


def judge_runs(
    tables: Sequence[pa.Table | pl.DataFrame],
    slo: Slo,
    tail_requests: int = TAIL_REQUESTS,
    shape: Shape = Shape(),
) -> Judgement:
    """The verdict of independent runs at one level (other seeds): each must be steady (the
    first reason found is reported), and the SLO is judged over their steady windows pooled,
    so two runs hold the requests, and pin a percentile, as one run twice as long would."""
    measured = [measured_frame(table) for table in tables]
    states = [steadiness(frame, shape) for frame in measured]
    windows = [steady_window(frame, shape) for frame in measured]
    window = pl.concat(windows)
    state = next((s for s in states if not s.steady), None) or _pooled(states)
    over = _checks(window, slo, tail_requests)
    if not state.steady:
        over.append(Check(math.inf, state.reason, math.inf))
    ranked = sorted(over, key=lambda c: -c.ratio)
    broken = tuple(c.label for c in ranked if not c.ratio <= 1)
    done = [
        frame.filter(
            pl.col("success") & pl.col("end_s").is_between(w["sent_s"].min(), w["sent_s"].max())
        )
        for frame, w in zip(measured, windows, strict=True)
    ]
    span_s = sum(s.window_s for s in states) if all(s.window_s > 0 for s in states) else math.inf
    tokens_per_s = sum(d["completion_tokens"].sum() for d in done) / span_s
    binding = max(over, key=lambda c: c.edge, default=Check(0.0, "", 0.0))
    return Judgement(
        not broken,
        broken,
        state,
        float(tokens_per_s),
        sum(d.height for d in done) / span_s,
        float(binding.edge),
        _batch_se(window, slo, binding.label) if math.isfinite(binding.edge) and over else None,
    )


def _pooled(states: Sequence[Steadiness]) -> Steadiness:
    """Steady runs as one: their windows' requests and lengths summed, rates weighted by
    length, the largest latency rise."""
    if len(states) == 1:
        return states[0]
    span_s = sum(s.window_s for s in states)
    return Steadiness(
        True,
        "",
        window_requests=sum(s.window_requests for s in states),
        window_s=span_s,
        offered_rps=sum(s.offered_rps * s.window_s for s in states) / span_s,
        completed_rps=sum(s.completed_rps * s.window_s for s in states) / span_s,
        e2el_rise_ms=max(s.e2el_rise_ms for s in states),
    )


@dataclass(frozen=True)
class Check:
    """One SLO check over a window: ``ratio`` its statistic over its limit (> 1: broken),
    ``label`` what to report, and ``edge`` how far it is towards its limit on a scale that
    moves smoothly with the load (> 1: broken). For a percentile bound that is the share of
    values over the limit, over the share the percentile allows (a P99 of TPOT ≤ 50 ms is
    at most 1 % of TPOTs over 50 ms): the percentile itself can jump with the rate, when the
    values beyond it are the few requests that met a rare event (a request decoding across a
    prefill), while the share that met it grows with the rate. Otherwise ``edge`` is
    ``ratio``."""

    ratio: float
    label: str
    edge: float


def _checks(window: pl.DataFrame, slo: Slo, tail_requests: int) -> list[Check]:
    """Every SLO check over the window: the bounds, the attainment, and without an
    attainment whether any request failed."""
    values = _per_request_s(window)
    over = [_bound_check(bound, values, window, tail_requests) for bound in slo.bounds]
    if slo.attainment is not None:
        shortfall = _attainment_shortfall(slo, values, slo.attainment)
        over.append(Check(shortfall, ATTAINMENT, shortfall))
    failed = window.height - int(window["success"].sum())
    if slo.attainment is None and failed:  # no share may fail: a failure meets no SLO
        over.append(Check(math.inf, FAILED, math.inf))
    return over


def _batch_se(window: pl.DataFrame, slo: Slo, label: str) -> float | None:
    """The standard error of the check ``label``'s edge, from its spread over `BATCHES`
    consecutive batches of the window (each judged with one request beyond a percentile)."""
    size = window.height // BATCHES
    ratios = []
    for i in range(BATCHES):
        batch = {c.label: c.edge for c in _checks(window.slice(i * size, size), slo, 1)}
        ratio = batch.get(label, math.inf)
        if not math.isfinite(ratio):
            return None
        ratios.append(ratio)
    return float(np.std(ratios, ddof=1) / math.sqrt(BATCHES))


def _attainment_shortfall(slo: Slo, values: Mapping[str, np.ndarray], target: float) -> float:
    """The share of requests missing a bound over the share allowed to (> 1: broken)."""
    good = np.ones(len(values["ttft"]), dtype=bool)
    for metric, limit_ms in slo.per_request_ms().items():
        good &= values[metric] <= limit_ms / 1000
    share = float(good.mean()) if len(good) else 0.0
    return (1 - share) / max(1 - target, 1e-9)


def _per_request_s(window: pl.DataFrame) -> dict[str, np.ndarray]:
    """TTFT, TPOT, E2EL per request in s; a failed request is infinitely slow in each."""
    ok = window["success"].to_numpy()
    sent = window["sent_s"].to_numpy()
    ttft = np.where(ok, window["first_token_s"].fill_null(math.inf).to_numpy() - sent, math.inf)
    e2el = np.where(ok, window["end_s"].fill_null(math.inf).to_numpy() - sent, math.inf)
    tokens = window["completion_tokens"].fill_null(0).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(tokens > 1, (e2el - ttft) / np.maximum(tokens - 1, 1), 0.0)
    tpot = np.where(ok, tpot, math.inf)
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el}


def _bound_check(
    bound: Bound, values: Mapping[str, np.ndarray], window: pl.DataFrame, tail_requests: int
) -> Check:
    """The bound's `Check`."""
    if bound.metric in PER_REQUEST:
        sample = values[bound.metric]
        if bound.metric == "tpot":  # vLLM's TPOT list holds the multi-token requests only
            multi = window["completion_tokens"].fill_null(0).to_numpy() > 1
            sample = sample[multi | ~window["success"].to_numpy()]
    else:  # ITL: every gap of every served request, pooled; a failure is one infinite gap
        served = window.filter(pl.col("success"))
        gaps = served.select(pl.col("chunk_s").list.diff(null_behavior="ignore").list.slice(1))
        pooled = gaps.explode("chunk_s")["chunk_s"].drop_nulls().to_numpy()
        failures = np.full(window.height - served.height, math.inf)
        sample = np.concatenate([pooled, failures])
    value_s = statistic_s(sample, bound.statistic, tail_requests)
    if value_s is None:
        needed = requests_needed(percentile_of(bound.statistic), tail_requests)
        return Check(math.inf, f"{bound.label} needs {needed} requests", math.inf)
    ratio = value_s * 1000 / bound.max_ms
    if bound.statistic == "mean":
        return Check(ratio, bound.label, ratio)
    allowed = 1 - percentile_of(bound.statistic) / 100
    over = float(np.mean(sample > bound.max_ms / 1000))
    return Check(ratio, bound.label, over / allowed)


def percentile_of(statistic: str) -> float:
    return 50.0 if statistic == "median" else float(statistic.removeprefix("p"))


def statistic_s(
    sample: np.ndarray, statistic: str, tail_requests: int = TAIL_REQUESTS
) -> float | None:
    """The statistic the SLO is judged by (None: too few values for the percentile)."""
    if statistic == "mean":
        return float(np.mean(sample)) if len(sample) else None
    percentile = percentile_of(statistic)
    if len(sample) < requests_needed(percentile, tail_requests):
        return None
    with np.errstate(invalid="ignore"):  # between two failures (inf - inf): a failure
        value = float(np.percentile(sample, percentile))
    return math.inf if math.isnan(value) else value
