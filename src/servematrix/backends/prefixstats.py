"""Prefix reuse of a cell: the prefix-cache hits its servers report, and the most its workload
allows (a Mooncake trace's hash ids, `replay.reuse_bound`).

Both are in tokens, as vLLM counts them: ``vllm:prefix_cache_queries_total`` (prompt tokens
looked up) and ``vllm:prefix_cache_hits_total`` (of them, found cached), summed over the
instances that compute prompts (not a disaggregated decode instance) and taken as the change
over the cell. The simulator's engine counts the same way (`engine.scheduler.Scheduler`).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from servematrix.deploy.layout import decoding_instances
from servematrix.spec.matrix import Cell, Workload

QUERIES_METRIC = "vllm:prefix_cache_queries_total"
HITS_METRIC = "vllm:prefix_cache_hits_total"


def parse_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) of one /metrics text, summed over its label sets; None without them."""
    totals = {QUERIES_METRIC: 0.0, HITS_METRIC: 0.0}
    seen = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            seen.add(name)
    if len(seen) < 2:
        return None
    return totals[QUERIES_METRIC], totals[HITS_METRIC]


def computing_instances(cell: Cell, instances: Mapping[str, str]) -> list[str]:
    """The base URLs of the instances that compute prompts: all of an aggregated deployment's,
    a disaggregated one's prefill instances (its decode instances receive the prompts' KV)."""
    decoding = decoding_instances(cell)
    return [base for name, base in instances.items() if name not in decoding]


def scrape(bases: Iterable[str]) -> tuple[float, float] | None:
    """(queries, hits) summed over the servers at ``bases``; None when one has no counters
    (vLLM 0.6 exports only a hit-rate gauge) or does not answer."""
    queries = hits = 0.0
    for base in bases:
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
                counters = parse_counters(response.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError, ValueError):
            return None
        if counters is None:
            return None
        queries, hits = queries + counters[0], hits + counters[1]
    return queries, hits


def served(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict:
    """The cell's ``queries_tokens`` and ``hits_tokens`` (empty when either scrape failed)."""
    if before is None or after is None:
        return {}
    return {
        "queries_tokens": int(after[0] - before[0]),
        "hits_tokens": int(after[1] - before[1]),
    }


def best(workload: Workload) -> dict[str, int]:
    """The most reuse the workload allows, where it is known (a Mooncake trace): the hit and
    query tokens of an unbounded cache serving the window in order."""
    from servematrix.workload import replay
    from servematrix.workload.datasets import dataset_of
    from servematrix.workload.datasets.mooncake import trace_window

    if not dataset_of(workload.dataset).REPLAYS_TRACE:
        return {}

    window = trace_window(workload)
    bound = replay.reuse_bound(window.requests)
    return {
        "best_hits_tokens": bound.hit_tokens,
        "best_queries_tokens": bound.query_tokens,
        "trace_dropped_requests": window.dropped,
        "trace_truncated_requests": window.truncated,
    }


def summary_columns(prefix_cache: Mapping[str, Any]) -> dict[str, Any]:
    """A trace's `PREFIX_COLUMNS` from its metadata's ``prefix_cache`` (null where unknown)."""

    def rate(hits: str, queries: str) -> float | None:
        if prefix_cache.get(queries):
            return prefix_cache.get(hits, 0) / prefix_cache[queries]
        return None

    return {
        "prefix_hit_rate": rate("hits_tokens", "queries_tokens"),
        "prefix_best_hit_rate": rate("best_hits_tokens", "best_queries_tokens"),
        "trace_dropped_requests": prefix_cache.get("trace_dropped_requests"),
    }
