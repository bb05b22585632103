"""Pooled keep-alive connections to one upstream, relaying its response as it arrives."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from servematrix.proxy.http import CONNECT_TIMEOUT_S, ResponseReader, set_nodelay


class Exchange:
    """One request and its response on an upstream connection. The response's body bytes, as
    the client gets them (:class:`ResponseReader`), go to ``sink`` as they arrive, or wait in
    ``pending`` until one is set."""

    def __init__(self, connection: UpstreamConnection, keep_payload: bool, head_only: bool):
        self.connection = connection
        self.response = ResponseReader(head_only, keep_payload)
        self.pending: list[bytes] = []
        self.sink: Callable[[bytes], Any] | None = None
        self.error: Exception | None = None
        self.finished = False
        self.received = False  # any response byte yet
        self._head_waiter = asyncio.get_running_loop().create_future()
        self._end_waiter: asyncio.Future[None] | None = None

    @property
    def sse(self) -> bool:
        media = self.response.fields.get(b"content-type", b"").split(b";", 1)[0]
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


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to an upstream, one exchange at a time."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.reusable = True
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        set_nodelay(transport)
        self.upstream.connections.add(self)

    def start(self, request: bytes, keep_payload: bool, head_only: bool) -> Exchange:
        assert self.transport is not None and self.exchange is None
        self.exchange = Exchange(self, keep_payload, head_only)
        self.transport.write(request)
        return self.exchange

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # nothing was asked: the connection is out of step
            self._abandon()
            return
        exchange.received = True
        response = exchange.response
        data = response.feed(data)
        if response.head_done:
            exchange.head_arrived()
        if data:
            if exchange.sink is not None:
                exchange.sink(data)
            else:
                exchange.pending.append(data)
        if response.error is not None:
            self._abandon(response.error)
        elif response.done:
            if response.extra or not response.keep_alive:
                self.reusable = False
            self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        exchange, self.exchange = self.exchange, None
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
        response = exchange.response
        if response.until_close:
            self._finish(None)  # a body delimited by the connection's end: complete
        elif not response.head_done:
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
        self.idle: list[UpstreamConnection] = []
        self.connections: set[UpstreamConnection] = set()

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if self.tls else None
        connect = loop.create_connection(
            lambda: UpstreamConnection(self), self.host, self.port, ssl=context
        )
        _, connection = await asyncio.wait_for(connect, CONNECT_TIMEOUT_S)
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
    ) -> Exchange | None:
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
        begun: Exchange | None = None,
    ) -> Exchange:
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

    async def fetch(self, request: bytes, begun: Exchange | None = None) -> tuple[int, bytes]:
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
        return exchange.response.status, bytes(exchange.response.payload)

    def close(self) -> None:
        for connection in list(self.connections):
            connection.close()
