"""The response side of the load generator: a streamed completion's bytes, parsed as they
arrive, and what one request's row says.

**Token events (vLLM 0.33's client rule).** Every streamed chunk that carries ``choices`` is a
token event, whether its text is empty or not: its arrival time goes into ``chunk_s`` and the
growth of ``usage.completion_tokens`` since the previous event into ``chunk_tokens`` (1 when
the server sends no continuous usage). Real vLLM streams ``"text": ""`` for special tokens
and for a partial UTF-8 character; vLLM 0.6's client skipped those chunks, which on a real
server turned completed requests into "stream ended without a token" and merged two tokens'
times into one (``servematrix.results.metrics``, ITL). A usage-only chunk (``choices: []``) is not
an event.

**Success** is HTTP 200, a stream that ends with ``[DONE]``, no error event, and at least one
completion token (the server's usage, else the events counted): a completed request is never
a failed row.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from servematrix.engine.admission import NO_TOKEN_ERROR
from servematrix.spec.trace import RequestRecord

if TYPE_CHECKING:
    from servematrix.workload import RequestSpec


class StreamParser:
    """One request's stream, parsed incrementally, in monotonic seconds (converted at the end).

    Chunks are timestamped when their bytes arrive, before any parsing: the per-chunk work the
    client adds to a measured time is one ``time.monotonic()`` call. Lines are SSE ``data:``
    fields, one JSON event each (vLLM never splits an event over several lines); other lines
    (comments, keep-alives, blank separators) are skipped.
    """

    __slots__ = (
        "_buffer",
        "_counted",
        "chunk_s",
        "chunk_tokens",
        "completion_tokens",
        "done",
        "error",
        "on_first_bytes",
        "prompt_tokens",
        "sent",
        "status",
        "timed_out",
    )

    def __init__(self) -> None:
        self.sent = 0.0
        self.chunk_s: list[float] = []
        self.chunk_tokens: list[int] = []
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error: str | None = None
        self.done = False  # [DONE] seen
        self.status: int | None = None  # an HTTP status other than 200, when refused
        self.timed_out = False  # ended by the client's timeout (``senders.Limits``)
        self._buffer = b""
        self._counted = 0  # completion tokens already attributed to a token event
        self.on_first_bytes: Callable[[], None] | None = None  # called once, at the first feed

    def feed(self, data: bytes, arrived: float) -> None:
        if self.on_first_bytes is not None:
            self.on_first_bytes()
            self.on_first_bytes = None
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), arrived)

    def _event(self, payload: bytes, arrived: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        event = json.loads(payload)
        if "error" in event:  # a failure after the 200 header: one error event, then [DONE]
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.error = f"error in stream: {message}"
            return
        usage = event.get("usage")
        if event.get("choices"):  # a token event, even with empty text (see the module doc)
            self.chunk_s.append(arrived)
            if usage is None:  # no continuous usage: count the chunk as one token
                self.chunk_tokens.append(1)
                self._counted += 1
            else:
                self.chunk_tokens.append(usage["completion_tokens"] - self._counted)
                self._counted = usage["completion_tokens"]
        if usage is not None:
            self.prompt_tokens = usage["prompt_tokens"]
            self.completion_tokens = usage["completion_tokens"]

    @property
    def tokens(self) -> int:
        """Completion tokens: the server's last usage, else the events counted."""
        return self.completion_tokens if self.completion_tokens is not None else self._counted

    def finish(self) -> None:
        """Set ``error`` for a stream that ended without any error but is not a success."""
        if self.error is None:
            if not self.done:
                self.error = "stream ended before [DONE]"
            elif not self.chunk_s or self.tokens < 1:
                self.error = NO_TOKEN_ERROR


class HTTPStatusError(Exception):
    def __init__(self, status: int, message: str):
        self.status = status
        self.message = " ".join(message.split())
        super().__init__(f"HTTP {status}: {self.message[:500]}")


def status_message(status: int, text: str) -> HTTPStatusError:
    """vLLM's error body (0.33 nested, 0.6 flat) reduced to its message."""
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", text) if isinstance(error, dict) else str(error)
    except ValueError:
        message = text
    return HTTPStatusError(status, str(message) or "(empty body)")


def record(
    spec: RequestSpec, raw: StreamParser, origin: float, scheduled_s: float | None = None
) -> RequestRecord:
    """The trace row of one request, its times relative to ``origin`` (monotonic t = 0)."""
    chunk_s = [t - origin for t in raw.chunk_s]
    return RequestRecord(
        request_id=spec.request_id,
        warmup=spec.warmup,
        scheduled_s=spec.scheduled_s if scheduled_s is None else scheduled_s,
        sent_s=raw.sent - origin,
        first_token_s=chunk_s[0] if chunk_s else None,
        end_s=chunk_s[-1] if chunk_s else None,
        chunk_s=chunk_s,
        chunk_tokens=raw.chunk_tokens,
        prompt_tokens=raw.prompt_tokens if raw.prompt_tokens is not None else spec.input_len,
        completion_tokens=raw.tokens,
        success=raw.error is None,
        error=raw.error,
        request_input_len=spec.input_len,
        request_output_len=spec.output_len,
    )
