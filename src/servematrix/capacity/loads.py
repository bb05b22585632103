"""The axis a capacity search raises the load along, one per way a workload offers it.

A capacity is the highest load at which the SLO holds, and the load is what the client
offers, not a number it never sends (issue 40):

- ``rate`` — an open loop (arrivals on a schedule): the request rate, in req/s.
- ``users`` — a closed loop (``max_concurrency``): N users each sending their next request
  as soon as the last one is answered (``qps: inf`` capped at N in flight, as
  ``vllm bench serve --max-concurrency``); the capacity is the most concurrent users.
- ``sessions`` — multi-turn conversations (``sessions``): new sessions arrive on a schedule and
  each runs its turns, so the search raises the session arrival rate; the capacity is the
  concurrent sessions that rate holds in steady state (Little's law: the time average of
  sessions in progress over the steady window, measured from the trace).

Each axis says how a probe at a level is sized (arrivals for at least ``min_duration_s``, and
enough requests for the SLO's percentiles), the physical ceiling in its units, and how the
deployment's name leaves the level out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np
import polars as pl
import pyarrow as pa

from servematrix.backends import backend_of
from servematrix.engine import ceiling
from servematrix.engine.setup import cell_engine_setup, role_engine_setups
from servematrix.results import steady
from servematrix.spec import trace
from servematrix.spec.matrix import Cell, workload_token
from servematrix.spec.slo import Slo
from servematrix.workload import sessions

MIN_PROBE_REQUESTS = 50
MIN_SESSIONS = 20
"""A probe holds at least this many sessions, whatever the rate."""
DRAIN_MARGIN = 1.25
"""Sessions sized for the window's requests, plus this share: the later turns of the sessions
still running at the last arrival are out of the window (`steady.Shape`)."""
REQUESTS_PER_USER = 20
"""A closed-loop probe's first sizing: this many requests per user; a run shorter than the
duration is then lengthened from the rate it achieved (`Axis.resize`)."""


def window_requests(slo: Slo, tail_requests: int) -> int:
    """Requests a run needs for the steady window to hold what the SLO's percentiles need."""
    window = max(
        (
            steady.requests_needed(steady.percentile_of(b.statistic), tail_requests)
            for b in slo.bounds
            if b.statistic != "mean"
        ),
        default=0,
    )
    return math.ceil(window / (1 - steady.RAMP_FRACTION))


@dataclass(frozen=True)
class Axis:
    """An open loop's request rate; the base of the other axes."""

    name: str = "rate"
    unit: str = "req/s"
    level_unit: str = "req/s"
    integer: bool = False

    def template(self, cell: Cell) -> Cell:
        """The deployment's cell without its level and request count (set by each probe)."""
        return replace(cell, workload=replace(cell.workload, qps=1.0, num_prompts=1))

    def token(self, cell: Cell) -> str:
        """The workload's name without its rate, request count and seed."""
        w = cell.workload
        head = f"qps{w.qps:g}_in{w.input_len}_out{w.output_len}_n{w.num_prompts}_s{w.seed}"
        return f"in{w.input_len}_out{w.output_len}" + workload_token(w).removeprefix(head)

    def probe_cell(self, template: Cell, level: float, slo: Slo, duration_s: float, tail: int):
        """The cell a probe at ``level`` runs: ``duration_s`` of arrivals, and at least
        enough requests that the steady window holds what the SLO's percentiles need."""
        requests = max(
            math.ceil(level * duration_s), window_requests(slo, tail), MIN_PROBE_REQUESTS
        )
        return replace(
            template, workload=replace(template.workload, qps=level, num_prompts=requests)
        )

    def resize(self, cell: Cell, table: pa.Table, duration_s: float) -> Cell | None:
        """A longer probe when this one's arrivals spanned less than ``duration_s`` (None: it
        was long enough). An open loop's arrivals are on a schedule, sized right from the start."""
        return None

    def ceiling(self, cell: Cell) -> float | None:
        """The physical ceiling in level units (`servematrix.engine.ceiling`); None on a
        measured backend, whose hardware the simulator's tables need not describe."""
        if backend_of(cell.backend).MEASURED:
            return None
        w = cell.workload
        setups = role_engine_setups(cell, cell_engine_setup(cell))
        return ceiling.ceiling_rps(setups, cell.topology, w.input_len, w.output_len)

    def capacity(self, level: float, trace_path: str) -> float:
        """The capacity in ``unit`` when ``level`` is the highest that met the SLO
        (``trace_path``: the probe at it)."""
        return level


def _send_span_s(table: pa.Table) -> float:
    sent = steady.measured_frame(table)["sent_s"]
    return float(sent.max() - sent.min()) if len(sent) > 1 else 0.0


@dataclass(frozen=True)
class UsersAxis(Axis):
    name: str = "users"
    unit: str = "users"
    level_unit: str = "users"
    integer: bool = True

    def template(self, cell: Cell) -> Cell:
        w = replace(cell.workload, qps=math.inf, max_concurrency=1, num_prompts=1)
        return replace(cell, workload=w)

    def token(self, cell: Cell) -> str:
        return re.sub(r"_c\d+(?=_|$)", "_users", super().token(cell))

    def probe_cell(self, template: Cell, level: float, slo: Slo, duration_s: float, tail: int):
        requests = max(
            REQUESTS_PER_USER * int(level), window_requests(slo, tail), MIN_PROBE_REQUESTS
        )
        w = replace(template.workload, max_concurrency=int(level), num_prompts=requests)
        return replace(template, workload=w)

    def resize(self, cell: Cell, table: pa.Table, duration_s: float) -> Cell | None:
        span_s = _send_span_s(table)
        if span_s >= duration_s:
            return None
        w = cell.workload
        scale = 1.1 * duration_s / span_s if span_s > 0 else 10.0
        return replace(cell, workload=replace(w, num_prompts=math.ceil(w.num_prompts * scale)))

    def ceiling(self, cell: Cell) -> float | None:
        """The most sequences the deployment's decoding instances run at once: users beyond
        it wait in the queue."""
        if backend_of(cell.backend).MEASURED:
            return None
        w = cell.workload
        decoding = cell.topology.roles[-1]  # the aggregated or the decode instances
        setup = role_engine_setups(cell, cell_engine_setup(cell))[-1]
        return float(decoding.count * ceiling.largest_batch(setup, w.input_len, w.output_len))


@dataclass(frozen=True)
class SessionsAxis(Axis):
    name: str = "sessions"
    unit: str = "sessions"
    level_unit: str = "sessions/s"

    def token(self, cell: Cell) -> str:
        return re.sub(r"_sess\d+x", "_sess", super().token(cell))

    def probe_cell(self, template: Cell, level: float, slo: Slo, duration_s: float, tail: int):
        w = template.workload
        low, high = w.sessions.turn_range
        need = DRAIN_MARGIN * window_requests(slo, tail) / ((low + high) / 2)
        users = max(math.ceil(level * duration_s), math.ceil(need), MIN_SESSIONS)
        w = replace(w, qps=level, sessions=replace(w.sessions, users=users))
        turns = sessions.plan(w.sessions, w.input_len, w.output_len, w.range_ratio, w.seed)
        return replace(template, workload=replace(w, num_prompts=len(turns)))

    def ceiling(self, cell: Cell) -> float | None:
        """Sessions per second: the request-rate ceiling at the mean turn's prompt (its
        history and new tokens) over the mean turns of a session."""
        if backend_of(cell.backend).MEASURED:
            return None
        w = cell.workload
        turns = sessions.plan(
            replace(w.sessions, users=MIN_SESSIONS), w.input_len, w.output_len, 0.0, w.seed
        )
        mean_input = round(np.mean([t.input_len for t in turns]))
        setups = role_engine_setups(cell, cell_engine_setup(cell))
        rate = ceiling.ceiling_rps(setups, cell.topology, mean_input, w.output_len)
        return rate * MIN_SESSIONS / len(turns)

    def capacity(self, level: float, trace_path: str) -> float:
        """The time average of sessions in progress over the steady window (Little's law),
        read from the probe's trace (its sessions are the probe cell's, not the template's)."""
        table = trace.read(trace_path)
        cell = Cell.from_dict(trace.metadata_of(table.schema, trace_path)["cell"])
        return concurrent_sessions(table, cell)


def concurrent_sessions(table: pa.Table, cell: Cell) -> float:
    """Mean sessions in progress over a sessions run's steady window: each session lives from
    its first turn's send to its last turn's end."""
    w = cell.workload
    turns = sessions.plan(w.sessions, w.input_len, w.output_len, w.range_ratio, w.seed)
    measured = steady.measured_frame(table)
    first_id = int(measured["request_id"].min())
    users = pl.Series([turns[i - first_id].user for i in measured["request_id"]])
    lives = (
        measured.with_columns(user=users, end_s=pl.col("end_s").fill_null(pl.col("sent_s")))
        .group_by("user")
        .agg(born=pl.col("sent_s").min(), died=pl.col("end_s").max())
    )
    window = steady.steady_window(measured, steady.shape_of(cell.to_dict()["workload"]))
    start, end = float(window["sent_s"].min()), float(window["sent_s"].max())
    if end <= start:
        return 0.0
    overlap = pl.min_horizontal("died", pl.lit(end)) - pl.max_horizontal("born", pl.lit(start))
    return float(lives.select(overlap.clip(lower_bound=0).sum()).item()) / (end - start)


AXES = {axis.name: axis for axis in (Axis(), UsersAxis(), SessionsAxis())}


def axis_of(cell: Cell) -> Axis:
    """The axis of a cell's workload: sessions, a closed loop, or a rate."""
    if cell.workload.sessions is not None:
        return AXES["sessions"]
    if cell.workload.max_concurrency is not None:
        return AXES["users"]
    return AXES["rate"]
