"""Prefill → decode KV transfer and the proxy hop, clock-agnostic like the engine.

Two generations move KV differently (docs/engine-model.md, "KV transfer"):

* ``v0`` (vLLM ≤ 0.8 ``SimpleConnector`` + ``MooncakePipe``): the producer clones each
  request's KV and hidden states into a GPU lookup buffer (``kv_buffer_size`` bytes per rank; an
  insert into a full buffer spins in 1 ms sleeps, stalling the prefill instance). The consumer,
  inside the forward pass of the step that "prefills" the request, ``drop_select``s it: the
  producer's handler thread pickles the tensors (device → host copy + serialisation) into a
  managed CPU buffer, the consumer reads them with ``transfer_sync_read``, unpickles and copies
  them to the GPU. Every TP rank moves its own shard in parallel over the node's NICs. The whole
  chain runs synchronously inside the consumer's step, so it is request latency and a stall of
  every decode on that instance at once: :meth:`KvLink.v0_receive_s`. The producer's share of
  it (:meth:`KvLink.v0_producer_s`) advances only while the producer's engine is between steps.
* ``v1`` (in-tree ``MooncakeConnector``): asynchronous GPU-direct writes; concurrent transfers
  share the link bandwidth (:class:`TransferLink`, a processor-sharing queue).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass
from math import inf
from typing import Any

from servematrix.engine.architecture import Architecture
from servematrix.engine.kvcache import kv_bytes_per_token_per_gpu
from servematrix.recipes import recipe_version

V0_PRODUCER_CHAIN_SHARE = 0.5
"""Share of the v0 copy chain that runs on the producer (D2H, serialise, copy into the managed
buffer: three of the six copies). It runs in the producer engine's process, on the threads of
``SimpleBuffer.drop_select_handler`` and ``MooncakePipe``'s transport executor, and gets nothing
done while that engine runs a step: its device-to-host copies queue on the CUDA default stream
behind the step's kernels, and the engine thread holds the GIL while it launches them (eager
TP steps are launch-bound). So it advances only between the producer's steps (approximate:
all or nothing, no partial progress mid-step)."""

V0_KV_BUFFER_BYTES = 2e9
"""``kv_buffer_size`` of the v0 recipe (Mooncake v0.2 doc command; vLLM's default is 1e9)."""

LINK_OVERRIDES = (
    "nic_gb_s",
    "setup_ms",
    "nics",
    "rank_cpu_gb_s",
    "rank_cpu_fast_gb_s",
    "rank_cpu_fast_mb",
)
"""Keys of ``engine.kv_link`` (config) that replace a preset's values."""


@dataclass(frozen=True)
class KvLink:
    """A resolved KV path for one deployment of TP ``tp``."""

    preset: str
    nic_gb_s: float
    setup_ms: float
    nics: int
    rank_cpu_gb_s: float | None
    rank_cpu_fast_gb_s: float | None
    rank_cpu_fast_mb: float
    tp: int
    provenance: str = ""

    @property
    def wire_bytes_per_s(self) -> float:
        return self.nic_gb_s * 1e9 * self.nics

    def v0_receive_s(self, bytes_per_rank: float) -> float:
        """One request's receive inside the consumer's forward pass, with an idle producer:
        setup, the per-rank CPU chain (ranks in parallel) and the shards of all ranks through
        the shared NICs."""
        cpu = self._cpu_s(bytes_per_rank)
        return self.setup_ms * 1e-3 + cpu + bytes_per_rank * self.tp / self.wire_bytes_per_s

    def v0_producer_s(self, bytes_per_rank: float) -> float:
        """The part of :meth:`v0_receive_s` done by the producer's handler, which advances only
        while the producer's engine is between steps (:data:`V0_PRODUCER_CHAIN_SHARE`)."""
        return V0_PRODUCER_CHAIN_SHARE * self._cpu_s(bytes_per_rank)

    def _cpu_s(self, bytes_per_rank: float) -> float:
        """The per-rank CPU chain: the first ``rank_cpu_fast_mb`` at the fast rate."""
        if not self.rank_cpu_gb_s:
            return 0.0
        fast = 0.0
        if self.rank_cpu_fast_gb_s:
            fast = min(bytes_per_rank, self.rank_cpu_fast_mb * 1e6)
        cpu = (bytes_per_rank - fast) / (self.rank_cpu_gb_s * 1e9)
        if fast:
            cpu += fast / (self.rank_cpu_fast_gb_s * 1e9)
        return cpu


def kv_bytes_per_token_per_rank(arch: Architecture, tp: int, recipe: str) -> float:
    """What a prefill → decode transfer moves per prompt token and TP rank: the rank's KV heads'
    share (replicated below one head per rank), plus in V0 the last hidden state, which every
    rank sends."""
    hidden = arch.hidden_size * 2 if recipe_version(recipe).kv.sends_hidden_state else 0
    return kv_bytes_per_token_per_gpu(arch, tp) + hidden


def v0_receive_segments(receives: list[tuple[float, float]], step_s: float) -> list[list[Any]]:
    """The work of a V0 consumer step that receives KV, in order, as ``[gated, seconds]``: per
    received request (``receives``: its :meth:`KvLink.v0_receive_s` and
    :meth:`KvLink.v0_producer_s`) the producer's share of the copy chain (*gated*: it advances
    only while the producer's engine is between steps) and the rest of that receive, then the
    step's compute (``step_s``, the step's duration with the receives, less the receives)."""
    segments: list[list[Any]] = []
    for receive_s, producer_s in receives:
        segments += [[True, producer_s], [False, receive_s - producer_s]]
    # fsum: exactly n * receive_s when the receives are equal (a fixed-length workload).
    receiving_s = math.fsum(receive_s for receive_s, _ in receives)
    segments.append([False, step_s - receiving_s])
    return segments


def kv_link(recipe: str, protocol: str, tp: int, overrides: Mapping[str, Any] | None) -> KvLink:
    """The preset of (recipe, protocol) with ``engine.kv_link`` overrides applied."""
    try:
        preset = recipe_version(recipe).kv.link_presets[protocol]
    except KeyError:
        raise KeyError(
            f"no KV link preset for recipe {recipe!r} and protocol {protocol!r}"
        ) from None
    values = {
        "nic_gb_s": preset.nic_gb_s,
        "setup_ms": preset.setup_ms,
        "nics": preset.nics or tp,
        "rank_cpu_gb_s": preset.rank_cpu_gb_s,
        "rank_cpu_fast_gb_s": preset.rank_cpu_fast_gb_s,
        "rank_cpu_fast_mb": preset.rank_cpu_fast_mb,
    }
    for key, value in (overrides or {}).items():
        if key not in LINK_OVERRIDES:
            raise KeyError(
                f"unknown engine.kv_link key {key!r} (known: {', '.join(LINK_OVERRIDES)})"
            )
        values[key] = value
    name = preset.name + (" (overridden)" if overrides else "")
    provenance = preset.provenance
    if overrides:
        provenance = f"engine.kv_link overrides {', '.join(sorted(overrides))}; else {provenance}"
    return KvLink(name, tp=tp, provenance=provenance, **values)


class LookupBuffer:
    """The v0 producer's KV lookup buffer of one rank: ``insert`` refuses (the caller stalls
    the prefill instance) while the held bytes exceed the capacity, as ``SimpleBuffer.insert``
    spins while ``buffer_size > buffer_size_threshold``; a consumer's receive frees an entry."""

    def __init__(self, capacity_bytes: float):
        if capacity_bytes <= 0:
            raise ValueError("kv_buffer_size must be > 0")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0.0

    def try_insert(self, nbytes: float) -> bool:
        if self.used_bytes > self.capacity_bytes:
            return False
        self.used_bytes += nbytes
        return True

    def release(self, nbytes: float) -> None:
        self.used_bytes = max(self.used_bytes - nbytes, 0.0)


@dataclass(frozen=True)
class ProxyHop:
    """Latency a proxy adds: on the request path (new aiohttp session per request to a
    localhost server, as round_robin_proxy.py and the disagg proxies do) and per streamed
    chunk relayed back. vLLM PR #11791 measured 5-10 % of disaggregated TTFT for the HTTP proxy
    at input 1024 / output 6; per-hop values are approximate."""

    request_ms: float = 1.5
    chunk_ms: float = 0.2


NO_PROXY = ProxyHop(0.0, 0.0)


class TransferLink:
    """Processor-sharing link; keys identify transfers and come back on completion.

    The time the first flowing transfer drains is cached between changes of the flows (a
    driver asks for the next event after every event, far more often than flows change)."""

    def __init__(self, bandwidth_bytes_per_s: float, setup_s: float):
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("link bandwidth must be > 0")
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.setup_s = setup_s
        self._now = 0.0
        self._flowing: dict[Any, float] = {}  # key -> remaining bytes
        self._pending: list[tuple[float, int, Any, float]] = []  # (flow start, seq, key, bytes)
        self._seq = 0
        self._completed: list[tuple[float, Any]] = []
        self._drain_at: float | None = None  # None: flows changed since it was computed

    def duration_alone_s(self, nbytes: float) -> float:
        """Setup plus bytes at full bandwidth: a transfer that has the link to itself."""
        return self.setup_s + nbytes / self.bandwidth_bytes_per_s

    def start(self, now: float, key: Any, nbytes: float) -> None:
        self._advance_to(now)
        heapq.heappush(self._pending, (now + self.setup_s, self._seq, key, nbytes))
        self._seq += 1

    def busy(self) -> bool:
        return bool(self._flowing) or bool(self._pending)

    def next_event_s(self) -> float:
        """Time of the next completion or flow start (inf when idle)."""
        done = self._drain_at
        if done is None:
            done = self._drain_at = self._drain_time_s()
        if self._pending and self._pending[0][0] < done:
            return self._pending[0][0]
        return done

    def advance(self, now: float) -> list[tuple[float, Any]]:
        """Move the link to ``now``; return (completion time, key) of transfers that finished
        since the last call."""
        self._advance_to(now)
        completed, self._completed = self._completed, []
        return completed

    def _drain_time_s(self) -> float:
        """When the flowing transfer with the fewest bytes left finishes (inf when none)."""
        if not self._flowing:
            return inf
        return self._now + self._time_left_s(min(self._flowing.values()))

    def _time_left_s(self, remaining_bytes: float) -> float:
        """Time for ``remaining_bytes`` at the current share of the bandwidth."""
        return remaining_bytes * len(self._flowing) / self.bandwidth_bytes_per_s

    def _advance_to(self, now: float) -> None:
        """Process every event up to ``now``.

        Terminates: each pass either moves the clock forward (to an event time ≤ ``now``), or
        finishes a flowing transfer, or starts a pending one. A transfer whose remaining time
        does not move the clock (below its float resolution: e.g. 5e-14 s at 512 s, where one
        ulp is 1.1e-13 s) is finished where it stands, since no later clock value could ever
        drain it; without that the next event would stay at "now" forever.
        """
        pending, flowing, bandwidth = self._pending, self._flowing, self.bandwidth_bytes_per_s
        while True:
            nxt = self._drain_at  # next_event_s, inlined
            if nxt is None:
                nxt = self._drain_at = self._drain_time_s()
            if pending and pending[0][0] < nxt:
                nxt = pending[0][0]
            if nxt > now:
                break
            before = self._now
            if nxt > before:  # _progress(nxt), inlined
                if flowing:
                    share = (nxt - before) * bandwidth / len(flowing)
                    for key in flowing:
                        flowing[key] -= share
                    self._drain_at = None
                self._now = nxt
            finished = self._finish_drained(nxt) if flowing else False
            started = False
            while pending and pending[0][0] <= nxt:
                _, _, key, nbytes = heapq.heappop(pending)
                self._flowing[key] = nbytes
                started = True
            if started:
                self._drain_at = None
            if not (finished or started or self._now > before):
                # Unreachable by the argument above; kept so the loop cannot spin.
                self._finish(min(self._flowing, key=self._flowing.__getitem__), nxt)
        if now > self._now:
            self._progress(now)

    def _finish_drained(self, t: float) -> bool:
        """Finish, at ``t``, the transfers that are done: below 1e-3 bytes (float rounding of
        the shares) or below the clock's resolution in time. True if any finished."""
        clock, flows, bandwidth = self._now, len(self._flowing), self.bandwidth_bytes_per_s
        drained = [
            key
            for key, remaining in self._flowing.items()
            # the second test is clock + _time_left_s(remaining) <= clock, inlined
            if remaining <= 1e-3 or clock + remaining * flows / bandwidth <= clock
        ]
        for key in drained:
            self._finish(key, t)
        return bool(drained)

    def _finish(self, key: Any, t: float) -> None:
        del self._flowing[key]
        self._completed.append((t, key))
        self._drain_at = None

    def _progress(self, t: float) -> None:
        if t <= self._now:
            return
        flowing = self._flowing
        if flowing:
            share = (t - self._now) * self.bandwidth_bytes_per_s / len(flowing)
            for key in flowing:
                flowing[key] -= share
            self._drain_at = None
        self._now = t
