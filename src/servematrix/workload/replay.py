"""Mooncake trace replay: the trace reader, its window, the prompts and the reuse it allows.

A Mooncake FAST'25 trace (github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``) is one
JSON object per line: ``timestamp`` (ms from the trace start), ``input_length`` and
``output_length`` (tokens) and ``hash_ids``, one per 512-token block of the prompt (the last
block partial); equal ids at the same position mean the same prefix. No text is included, so
the prompts are built here from token ids:

* block ``h`` of every request is the same 512 token ids, drawn from a generator seeded by
  (workload seed, ``h``); a request's last block is the first ``input_length mod 512`` of them
  (all 512 when it divides). Two requests thus agree exactly on the blocks their ids share,
  on every backend, and the same trace file and seed give the same prompts;
* the engine's prefix cache sees the same reuse through `engine_chain`: one cache segment per
  block, keyed by the block's *chain* (its id and every id before it), as vLLM chains the hash
  of a block to the blocks before it.

A window is ``count`` requests from the first at or after ``start_s``. Requests longer than the
input cap are dropped (the next ones are taken, and the drops counted) or truncated to the cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servematrix.common.files import json_object

BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""

OVERFLOWS = ("drop", "truncate")

_BLOCK_STREAM = 3  # the workload's token-id streams 0..2 are the random dataset's


class TraceError(ValueError):
    """A trace that cannot be replayed, naming the file and line or the setting at fault."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace (``hash_ids`` one per 512-token block of the prompt)."""

    timestamp_ms: int
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceWindow:
    """The requests a cell replays, in trace order, after the input cap; how many the cap
    dropped (skipped, the window taking the next ones) or truncated."""

    requests: tuple[TraceRequest, ...]
    dropped: int
    truncated: int


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of a trace file, checked line by line (blank lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TraceError(f"trace file {path}: cannot be read ({error})") from error
    requests = []
    previous = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        request = _parse_line(f"trace file {path} line {number}", line)
        if request.timestamp_ms < previous:
            raise TraceError(
                f"trace file {path} line {number}: timestamp {request.timestamp_ms} is before "
                f"the previous line's {previous} (a trace is in arrival order)"
            )
        previous = request.timestamp_ms
        requests.append(request)
    if not requests:
        raise TraceError(f"trace file {path}: no requests")
    return requests


def _parse_line(where: str, line: str) -> TraceRequest:
    row = json_object(where, line, TraceError)
    fields = ("timestamp", "input_length", "output_length", "hash_ids")
    missing = [key for key in fields if key not in row]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    for key, low in (("timestamp", 0), ("input_length", 1), ("output_length", 1)):
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TraceError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    blocks = -(-row["input_length"] // BLOCK_TOKENS)
    if len(ids) != blocks:
        raise TraceError(
            f"{where}: input_length {row['input_length']} is {blocks} blocks of "
            f"{BLOCK_TOKENS} tokens but hash_ids has {len(ids)}"
        )
    return TraceRequest(row["timestamp"], row["input_length"], row["output_length"], tuple(ids))


def window(
    requests: Sequence[TraceRequest],
    start_s: float,
    count: int,
    max_input_len: int,
    overflow: str = "drop",
    where: str = "trace",
) -> TraceWindow:
    """``count`` requests from the first at or after ``start_s`` that pass the input cap."""
    if overflow not in OVERFLOWS:
        raise TraceError(f"input_overflow must be one of {', '.join(OVERFLOWS)}, got {overflow!r}")
    start_ms = start_s * 1000.0
    chosen: list[TraceRequest] = []
    dropped = truncated = 0
    for request in requests:
        if len(chosen) == count:
            break
        if request.timestamp_ms < start_ms:
            continue
        if request.input_len > max_input_len:
            if overflow == "drop":
                dropped += 1
                continue
            truncated += 1
            blocks = -(-max_input_len // BLOCK_TOKENS)
            request = TraceRequest(
                request.timestamp_ms, max_input_len, request.output_len, request.hash_ids[:blocks]
            )
        chosen.append(request)
    if len(chosen) < count:
        raise TraceError(
            f"{where}: the window from {start_s:g} s has {len(chosen)} requests within the "
            f"input cap of {max_input_len} tokens ({dropped} dropped), fewer than the "
            f"{count} asked for"
        )
    return TraceWindow(tuple(chosen), dropped, truncated)


def native_rate(requests: Sequence[TraceRequest]) -> float:
    """The window's mean arrival rate in requests/s at the trace's own timestamps
    ((n − 1) / span; infinite when every request has the same timestamp)."""
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    return (len(requests) - 1) / span_s if span_s > 0 else float("inf")


def send_times(requests: Sequence[TraceRequest], qps: float) -> list[float]:
    """Send times (s from the first request) at the trace's timestamps, scaled in time so that
    the window's mean rate is ``qps`` (scale = native rate / qps; ``qps`` inf sends all at 0)."""
    first = requests[0].timestamp_ms
    scale = native_rate(requests) / qps
    if scale == 0 or scale != scale:  # qps inf, or an infinite native rate
        return [0.0] * len(requests)
    return [(r.timestamp_ms - first) / 1000.0 * scale for r in requests]


def block_ids(seed: int, hash_id: int, vocab_size: int) -> np.ndarray:
    """The 512 token ids of block ``hash_id`` (uniform in [0, vocab_size))."""
    return np.random.default_rng([seed, _BLOCK_STREAM, hash_id]).integers(
        0, vocab_size, BLOCK_TOKENS
    )


def prompts(requests: Sequence[TraceRequest], seed: int, vocab_size: int) -> list[list[int]]:
    """Each request's prompt token ids: its blocks' ids, the last one cut to the request's
    length (a block shared by many requests is drawn once)."""
    blocks: dict[int, np.ndarray] = {}
    built = []
    for request in requests:
        parts = []
        for h in request.hash_ids:
            if h not in blocks:
                blocks[h] = block_ids(seed, h, vocab_size)
            parts.append(blocks[h])
        built.append(np.concatenate(parts)[: request.input_len].tolist())
    return built


class ChainKeys:
    """Numbers each distinct chain of hash ids (a block with every block before it) once, so
    that equal keys mean equal prefixes up to the block's end, as vLLM's chained block hash."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, int], int] = {}

    def chain(self, hash_ids: Sequence[int]) -> tuple[int, ...]:
        keys = []
        parent = -1
        for h in hash_ids:
            parent = self._keys.setdefault((parent, h), len(self._keys))
            keys.append(parent)
        return tuple(keys)


def engine_chains(requests: Sequence[TraceRequest]) -> list[tuple[int, ...]]:
    """The prefix-cache segment keys of each request (one per 512-token block)."""
    keys = ChainKeys()
    return [keys.chain(request.hash_ids) for request in requests]


@dataclass(frozen=True)
class ReuseBound:
    """The most prefix reuse a trace window allows: an unbounded cache, requests served in
    trace order, hits counted as vLLM counts them (``prefix_cache_hits`` over
    ``prefix_cache_queries``, in tokens): whole ``block_size`` blocks of a prefix some earlier
    request computed, at most the prompt minus its last token (vLLM recomputes that one)."""

    hit_tokens: int
    query_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def reuse_bound(requests: Sequence[TraceRequest], block_size: int = 16) -> ReuseBound:
    """The best hit rate the window's hash ids allow (see `ReuseBound`)."""
    seen: dict[int, int] = {}  # chain key -> most tokens of that block any request had
    keys = ChainKeys()
    hits = queries = 0
    for request in requests:
        chain = keys.chain(request.hash_ids)
        hit = 0
        for index, key in enumerate(chain):
            tokens = min(BLOCK_TOKENS, request.input_len - index * BLOCK_TOKENS)
            earlier = seen.get(key, 0)
            seen[key] = max(earlier, tokens)
            if hit == index * BLOCK_TOKENS:  # every block before this one hit
                hit += min(tokens, earlier) // block_size * block_size
        hits += min(hit, (request.input_len - 1) // block_size * block_size)
        queries += request.input_len
    return ReuseBound(hits, queries)
