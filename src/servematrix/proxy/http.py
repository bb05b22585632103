"""HTTP/1.1 messages as the relay reads them (RFC 9112): heads, body framing, client requests."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

log = logging.getLogger("servematrix.proxy")

# Per-connection headers (RFC 9110 §7.6.1), and those the proxy sets itself.
REQUEST_DROP = frozenset(
    (b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"te")
) | {b"expect"}
RESPONSE_DROP = frozenset((b"connection", b"keep-alive"))
INFERENCE_PATHS = (b"/v1/completions", b"/v1/chat/completions")
HEALTH_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 1 << 16
MAX_BODY_BYTES = 1 << 30
MAX_LINE_BYTES = 4096


class UpstreamError(Exception):
    """An upstream failed before its response could be relayed; ``status`` is for the client."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def error_body(message: str, status: int) -> bytes:
    """vLLM 0.33's error object (wire reference §4), for errors the proxy itself reports."""
    error = {"message": message, "type": "ProxyError", "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def parse_head(head: bytes) -> tuple[list[bytes], list[bytes], dict[bytes, bytes]]:
    """A message head (without its blank line) as its start line's three parts, its header
    lines as received, and their values by lower-case name (the last of repeated ones). Raises
    ``ValueError``, also for ``Content-Length`` fields that disagree: the body's end would be
    ambiguous, an unrecoverable framing error (RFC 9112 §6.3; equal ones are one value)."""
    start, *lines = head.split(b"\r\n")
    parts = start.split(b" ", 2)
    if len(parts) != 3:
        raise ValueError(f"bad start line {start[:100]!r}")
    fields = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        # No space before the colon, no obsolete line folding: both are smuggling vectors.
        if not colon or not name or name[:1] in b" \t" or name[-1:] in b" \t":
            raise ValueError(f"bad header line {line[:100]!r}")
        name, value = name.lower(), value.strip()
        if name == b"content-length" and fields.get(name, value) != value:
            raise ValueError(f"conflicting Content-Length {fields[name][:40]!r} and {value[:40]!r}")
        fields[name] = value
    return parts, lines, fields


class BodyFraming:
    """Where an HTTP/1.1 message body ends (RFC 9112 §6): after ``length`` bytes, after the last
    chunk of a chunked body, or (``length`` None, not chunked) when the connection closes. Fed
    the bytes after the head as they arrive; with ``keep`` it also gathers the payload."""

    def __init__(self, length: int | None, chunked: bool, keep: bool):
        self.chunked = chunked
        self.remaining = None if chunked else length
        self.done = not chunked and length == 0
        self.keep = keep
        self.payload = bytearray()
        self._data = 0  # payload bytes left in the current chunk
        self._crlf = 0  # bytes left of the CRLF after it
        self._line = b""  # a chunk-size or trailer line so far
        self._trailers = False
        self._last2 = b"\n\n"  # the payload's last two bytes; the start counts as an event end

    def feed(self, data: bytes) -> int:
        """How many bytes of ``data`` belong to the body (all but what follows its end).
        Raises ``ValueError`` on a malformed chunked body."""
        if not self.chunked:
            used = len(data) if self.remaining is None else min(self.remaining, len(data))
            if self.remaining is not None:
                self.remaining -= used
                self.done = self.remaining == 0
            if self.keep:
                self.payload += data[:used]
            return used
        i, n = 0, len(data)
        while i < n and not self.done:
            if self._data:
                take = min(self._data, n - i)
                piece = data[i : i + take]
                self._last2 = piece[-2:] if take >= 2 else (self._last2 + piece)[-2:]
                if self.keep:
                    self.payload += piece
                self._data -= take
                self._crlf = 0 if self._data else 2
                i += take
            elif self._crlf:
                take = min(self._crlf, n - i)
                self._crlf -= take
                i += take
            else:
                j = data.find(b"\n", i)
                if j < 0:
                    self._line += data[i:]
                    if len(self._line) > MAX_LINE_BYTES:
                        raise ValueError("chunk-size line too long")
                    return n
                line = (self._line + data[i:j]).rstrip(b"\r")
                self._line = b""
                i = j + 1
                if self._trailers:
                    self.done = not line
                    continue
                size = line.split(b";", 1)[0].strip()
                if not size or size.strip(b"0123456789abcdefABCDEF"):
                    raise ValueError(f"bad chunk size {line[:40]!r}")
                self._data = int(size, 16)
                self._trailers = self._data == 0
        return i

    @property
    def at_event_end(self) -> bool:
        """Between chunks, and the payload so far ends an SSE event (or is empty)."""
        between = not (self._data or self._crlf or self._line or self._trailers)
        return between and self._last2 == b"\n\n"


class ClientRequest:
    """A client's request: start line, the header lines to forward, header values by lower-case
    name (the last of repeated ones), and the body."""

    def __init__(self, head: bytes):
        (self.method, self.target, self.version), lines, self.fields = parse_head(head)
        if self.version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise ValueError(f"unsupported version {self.version[:20]!r}")
        self.forward = [
            line for line in lines if line.partition(b":")[0].lower() not in REQUEST_DROP
        ]
        self.body = b""
        coding = self.fields.get(b"transfer-encoding")
        length = self.fields.get(b"content-length")
        self.chunked = coding is not None
        if coding is not None and (coding.lower() != b"chunked" or length is not None):
            raise ValueError("only a chunked or a Content-Length body")
        if length is not None and not length.isdigit():
            raise ValueError(f"bad Content-Length {length[:40]!r}")
        self.length = int(length or 0)

    @property
    def path(self) -> bytes:
        return self.target.split(b"?", 1)[0]

    @property
    def http10(self) -> bool:
        return self.version == b"HTTP/1.0"

    @property
    def keep_alive(self) -> bool:
        connection = self.fields.get(b"connection", b"").lower()
        return b"close" not in connection and not self.http10

    def header(self, name: bytes) -> str | None:
        value = self.fields.get(name)
        return None if value is None else value.decode("latin-1")


def with_members(raw: bytes, members: dict[str, Any]) -> bytes:
    """``raw``, a JSON object's bytes, with ``members`` appended. They override members of the
    same name: JSON decoders (Python's, hence vLLM's FastAPI and the emulator) keep the last of
    duplicate names. Appending costs a copy of the bytes, where decoding and encoding a
    32k-token prompt takes tens of milliseconds in Python: the proxies never decode a body.
    Raises ``UpstreamError`` (400) if ``raw`` is plainly not an object; anything subtler is
    the upstream's to reject."""
    body = raw.strip()
    if body[:1] != b"{" or body[-1:] != b"}":
        raise UpstreamError("request body is not a JSON object", 400)
    inner = body[:-1].rstrip()
    extra = json.dumps(members, separators=(",", ":")).encode()[1:-1]
    return inner + (b"" if inner == b"{" else b",") + extra + b"}"


def prefill_members(raw: bytes) -> dict[str, Any]:
    """``max_tokens`` 1 for the prefill copy (and ``max_completion_tokens``, if sent)."""
    members: dict[str, Any] = {"max_tokens": 1}
    if b'"max_completion_tokens"' in raw:
        members["max_completion_tokens"] = 1
    return members
