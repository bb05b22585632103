"""Streaming pass-through proxies in front of serving instances, runnable as a process.

Command lines (what ``servematrix.deploy`` starts; every flag but ``--host`` is required)::

    python -m servematrix.proxy round-robin --port 8090 --upstream http://127.0.0.1:8100 \\
        --upstream http://127.0.0.1:8200
    python -m servematrix.proxy disagg-v0 --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200
    python -m servematrix.proxy disagg-v1 --port 8000 --prefill http://127.0.0.1:8010 8998 \\
        --decode http://127.0.0.1:8020

(``--host`` defaults to 127.0.0.1; ``--upstream``, ``--prefill`` and ``--decode`` may repeat,
each list is cycled.) ``GET /health`` is answered by the proxy itself: 200 when every upstream's
``/health`` is 200 (and, for ``disagg-v1``, the prefillers' engine ids are known), else 503;
the JSON body names each upstream's state.

* ``round-robin`` does what vLLM's ``round_robin_proxy.py`` does (wire reference §10): each
  request goes to the next upstream of a strict cycle, method, path, headers and body unchanged,
  and the upstream's status, headers and bytes come back unchanged as they arrive. Unlike it,
  only POST requests advance the cycle (a GET goes to the first upstream): a client's readiness
  polling must not change which instance the first inference request reaches, since the
  simulator assumes the first warm-up takes the first slot (``simulate.round_robin_targets``).
* ``disagg-v0`` is the 0.6.x ``disagg_prefill_proxy_server.py`` (§9): a copy of the request with
  ``max_tokens`` 1 (the client's bytes with ``"max_tokens":1`` appended, :func:`with_members`)
  goes to the prefiller and is drained, then the unmodified request goes to the decoder and its
  response is streamed back. Unlike the original (which sent the decode anyway
  and answered 200 with an empty body), a failed prefill fails the request: the client gets an
  error naming the prefill instance and its answer, and the decoder never sees the request.
* ``disagg-v1`` is vLLM 0.33's ``mooncake_connector_proxy.py`` (§8): at start it waits for each
  prefiller's ``/health``, then learns its engine ids from the bootstrap server's ``/query``
  (503 until then). Per request it mints ``transfer_id = "xfer-<uuid4>"``, sends the prefill
  (``kv_transfer_params`` with ``do_remote_decode``, ``stream`` false, ``max_tokens`` 1,
  ``stream_options`` null) without waiting for it, and at once streams the decode request
  (``do_remote_prefill``, ``remote_bootstrap_addr``, ``remote_engine_id``, ``transfer_id``). The
  decoder pulls the KV when the prefill has produced it. Differences from the original, all
  outside the KV protocol: the changed members are appended to the client's JSON bytes rather
  than the body decoded and re-encoded (:func:`with_members`; the prefill copy says
  ``"stream_options": null`` where the original deletes the key, which vLLM reads alike);
  the client's ``X-Request-Id`` (if any) is kept on both requests so
  servers' per-request logs line up with the client's (the original replaces it with the uuid);
  the decoder's status and content type are relayed (the original relabels its bytes as
  ``application/json``); a failed prefill is logged, and the decoder's pull then fails the
  request, as in vLLM.

**The relay.** A proxy must add well under a millisecond, and an aiohttp server plus client cost
~0.8 ms of CPU per request on a small machine (``benchmarks/proxy_overhead.py``). So the proxies
speak HTTP/1.1 themselves, on asyncio protocols (uvloop's event loop when installed): a request's
head and its ``Content-Length`` (or chunked) body are read, the request goes out in one write on a
pooled keep-alive upstream connection (no connection limit, 30 s to connect, no total timeout,
``TCP_NODELAY`` on every socket), and the upstream's response bytes are written to the client
from the upstream connection's receive callback as they arrive, its framing (chunked or
``Content-Length``) and encoding untouched; only ``Connection``/``Keep-Alive`` headers are
hop-by-hop. The response head waits for the first body bytes so both leave in one write. If
an upstream dies in the middle of a streamed (SSE) response, the client gets one
``data: {"error": ...}`` event naming the upstream, then ``data: [DONE]`` (vLLM's own shape for
errors after the 200 header); mid-way through any other body, the connection is cut. A client
that goes away closes the upstream connection, so the server aborts the request as it would
without the proxy. An HTTP/1.0 client's request goes upstream as HTTP/1.0 on a connection of its
own (no chunked answer can reach it). SIGTERM or SIGINT closes the listener and every
connection, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import ssl
import sys
import uuid
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import urlsplit

log = logging.getLogger("servematrix.proxy")

# Per-connection headers (RFC 9110 §7.6.1), and those the proxy sets itself.
_REQUEST_DROP = frozenset(
    (b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"te")
) | {b"expect"}
_RESPONSE_DROP = frozenset((b"connection", b"keep-alive"))
_INFERENCE_PATHS = (b"/v1/completions", b"/v1/chat/completions")
_HEALTH_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_S = 30.0
_MAX_HEAD_BYTES = 1 << 16
_MAX_BODY_BYTES = 1 << 30
_MAX_LINE_BYTES = 4096


class UpstreamError(Exception):
    """An upstream failed before its response could be relayed; ``status`` is for the client."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def error_body(message: str, status: int) -> bytes:
    """vLLM 0.33's error object (wire reference §4), for errors the proxy itself reports."""
    error = {"message": message, "type": "ProxyError", "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _parse_head(head: bytes) -> tuple[list[bytes], list[bytes], dict[bytes, bytes]]:
    """A message head (without its blank line) as its start line's three parts, its header
    lines as received, and their values by lower-case name. Raises ``ValueError``."""
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
        key, value = name.lower(), value.strip()
        # RFC 9112 §6.3: differing Content-Length values are an unrecoverable framing error
        # (taking either one lets the message's end be disputed).
        if key == b"content-length" and fields.get(key, value) != value:
            raise ValueError(f"conflicting Content-Length {fields[key][:20]!r}, {value[:20]!r}")
        fields[key] = value
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
                    if len(self._line) > _MAX_LINE_BYTES:
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


class _Exchange:
    """One request and its response on an upstream connection. The response's body bytes go
    to ``sink`` as they arrive (raw, framing included), or wait in ``pending`` until one is set."""

    def __init__(self, connection: _UpstreamConnection, keep_payload: bool):
        self.connection = connection
        self.start_line = b""
        self.status = 0
        self.lines: list[bytes] = []
        self.fields: dict[bytes, bytes] = {}
        self.body: BodyFraming | None = None
        self.keep_payload = keep_payload
        self.pending: list[bytes] = []
        self.sink: Callable[[bytes], Any] | None = None
        self.error: Exception | None = None
        self.finished = False
        self.received = False  # any response byte yet
        self._head_waiter = asyncio.get_running_loop().create_future()
        self._end_waiter: asyncio.Future[None] | None = None

    @property
    def sse(self) -> bool:
        media = self.fields.get(b"content-type", b"").split(b";", 1)[0]
        return media.strip().lower() == b"text/event-stream"

    async def head(self) -> None:
        """Until the response head has arrived; raises what ended the exchange before it."""
        await self._head_waiter

    async def end(self) -> None:
        """Until the response has ended, or failed (then ``error`` says why)."""
        if not self.finished:
            self._end_waiter = asyncio.get_running_loop().create_future()
            await self._end_waiter

    def head_arrived(self) -> None:
        if not self._head_waiter.done():
            self._head_waiter.set_result(None)

    def close(self, error: Exception | None) -> None:
        self.finished = True
        self.error = error
        if error is not None and not self._head_waiter.done():
            self._head_waiter.set_exception(error)
        if self._end_waiter is not None and not self._end_waiter.done():
            self._end_waiter.set_result(None)


class _UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to an upstream, one exchange at a time."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.head_only = False  # the exchange's request was a HEAD: no body follows
        self.reusable = True
        self.closed = False
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        _set_nodelay(transport)
        self.upstream.connections.add(self)

    def start(self, request: bytes, keep_payload: bool, head_only: bool) -> _Exchange:
        assert self.transport is not None and self.exchange is None
        self.exchange = _Exchange(self, keep_payload)
        self.head_only = head_only
        self.transport.write(request)
        return self.exchange

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # nothing was asked: the connection is out of step
            self._abandon()
            return
        exchange.received = True
        if exchange.body is None:
            data = self._read_head(exchange, data)
            if exchange.body is None:
                return
        body = exchange.body
        try:
            used = body.feed(data)
        except ValueError as exc:
            self._abandon(exc)
            return
        if used < len(data):  # bytes after the response: the connection cannot be trusted
            self.reusable = False
            data = data[:used]
        if data:
            if exchange.sink is not None:
                exchange.sink(data)
            else:
                exchange.pending.append(data)
        if body.done:
            self._finish(None)

    def _read_head(self, exchange: _Exchange, data: bytes) -> bytes:
        """Parse the response head once it is complete; return the bytes after it."""
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES:
                    self._abandon(ValueError("response head too long"))
                return b""
            head, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
            try:
                (version, status, _), lines, fields = _parse_head(head)
                start = head.split(b"\r\n", 1)[0]
                code = int(status)
                chunked = b"chunked" in fields.get(b"transfer-encoding", b"").lower()
                length = None if chunked else fields.get(b"content-length")
                if length is not None and not length.isdigit():
                    raise ValueError(f"bad Content-Length {length[:40]!r}")
            except ValueError as exc:
                self._abandon(exc)
                return b""
            if 100 <= code < 200 and code != 101:
                continue  # an interim response (100 Continue, 103 Early Hints): the answer follows
            break
        connection = fields.get(b"connection", b"").lower()
        if b"close" in connection or (version == b"HTTP/1.0" and b"keep-alive" not in connection):
            self.reusable = False
        if self.head_only or code in (101, 204, 304):
            body = BodyFraming(0, False, exchange.keep_payload)
            self.reusable = self.reusable and code != 101  # switched to another protocol
        else:
            body = BodyFraming(
                None if length is None else int(length), chunked, exchange.keep_payload
            )
            if length is None and not chunked:
                self.reusable = False  # the body ends when the connection does
        exchange.start_line, exchange.status = start, code
        exchange.lines, exchange.fields = lines, fields
        exchange.body = body
        exchange.head_arrived()
        data, self._buffer = self._buffer, b""
        return data

    def _finish(self, error: Exception | None) -> None:
        exchange, self.exchange = self.exchange, None
        self._buffer = b""
        if exchange is not None:
            exchange.close(error)
        if error is None and self.reusable and not self.closed:
            self.upstream.idle.append(self)
        elif not self.closed:
            self.close()

    def _abandon(self, error: Exception | None = None) -> None:
        self._finish(error or ConnectionError("the upstream sent bytes nobody asked for"))

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.upstream.connections.discard(self)
        if self in self.upstream.idle:
            self.upstream.idle.remove(self)
        exchange = self.exchange
        if exchange is None:
            return
        body = exchange.body
        if body is not None and body.remaining is None and not body.chunked:
            self._finish(None)  # a body delimited by the connection's end: complete
        elif body is None:
            self._finish(exc or ConnectionError("the connection closed before a response"))
        else:
            self._finish(exc or ConnectionError("the connection closed before the response's end"))


class Upstream:
    """One upstream (``http[s]://host:port``) and its pooled keep-alive connections."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.url = url
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.host_header = parts.netloc.encode()
        self.tls = parts.scheme == "https"
        self.idle: list[_UpstreamConnection] = []
        self.connections: set[_UpstreamConnection] = set()

    async def _connect(self) -> _UpstreamConnection:
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if self.tls else None
        connect = loop.create_connection(
            lambda: _UpstreamConnection(self), self.host, self.port, ssl=context
        )
        _, connection = await asyncio.wait_for(connect, _CONNECT_TIMEOUT_S)
        return connection

    def request_bytes(
        self,
        method: bytes,
        target: bytes,
        lines: Sequence[bytes],
        body: bytes,
        http10: bool = False,
    ) -> bytes:
        """The request's bytes: start line, ``Host``, ``lines``, ``Content-Length``, body."""
        parts = [method, b" ", target, b" HTTP/1.0\r\nHost: " if http10 else b" HTTP/1.1\r\nHost: "]
        parts.append(self.host_header)
        for line in lines:
            parts += (b"\r\n", line)
        if body or method not in (b"GET", b"HEAD"):
            parts.append(b"\r\nContent-Length: %d" % len(body))
        parts += (b"\r\n\r\n", body)
        return b"".join(parts)

    def begin(
        self, request: bytes, keep_payload: bool = False, head_only: bool = False
    ) -> _Exchange | None:
        """Send ``request`` (see :meth:`request_bytes`) at once on an idle pooled connection,
        if there is one; :meth:`send` takes it from there."""
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                return connection.start(request, keep_payload, head_only)
        return None

    async def send(
        self,
        request: bytes,
        keep_payload: bool = False,
        head_only: bool = False,
        fresh: bool = False,
        begun: _Exchange | None = None,
    ) -> _Exchange:
        """Send ``request`` (or take ``begun``, its exchange from :meth:`begin`) and return the
        exchange once the response head has arrived. If a pooled connection turns out closed
        before any answer (the server's keep-alive timeout), the request goes again on a new
        connection. ``fresh``: a new connection, closed after. Raises ``OSError`` (unreachable,
        closed) or ``ValueError`` (a malformed answer)."""
        exchange = begun or (None if fresh else self.begin(request, keep_payload, head_only))
        pooled = exchange is not None
        while True:
            if exchange is None:
                connection = await self._connect()
                connection.reusable = not fresh
                exchange = connection.start(request, keep_payload, head_only)
            try:
                await exchange.head()
                return exchange
            except ConnectionError:
                if not (pooled and not exchange.received):
                    raise
                exchange, pooled = None, False
            except BaseException:
                exchange.connection.close()  # cancelled mid-exchange: out of step
                raise

    async def fetch(self, request: bytes, begun: _Exchange | None = None) -> tuple[int, bytes]:
        """One whole exchange (or the rest of ``begun``, ``request`` sent by :meth:`begin`):
        the response's status and payload (de-chunked)."""
        exchange = await self.send(request, True, begun=begun)
        try:
            await exchange.end()
        except BaseException:
            if not exchange.finished:
                exchange.connection.close()
            raise
        if exchange.error is not None:
            raise exchange.error
        assert exchange.body is not None
        return exchange.status, bytes(exchange.body.payload)

    def close(self) -> None:
        for connection in list(self.connections):
            connection.close()


class Request:
    """A client's request: start line, the header lines to forward, header values by lower-case
    name (the last of repeated ones), and the body."""

    def __init__(self, head: bytes):
        (self.method, self.target, self.version), lines, self.fields = _parse_head(head)
        if self.version not in (b"HTTP/1.1", b"HTTP/1.0"):
            raise ValueError(f"unsupported version {self.version[:20]!r}")
        self.forward = [
            line for line in lines if line.partition(b":")[0].lower() not in _REQUEST_DROP
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


class _ClientConnection(asyncio.Protocol):
    """One client's connection: its requests one at a time, each answered by ``proxy``."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.gone = False
        self._buffer = bytearray()
        self._request: Request | None = None  # head read, body still arriving
        self._chunks: BodyFraming | None = None  # a chunked request body's framing
        self._busy = False  # a request is being answered
        self._close_after = False
        self._head_request = False  # the request being answered is a HEAD: no body goes back
        self._wrote = False  # any byte of its answer has gone out
        self._relaying: _UpstreamConnection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        _set_nodelay(transport)
        self.proxy.clients.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.proxy.clients.discard(self)
        if self._relaying is not None:
            self._relaying.close()  # the server aborts the request, as without the proxy

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._busy:
            self._next_request()

    def pause_writing(self) -> None:
        if self._relaying is not None and self._relaying.transport is not None:
            self._relaying.transport.pause_reading()

    def resume_writing(self) -> None:
        if self._relaying is not None and self._relaying.transport is not None:
            self._relaying.transport.resume_reading()

    def _next_request(self) -> None:
        assert self.transport is not None
        if self._request is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES:
                    self._refuse(431, "request head too large")
                return
            try:
                request = Request(bytes(self._buffer[:end]))
            except ValueError as exc:
                self._refuse(400, f"malformed request: {exc}")
                return
            del self._buffer[: end + 4]
            if request.length > _MAX_BODY_BYTES:
                self._refuse(413, f"request body over {_MAX_BODY_BYTES} bytes")
                return
            expect = request.fields.get(b"expect", b"").lower() == b"100-continue"
            if expect and (request.chunked or len(self._buffer) < request.length):
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._request = request
            self._chunks = BodyFraming(None, True, True) if request.chunked else None
        request = self._request
        if self._chunks is not None:
            try:
                used = self._chunks.feed(bytes(self._buffer))
            except ValueError as exc:
                self._refuse(400, f"malformed chunked body: {exc}")
                return
            del self._buffer[:used]
            if len(self._chunks.payload) > _MAX_BODY_BYTES:
                self._refuse(413, f"request body over {_MAX_BODY_BYTES} bytes")
                return
            if not self._chunks.done:
                return
            request.body = bytes(self._chunks.payload)
        else:
            if len(self._buffer) < request.length:
                return
            request.body = bytes(self._buffer[: request.length])
            del self._buffer[: request.length]
        self._request = self._chunks = None
        self._busy = True
        self._close_after = not request.keep_alive
        self._head_request = request.method == b"HEAD"
        self._wrote = False
        self.proxy.spawn(self._answer(request))

    async def _answer(self, request: Request) -> None:
        try:
            await self.proxy.dispatch(request, self)
        except Exception:
            log.exception("proxy failed on %s %s", request.method, request.target)
            self._close_after = True
            if not self._wrote:
                self.respond(500, error_body("proxy error (see its log)", 500))
        self._busy = False
        if self.gone:
            return
        assert self.transport is not None
        if self._close_after:
            self.transport.close()
        elif self._buffer:
            self._next_request()

    def _refuse(self, status: int, message: str) -> None:
        self._busy = self._close_after = True  # nothing more is read from this client
        self.respond(status, error_body(message, status))
        assert self.transport is not None
        self.transport.close()

    def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        extra: Sequence[bytes] = (),
    ) -> None:
        """A response of the proxy's own."""
        if self.gone or self.transport is None:
            return
        self._wrote = True
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
        parts.append(b"Content-Type: %s\r\nContent-Length: %d\r\n" % (content_type, len(body)))
        parts += [line + b"\r\n" for line in extra]
        if self._close_after:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        if not self._head_request:
            parts.append(body)
        self.transport.write(b"".join(parts))

    def respond_error(self, message: str, status: int) -> None:
        self.respond(status, error_body(message, status))

    async def forward(
        self, upstream: Upstream, request: Request, method: bytes, target: bytes, lines: Any
    ) -> None:
        """Send a request upstream and relay its response; ``url`` names it in errors."""
        if self.gone:
            return
        url = upstream.url + target.decode("latin-1")
        raw = upstream.request_bytes(method, target, lines, request.body, request.http10)
        try:
            exchange = await upstream.send(raw, head_only=method == b"HEAD", fresh=request.http10)
        except (OSError, ValueError) as exc:
            self.respond_error(f"upstream {url} unreachable: {_describe(exc)}", 502)
            return
        await self._relay(exchange, url)

    async def _relay(self, exchange: _Exchange, url: str) -> None:
        """Write the response head and body to the client as they arrive (the head with the
        first body bytes), then, if the upstream failed mid-way, end or cut the response."""
        if self.gone:
            exchange.connection.close()
            return
        assert self.transport is not None and exchange.body is not None
        transport, body = self.transport, exchange.body
        self._wrote = True  # or will have, once the first body bytes come
        if body.remaining is None and not body.chunked:
            self._close_after = True  # the body ends when the connection does
        parts = [exchange.start_line]
        for line in exchange.lines:
            if line.partition(b":")[0].lower() not in _RESPONSE_DROP:
                parts += (b"\r\n", line)
        if self._close_after:
            parts.append(b"\r\nConnection: close")
        parts.append(b"\r\n\r\n")
        with_body = bool(exchange.pending)
        parts += exchange.pending
        exchange.pending.clear()
        head = b"".join(parts)
        write = transport.write  # one bound method, so that ``sink is write`` can tell
        if with_body or exchange.finished:
            write(head)  # with the body bytes that came with the head
            exchange.sink = write
        else:

            def first(data: bytes) -> None:
                write(head + data)  # the head leaves with the first body bytes
                exchange.sink = write

            exchange.sink = first
        if not exchange.finished:
            self._relaying = exchange.connection
            try:
                await exchange.end()
            finally:
                self._relaying = None
        if exchange.sink is not write:
            write(head)  # no body bytes came
            exchange.sink = write
        if exchange.error is not None and not self.gone:
            self._failed_mid_response(exchange, url)

    def _failed_mid_response(self, exchange: _Exchange, url: str) -> None:
        assert self.transport is not None and exchange.body is not None
        body = exchange.body
        message = f"upstream {url} failed mid-response: {_describe(exchange.error)}"
        log.warning("%s", message)
        event = b"data: " + error_body(message, 502) + b"\n\ndata: [DONE]\n\n"
        if exchange.sse and body.at_event_end and body.chunked:
            self.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            return
        if exchange.sse and body.at_event_end and body.remaining is None:
            self.transport.write(event)  # the connection's end ends this body
        self._close_after = True  # otherwise the client sees the body cut


class Proxy:
    """The shared parts: the upstream pools, ``/health``, the client connections."""

    kind = ""

    def __init__(self, upstreams: Sequence[str]):
        self.upstreams = list(upstreams)
        self.pools: dict[str, Upstream] = {}
        self.clients: set[_ClientConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def pool(self, url: str) -> Upstream:
        upstream = self.pools.get(url)
        if upstream is None:
            upstream = self.pools[url] = Upstream(url)
        return upstream

    def spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        """What runs once the proxy listens."""

    def stop(self) -> None:
        for client in list(self.clients):
            if client.transport is not None:
                client.transport.close()
        for task in list(self._tasks):
            task.cancel()
        for upstream in self.pools.values():
            upstream.close()

    async def dispatch(self, request: Request, client: _ClientConnection) -> None:
        if request.path == b"/health" and request.method in (b"GET", b"HEAD"):
            await self.health(request, client)
        else:
            await self.handle(request, client)

    async def handle(self, request: Request, client: _ClientConnection) -> None:
        raise NotImplementedError

    async def ready_problems(self) -> dict[str, str]:
        """What keeps the proxy from being ready, by name (empty: ready)."""
        states = await asyncio.gather(*(self._upstream_state(url) for url in self.upstreams))
        return {url: state for url, state in zip(self.upstreams, states, strict=True) if state}

    async def _upstream_state(self, url: str) -> str:
        try:
            upstream = self.pool(url)
            fetch = upstream.fetch(upstream.request_bytes(b"GET", b"/health", (), b""))
            status, _ = await asyncio.wait_for(fetch, _HEALTH_TIMEOUT_S)
        except (OSError, ValueError) as exc:  # TimeoutError is an OSError
            return f"unreachable: {_describe(exc)}"
        return "" if status == 200 else f"HTTP {status}"

    async def health(self, request: Request, client: _ClientConnection) -> None:
        problems = await self.ready_problems()
        body = {
            "proxy": self.kind,
            "status": "unhealthy" if problems else "ok",
            "upstreams": {url: problems.get(url, "ok") for url in self.upstreams},
            **{name: why for name, why in problems.items() if name not in self.upstreams},
        }
        client.respond(
            503 if problems else 200,
            json.dumps(body).encode(),
            b"application/json; charset=utf-8",
        )

    def inference_only(self, request: Request, client: _ClientConnection) -> bool:
        """Whether ``request`` is a POST to an inference path; else answer 404 or 405."""
        if request.path not in _INFERENCE_PATHS:
            client.respond(404, b"404: Not Found", b"text/plain; charset=utf-8")
            return False
        if request.method != b"POST":
            message = b"405: Method Not Allowed"
            client.respond(405, message, b"text/plain; charset=utf-8", [b"Allow: POST"])
            return False
        return True


class RoundRobinProxy(Proxy):
    """Strict cycle over the upstreams (see the module docstring)."""

    kind = "round-robin"

    def __init__(self, upstreams: Sequence[str]):
        super().__init__(upstreams)
        self._cycle = itertools.cycle(self.upstreams)

    async def handle(self, request: Request, client: _ClientConnection) -> None:
        base = next(self._cycle) if request.method == b"POST" else self.upstreams[0]
        await client.forward(
            self.pool(base), request, request.method, request.target, request.forward
        )


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


def _prefill_members(raw: bytes) -> dict[str, Any]:
    """``max_tokens`` 1 for the prefill copy (and ``max_completion_tokens``, if sent)."""
    members: dict[str, Any] = {"max_tokens": 1}
    if b'"max_completion_tokens"' in raw:
        members["max_completion_tokens"] = 1
    return members


class DisaggV0Proxy(Proxy):
    """Prefill (``max_tokens`` 1, awaited), then decode, per request."""

    kind = "disagg-v0"

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]):
        super().__init__([*prefill, *decode])
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)

    async def handle(self, request: Request, client: _ClientConnection) -> None:
        if not self.inference_only(request, client):
            return
        prefill, decode = next(self._prefill), next(self._decode)
        lines = [line for line in request.forward if line[:13].lower() != b"content-type:"]
        lines.append(b"Content-Type: application/json")
        raw = request.body
        try:
            copy = with_members(raw, _prefill_members(raw))
            await self._prefill_request(self.pool(prefill), request.path, lines, copy)
        except UpstreamError as exc:
            log.warning("%s", exc)
            client.respond_error(str(exc), exc.status)
            return
        await client.forward(self.pool(decode), request, b"POST", request.path, lines)

    async def _prefill_request(
        self, upstream: Upstream, path: bytes, lines: Sequence[bytes], body: bytes
    ) -> None:
        """Send the prefill copy and drain it; raise ``UpstreamError`` if it did not succeed
        (an error status, an error event in its stream, or no answer)."""
        url = upstream.url + path.decode("latin-1")
        try:
            status, answer = await upstream.fetch(
                upstream.request_bytes(b"POST", path, lines, body)
            )
        except (OSError, ValueError) as exc:
            raise UpstreamError(f"prefill instance {url} failed: {_describe(exc)}") from None
        if status != 200:
            # A client error (e.g. a prompt too long) keeps its status; anything else is 502.
            raise UpstreamError(
                f"prefill instance {url} answered HTTP {status}: "
                f"{answer[:500].decode(errors='replace')}",
                status if 400 <= status < 500 else 502,
            )
        if b'data: {"error"' in answer:
            start = answer.index(b'data: {"error"')
            event = answer[start : answer.find(b"\n", start)]
            raise UpstreamError(
                f"prefill instance {url} streamed an error: {event[:500].decode(errors='replace')}"
            )


class DisaggV1Proxy(Proxy):
    """vLLM 0.33's Mooncake proxy: engine id from bootstrap ``/query``, prefill fire-and-forget,
    decode streamed at once."""

    kind = "disagg-v1"

    def __init__(self, prefill: Sequence[tuple[str, int]], decode: Sequence[str]):
        super().__init__([url for url, _ in prefill] + list(decode))
        self.prefillers = [
            {"url": url, "bootstrap_addr": f"http://{urlsplit(url).hostname}:{port}"}
            for url, port in prefill
        ]
        self._engine_ids: dict[str, dict[int, str]] = {}  # prefill url -> dp rank -> engine id
        self._prefill_cycle: Any = None
        self._decode = itertools.cycle(decode)

    async def start(self) -> None:
        self.spawn(self._learn_engine_ids())

    async def _learn_engine_ids(self) -> None:
        """Wait for each prefiller's ``/health``, then read its engine ids per data-parallel
        rank from its bootstrap server's ``/query``, retrying until both answer."""
        for prefiller in self.prefillers:
            url = prefiller["url"]
            while True:
                try:
                    if await self._upstream_state(url):
                        raise ValueError("not healthy yet")
                    bootstrap = self.pool(prefiller["bootstrap_addr"])
                    query = bootstrap.request_bytes(b"GET", b"/query", (), b"")
                    status, raw = await bootstrap.fetch(query)
                    if status != 200:
                        raise ValueError(f"HTTP {status}")
                    data = json.loads(raw)
                    self._engine_ids[url] = {
                        int(rank): entry["engine_id"] for rank, entry in data.items()
                    }
                    if self._engine_ids[url]:
                        break
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    pass
                await asyncio.sleep(0.2)
            log.info("prefiller %s: engine ids %s", url, self._engine_ids[url])
        self._prefill_cycle = itertools.cycle(
            [(p, rank) for p in self.prefillers for rank in sorted(self._engine_ids[p["url"]])]
        )

    async def ready_problems(self) -> dict[str, str]:
        problems = await super().ready_problems()
        if self._prefill_cycle is None:
            problems["bootstrap"] = "prefill engine ids not known yet (bootstrap /query)"
        return problems

    async def handle(self, request: Request, client: _ClientConnection) -> None:
        if not self.inference_only(request, client):
            return
        if self._prefill_cycle is None:
            message = "Service Unavailable: prefill engine ids not known yet"
            client.respond_error(message, 503)
            return
        raw = request.body
        prefiller, rank = next(self._prefill_cycle)
        decode = next(self._decode)
        request_id = request.header(b"x-request-id") or str(uuid.uuid4())
        transfer_id = f"xfer-{uuid.uuid4()}"
        lines = [b"Content-Type: application/json", b"X-Request-Id: " + request_id.encode()]
        auth = request.header(b"authorization") or (
            f"Bearer {os.environ['OPENAI_API_KEY']}" if "OPENAI_API_KEY" in os.environ else None
        )
        if auth:
            lines.append(b"Authorization: " + auth.encode("latin-1"))
        prefill_members = {
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            },
            "stream": False,
            **_prefill_members(raw),
        }
        if b'"stream_options"' in raw:
            prefill_members["stream_options"] = None  # vLLM's proxy deletes it: same meaning
        decode_members = {
            "kv_transfer_params": {
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "remote_bootstrap_addr": prefiller["bootstrap_addr"],
                "remote_engine_id": self._engine_ids[prefiller["url"]][rank],
                "transfer_id": transfer_id,
            },
        }
        try:
            prefill_body = with_members(raw, prefill_members)
            request.body = with_members(raw, decode_members)
        except UpstreamError as exc:
            client.respond_error(str(exc), exc.status)
            return
        prefill_lines = [*lines, b"X-data-parallel-rank: %d" % rank]
        upstream = self.pool(prefiller["url"])
        prefill = upstream.request_bytes(b"POST", request.path, prefill_lines, prefill_body)
        # The prefill goes out first, as from vLLM's proxy: at once on a pooled connection,
        # else its task starts connecting before the decode request is sent.
        begun = upstream.begin(prefill, keep_payload=True)
        self.spawn(self._prefill_request(upstream, request.path, prefill, begun, request_id))
        if begun is None:
            await asyncio.sleep(0)
        await client.forward(self.pool(decode), request, b"POST", request.path, lines)

    async def _prefill_request(
        self,
        upstream: Upstream,
        path: bytes,
        request: bytes,
        begun: _Exchange | None,
        request_id: str,
    ) -> None:
        url = upstream.url + path.decode("latin-1")
        try:
            status, answer = await upstream.fetch(request, begun)
        except (OSError, ValueError) as exc:
            log.warning("prefill %s for %s failed: %s", url, request_id, _describe(exc))
            return
        if status != 200:
            log.warning(
                "prefill %s for %s answered HTTP %d: %s",
                url,
                request_id,
                status,
                answer[:500].decode(errors="replace"),
            )


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http://HOST:PORT URL")
    return text.rstrip("/")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m servematrix.proxy", description=__doc__)
    top.formatter_class = argparse.RawDescriptionHelpFormatter
    kinds = top.add_subparsers(dest="kind", required=True)
    rr = kinds.add_parser("round-robin", help="strict cycle over the upstreams")
    rr.add_argument("--upstream", action="append", type=_url, required=True, metavar="URL")
    v0 = kinds.add_parser("disagg-v0", help="prefill (max_tokens 1, awaited), then decode")
    v0.add_argument("--prefill", action="append", type=_url, required=True, metavar="URL")
    v0.add_argument("--decode", action="append", type=_url, required=True, metavar="URL")
    v1 = kinds.add_parser("disagg-v1", help="vLLM 0.33's Mooncake proxy")
    v1.add_argument(
        "--prefill",
        action="append",
        nargs=2,
        required=True,
        metavar=("URL", "BOOTSTRAP_PORT"),
    )
    v1.add_argument("--decode", action="append", type=_url, required=True, metavar="URL")
    for sub in (rr, v0, v1):
        sub.add_argument("--port", type=int, required=True)
        sub.add_argument("--host", default="127.0.0.1")
    return top


def build(args: argparse.Namespace) -> Proxy:
    """The proxy the parsed command line asks for."""
    if args.kind == "round-robin":
        return RoundRobinProxy(args.upstream)
    if args.kind == "disagg-v0":
        return DisaggV0Proxy(args.prefill, args.decode)
    prefill = []
    for url, port in args.prefill:
        try:
            prefill.append((_url(url), int(port)))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise SystemExit(f"proxy: --prefill {url} {port}: {exc}") from None
    return DisaggV1Proxy(prefill, args.decode)


async def serve(proxy: Proxy, host: str, port: int) -> None:
    """Listen until SIGTERM or SIGINT; then close every connection. Raises ``OSError`` if the
    address cannot be bound."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(lambda: _ClientConnection(proxy), host, port)
    await proxy.start()
    try:
        await stop.wait()
    finally:
        server.close()
        proxy.stop()
        await asyncio.sleep(0)  # let the transports' close callbacks run


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy %(levelname)s %(message)s")
    proxy = build(args)
    try:
        import uvloop  # a C event loop: ~0.1 ms less per hop than asyncio's own

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    print(
        f"servematrix proxy {proxy.kind} on http://{args.host}:{args.port} -> "
        f"{' '.join(proxy.upstreams)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        asyncio.run(serve(proxy, args.host, args.port))
    except OSError as exc:
        print(f"proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
