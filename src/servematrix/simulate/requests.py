"""What every driver shares about the client's requests: the server's refusals, the engine
requests made of them, the chunks a step streams back, the warm-up, and the client's records."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from servematrix.engine.admission import (
    NO_TOKEN_ERROR,
    ContextLengthError,
    granted_max_tokens,
    http_error,
    kv_capacity_message,
)
from servematrix.engine.instance import DecodeRun, StepResult
from servematrix.engine.kvcache import BLOCK_SIZE_TOKENS, BlockPool
from servematrix.engine.scheduler import Request
from servematrix.spec.trace import RequestRecord
from servematrix.workload import RequestLengths, replay


@dataclass(frozen=True)
class Served:
    """What the server makes of each request before an engine sees it, by request id: the
    ``max_tokens`` it serves (0.33 clamps to what the context leaves) and, for a request it
    does not serve, the ``error`` its client records."""

    max_tokens: list[int]
    errors: dict[int, str]


def serve_or_refuse(
    recipe: str, max_model_len: int, pool: BlockPool, lengths: RequestLengths
) -> Served:
    """Apply vLLM's refusals (`servematrix.engine.admission`) to every request.

    Only requests beyond the context or, in V0 (a pool with a watermark), with a prompt longer
    than an empty pool admits are looked at one by one: the rest pass unchanged."""
    inputs, outputs, text = lengths.input_lens, lengths.output_lens, lengths.text_prompt
    max_tokens, errors = outputs, {}
    long = []
    if max(map(operator.add, inputs, outputs)) > max_model_len:
        totals = map(operator.add, inputs, outputs)
        long = [k for k, total in enumerate(totals) if total > max_model_len]
    if long:
        max_tokens = list(outputs)
        for k in long:
            try:
                max_tokens[k] = granted_max_tokens(
                    recipe, inputs[k], outputs[k], max_model_len, bool(text and text[k])
                )
            except ContextLengthError as error:
                errors[k] = http_error(error.status, error.message)
    # V0's block manager never allocates a prompt needing more blocks than the watermark
    # leaves of the whole pool: it ignores the request, which then streams no token.
    never_tokens = (pool.num_blocks - pool.watermark_blocks) * pool.block_size
    if pool.watermark_blocks and max(inputs) > never_tokens:
        for k, prompt in enumerate(inputs):
            if prompt > never_tokens and k not in errors:
                errors[k] = f"{NO_TOKEN_ERROR}; the server logged: {kv_capacity_message(prompt)}"
    return Served(max_tokens, errors)


class Requests:
    """Makes the engine's requests of the cell (with their prefix-cache chains, if any) and
    keeps them, to count each request id's preemptions at the end."""

    def __init__(self, lengths: RequestLengths, served: Served):
        self.input_lens = lengths.input_lens
        self.max_tokens = served.max_tokens
        self.refused = served.errors
        self.prefix_tokens = lengths.shared_prefix_tokens
        self.group = (0,) if self.prefix_tokens else ()
        self.chains = lengths.prefix_chains
        self.groups = lengths.prefix_groups  # per request when there are several system prompts
        self.made: list[Request] = []

    def new(self, k: int, max_tokens: int | None = None) -> Request:
        """Request ``k`` as the client sends it (``max_tokens``: the proxy's own limit)."""
        request = Request(
            k,
            self.input_lens[k],
            self.max_tokens[k] if max_tokens is None else max_tokens,
            **self.prefix(k),
        )
        self.made.append(request)
        return request

    def served(self, ids: range, limit: int | None = None) -> list[Request | None]:
        """Requests ``ids`` as `new` makes them (``limit``: its ``max_tokens``), None for the
        refused ones; one comprehension, as a 100,000-request cell makes them all at once."""
        inputs, refused = self.input_lens, self.refused
        max_tokens = self.max_tokens if limit is None else [limit] * len(inputs)
        if not self.group and not self.chains:  # nothing to share: no keyword arguments
            made = [Request(k, inputs[k], max_tokens[k]) for k in ids]
        else:
            made = [Request(k, inputs[k], max_tokens[k], **self.prefix(k)) for k in ids]
        if refused:
            made = [None if request.request_id in refused else request for request in made]
        self.made.extend(request for request in made if request is not None)
        return made

    def prefix(self, k: int) -> dict[str, Any]:
        """Request ``k``'s prefix-cache chain: a trace's 512-token blocks, or the one shared
        prefix of every prompt, or the system prompt it starts with (`replay.engine_chains`,
        `RequestLengths`)."""
        if self.chains:
            return {
                "prefix_chain": self.chains[k],
                "prefix_tokens": self.input_lens[k],
                "prefix_segment_blocks": replay.BLOCK_TOKENS // BLOCK_SIZE_TOKENS,
            }
        chain = (self.groups[k],) if self.groups else self.group
        return {"prefix_chain": chain, "prefix_tokens": self.prefix_tokens}

    def keep(self, request: Request) -> Request:
        self.made.append(request)
        return request

    def preemptions(self, total: int) -> list[int]:
        counts = [0] * total
        for request in self.made:
            counts[request.request_id] += request.num_preemptions
        return counts


def emit_chunks(
    chunks: list[list[float]],
    started_s: float,
    now_s: float,
    result: StepResult | DecodeRun,
    hop_s: float,
) -> None:
    """The chunks a step (or a run of decode steps) that started at ``started_s`` and ended at
    ``now_s`` streams back: each token reaches the client ``hop_s`` after its step's end."""
    if isinstance(result, DecodeRun):
        emit_run(chunks, started_s, result, hop_s)
    else:
        emit_step(chunks, now_s, result, hop_s)


def emit_run(chunks: list[list[float]], started_s: float, run: DecodeRun, hop_s: float) -> None:
    """`emit_chunks` of a run of decode steps (for a loop that knows it has one)."""
    ends = [started_s + hop_s + end for end in run.step_ends_s]
    for request in run.requests:
        chunks[request.request_id].extend(ends)


def emit_step(chunks: list[list[float]], now_s: float, result: StepResult, hop_s: float) -> None:
    """`emit_chunks` of one step that ended at ``now_s``."""
    seen = now_s + hop_s
    for request in result.emitted:
        chunks[request.request_id].append(seen)


def warm_up(
    count: int, chunks: list[list[float]], send: Callable[[int, float], None], refused_s: float
) -> list[float]:
    """The warm-up requests, sent one at a time before the clock starts: ``send(k, at)`` serves
    request k sent at ``at`` to its end (its chunks in ``chunks``), and the next one goes when
    its last chunk is back (``refused_s`` later for a refused one, which has none). Returns
    their send times; they and their chunks are shifted to end at t = 0."""
    clock = 0.0
    sends = []
    for k in range(count):
        sends.append(clock)
        send(k, clock)
        clock = chunks[k][-1] if chunks[k] else clock + refused_s
    for k in range(count):
        chunks[k] = [t - clock for t in chunks[k]]
    return [t - clock for t in sends]


def capped(cap: int | None, num_prompts: int) -> bool:
    """Whether a concurrency cap can hold a request back (a cap of N or more never does)."""
    return cap is not None and cap < num_prompts


def records(
    workload_warmups: int,
    warmup_sends: list[float],
    sends: np.ndarray,
    sent: list[float] | None,
    chunks: list[list[float]],
    lengths: RequestLengths,
    requests: Requests,
) -> list[RequestRecord]:
    """Client records: warm-ups first (``warmup=True``), then the measured requests.

    ``sends`` are the scheduled times of the measured requests, ``sent`` their actual send
    times when a concurrency cap delayed some (None: sent as scheduled). A refused request
    has no chunks and its error."""
    scheduled = [*warmup_sends, *sends.tolist()]
    sent_times = scheduled if sent is None else [*warmup_sends, *sent]
    errors: list[str | None] = [None] * len(scheduled)
    for k, error in requests.refused.items():
        errors[k] = error
    return [
        # Positional in field order (a third faster than keywords over 100,000 records).
        RequestRecord(
            index,  # request_id
            index < workload_warmups,  # warmup
            planned,  # scheduled_s
            actual,  # sent_s
            times[0] if times else None,  # first_token_s
            times[-1] if times else None,  # end_s
            times,  # chunk_s
            [1] * len(times),  # chunk_tokens
            input_len,  # prompt_tokens
            len(times),  # completion_tokens
            error is None,  # success
            error,
            request_input_len=input_len,
            request_output_len=output_len,
            preemptions=preempted,
        )
        for index, (planned, actual, times, input_len, output_len, error, preempted) in enumerate(
            zip(
                scheduled,
                sent_times,
                chunks,
                lengths.input_lens,
                lengths.output_lens,
                errors,
                requests.preemptions(len(scheduled)),
                strict=True,
            )
        )
    ]
