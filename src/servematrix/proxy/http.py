"""HTTP/1.1 messages as the relay reads them: llhttp (through ``httptools``, the parser uvicorn
runs on) finds the heads and the bodies' framing (RFC 9112) of client requests and upstream
responses; this module keeps what the relay needs of them."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections import deque
from typing import Any

import httptools

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


class UpstreamError(Exception):
    """An upstream failed before its response could be relayed; ``status`` is for the client."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


class _Refused(Exception):
    """Raised in a parser callback to stop the parser; the reason is kept beside it."""


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


def header_lines(headers: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[bytes]:
    """``Name: value`` lines of the headers whose lower-case names are not in ``drop``."""
    return [name + b": " + value for name, value in headers if name.lower() not in drop]


def by_name(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Header values by lower-case name (the last of repeated ones)."""
    return {name.lower(): value for name, value in headers}


class ClientRequest:
    """A client's request: start line, the header lines to forward, header values by lower-case
    name (the last of repeated ones), and the body. Raises ``ValueError`` for what the relay
    does not forward: HTTP versions other than 1.0 and 1.1, transfer codings but chunked."""

    def __init__(
        self, method: bytes, target: bytes, version: str, headers: list[tuple[bytes, bytes]]
    ):
        if version not in ("1.1", "1.0"):
            raise ValueError(f"unsupported version HTTP/{version}")
        self.method, self.target, self.version = method, target, b"HTTP/" + version.encode()
        self.fields = by_name(headers)
        self.forward = header_lines(headers, REQUEST_DROP)
        self.body = b""
        coding = self.fields.get(b"transfer-encoding")
        if coding is not None and coding.lower() != b"chunked":
            raise ValueError("only a chunked or a Content-Length body")

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

    @property
    def expects_continue(self) -> bool:
        return self.fields.get(b"expect", b"").lower() == b"100-continue"

    def header(self, name: bytes) -> str | None:
        value = self.fields.get(name)
        return None if value is None else value.decode("latin-1")


class RequestReader:
    """A client connection's requests, parsed by llhttp as their bytes arrive. Complete ones
    wait in ``ready``; a malformed one sets ``refusal`` (status, reason), and nothing after it
    is read: its end is unknown (RFC 9112 §6.3; llhttp refuses, among others, two
    ``Content-Length`` fields, one beside ``Transfer-Encoding``, bad chunk sizes)."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self.ready: deque[ClientRequest] = deque()
        self.refusal: tuple[int, str] | None = None
        self.current: ClientRequest | None = None  # head read, body still arriving
        self.continued = False  # the current request's ``100 Continue`` has gone out
        self._target = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = bytearray()
        self._in_head = True  # before a head's end (including between requests)
        self._head_bytes = 0

    def feed(self, data: bytes) -> None:
        """Parse ``data``. A head still unfinished after ``MAX_HEAD_BYTES`` (counting from the
        first read that holds nothing else) is refused."""
        while self.refusal is None and data:
            counted = self._in_head
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                # Relayed as a plain request (its ``Connection`` header is not forwarded, so
                # the upstream does not switch): the next request follows.
                self._parser = httptools.HttpRequestParser(self)
                data = data[exc.args[0] :]
                continue
            except httptools.HttpParserError as exc:
                self._refuse(400, f"malformed request: {exc}")
                return
            if counted and self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
            return

    @property
    def awaits_continue(self) -> bool:
        """The current request's client waits for ``100 Continue`` before it sends the body."""
        current = self.current
        return current is not None and current.expects_continue and not self.continued

    def _refuse(self, status: int, reason: str) -> None:
        if self.refusal is None:  # the first reason; the parser's error follows a callback's
            self.refusal = (status, reason)

    def on_message_begin(self) -> None:
        self._target, self._headers, self._body = b"", [], bytearray()
        self.continued = False

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # not a trailer (dropped: a chunked body's fields are not relayed)
            self._headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        parser = self._parser
        try:
            method = parser.get_method()
            request = ClientRequest(method, self._target, parser.get_http_version(), self._headers)
        except ValueError as exc:
            self._refuse(400, f"malformed request: {exc}")
            raise _Refused from None
        length = request.fields.get(b"content-length", b"0")
        if int(length) > MAX_BODY_BYTES:  # llhttp has checked that it is a number
            self._too_large()
        self.current = request

    def on_body(self, data: bytes) -> None:
        self._body += data
        if len(self._body) > MAX_BODY_BYTES:
            self._too_large()

    def on_message_complete(self) -> None:
        request, self.current = self.current, None
        assert request is not None
        request.body = bytes(self._body)
        self.ready.append(request)
        self._in_head = True

    def _too_large(self) -> None:
        self._refuse(413, f"request body over {MAX_BODY_BYTES} bytes")
        raise _Refused


class ResponseReader:
    """One upstream response, parsed by llhttp: its head, then its body as the client gets it,
    from :meth:`feed`: a chunked body's payload chunked again as it arrives (one chunk per
    piece, so the client never holds half a chunk; chunk extensions and trailers are dropped),
    any other body as it came; or, with ``keep_payload``, its payload gathered in ``payload``
    instead. ``head_only``: the answer to a HEAD, a head alone."""

    def __init__(self, head_only: bool, keep_payload: bool):
        self._parser = httptools.HttpResponseParser(self)
        self.head_only = head_only
        self.keep_payload = keep_payload
        self.status = 0
        self.start_line = b""
        self.lines: list[bytes] = []  # its header lines, but the hop-by-hop ones
        self.fields: dict[bytes, bytes] = {}
        self.head_done = False
        self.done = False
        self.chunked = False
        self.until_close = False  # the body ends when the connection does
        self.keep_alive = True
        self.extra = False  # bytes came after the response's end: the connection is out of step
        self.error: ValueError | None = None  # the response is malformed
        self.payload = bytearray()  # with ``keep_payload``, instead of relayed bytes
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._out: list[bytes] = []
        self._last2 = b"\n\n"  # the payload's last two bytes; the start counts as an event end
        self._head_bytes = 0

    @property
    def at_event_end(self) -> bool:
        """The payload so far ends an SSE event (or is empty)."""
        return self._last2 == b"\n\n"

    def feed(self, data: bytes) -> bytes:
        """The body bytes of ``data`` to relay: those before a malformation too, which then
        sets ``error``."""
        if not data:  # llhttp would take it for the connection's end
            return b""
        if self.done:
            self.extra = True
            return b""
        counted = not self.head_done
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.done, self.keep_alive = True, False  # another protocol follows (101)
        except httptools.HttpParserError as exc:
            if self.done:
                self.extra = True
            else:
                self.error = ValueError(f"malformed response: {exc}")
        if counted and not self.head_done and self.error is None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.error = ValueError(f"response head over {MAX_HEAD_BYTES} bytes")
        out = b"".join(self._out)
        self._out.clear()
        return out

    def on_message_begin(self) -> None:
        self.extra = self.extra or self.done

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:  # not a trailer
            self._headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._reason, self._headers = b"", []  # interim (100 Continue): the answer follows
            return
        self.head_done, self.status, self.keep_alive = True, status, parser.should_keep_alive()
        version = parser.get_http_version().encode()
        self.start_line = b"HTTP/%s %d %s" % (version, status, self._reason)
        self.fields = fields = by_name(self._headers)
        self.lines = header_lines(self._headers, RESPONSE_DROP)
        coding = fields.get(b"transfer-encoding")
        bodied = not (self.head_only or status in (101, 204, 304))
        self.chunked = bodied and coding is not None and coding.lower().endswith(b"chunked")
        self.until_close = (
            bodied and not self.chunked and (coding is not None or b"content-length" not in fields)
        )
        self.done = self.head_only

    def on_body(self, data: bytes) -> None:
        if self.done:  # bytes after a HEAD's answer
            self.extra = True
        elif self.keep_payload:
            self.payload += data
        else:
            self._last2 = data[-2:] if len(data) > 1 else (self._last2 + data)[-2:]
            self._out.append(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def on_message_complete(self) -> None:
        if self.head_done and not self.done:
            self.done = True
            if self.chunked and not self.keep_payload:
                self._out.append(b"0\r\n\r\n")


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
