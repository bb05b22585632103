"""The relay: client connections read one request at a time and answered by a policy."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, cast

from servematrix.proxy.http import (
    HEALTH_TIMEOUT_S,
    INFERENCE_PATHS,
    ClientRequest,
    RequestReader,
    describe,
    error_body,
    log,
    set_nodelay,
)
from servematrix.proxy.upstream import Exchange, Upstream, UpstreamConnection


class ClientConnection(asyncio.Protocol):
    """One client's connection: its requests one at a time, each answered by ``proxy``."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.gone = False
        self._requests = RequestReader()
        self._busy = False  # a request is being answered
        self._close_after = False
        self._head_request = False  # the request being answered is a HEAD: no body goes back
        self._wrote = False  # any byte of its answer has gone out
        self._relaying: UpstreamConnection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        set_nodelay(transport)
        self.proxy.clients.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.proxy.clients.discard(self)
        if self._relaying is not None:
            self._relaying.close()  # the server aborts the request, as without the proxy

    def data_received(self, data: bytes) -> None:
        self._requests.feed(data)
        self._next_request()

    def pause_writing(self) -> None:
        if self._relaying is not None and self._relaying.transport is not None:
            self._relaying.transport.pause_reading()

    def resume_writing(self) -> None:
        if self._relaying is not None and self._relaying.transport is not None:
            self._relaying.transport.resume_reading()

    def _next_request(self) -> None:
        """Answer the next complete request, if none is being answered; else refuse a malformed
        one, or let a client that waits for ``100 Continue`` send its body."""
        if self._busy or self.gone:
            return
        assert self.transport is not None
        requests = self._requests
        if requests.ready:
            request = requests.ready.popleft()
            self._busy = True
            self._close_after = not request.keep_alive
            self._head_request = request.method == b"HEAD"
            self._wrote = False
            self.proxy.spawn(self._answer(request))
        elif requests.refusal is not None:
            status, reason = requests.refusal
            peer = self.transport.get_extra_info("peername")
            log.warning("refused a request from %s: HTTP %d, %s", peer, status, reason)
            self._refuse(status, reason)
        elif requests.awaits_continue:
            requests.continued = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _answer(self, request: ClientRequest) -> None:
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
        else:
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
        self, upstream: Upstream, request: ClientRequest, method: bytes, target: bytes, lines: Any
    ) -> None:
        """Send a request upstream and relay its response; ``url`` names it in errors."""
        if self.gone:
            return
        url = upstream.url + target.decode("latin-1")
        raw = upstream.request_bytes(method, target, lines, request.body, request.http10)
        try:
            exchange = await upstream.send(raw, head_only=method == b"HEAD", fresh=request.http10)
        except (OSError, ValueError) as exc:
            self.respond_error(f"upstream {url} unreachable: {describe(exc)}", 502)
            return
        await self._relay(exchange, url)

    async def _relay(self, exchange: Exchange, url: str) -> None:
        """Write the response head and body to the client as they arrive (the head with the
        first body bytes), then, if the upstream failed mid-way, end or cut the response."""
        if self.gone:
            exchange.connection.close()
            return
        assert self.transport is not None
        transport, response = self.transport, exchange.response
        self._wrote = True  # or will have, once the first body bytes come
        if response.until_close:
            self._close_after = True  # the body ends when the connection does
        parts = [response.start_line]
        for line in response.lines:
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

    def _failed_mid_response(self, exchange: Exchange, url: str) -> None:
        assert self.transport is not None
        response = exchange.response
        message = f"upstream {url} failed mid-response: {describe(exchange.error)}"
        log.warning("%s", message)
        event = b"data: " + error_body(message, 502) + b"\n\ndata: [DONE]\n\n"
        if exchange.sse and response.at_event_end and response.chunked:
            self.transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            return
        if exchange.sse and response.at_event_end and response.until_close:
            self.transport.write(event)  # the connection's end ends this body
        self._close_after = True  # otherwise the client sees the body cut


class Proxy:
    """The shared parts: the upstream pools, ``/health``, the client connections."""

    kind = ""

    def __init__(self, upstreams: Sequence[str]):
        self.upstreams = list(upstreams)
        self.pools: dict[str, Upstream] = {}
        self.clients: set[ClientConnection] = set()
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

    async def dispatch(self, request: ClientRequest, client: ClientConnection) -> None:
        if request.path == b"/health" and request.method in (b"GET", b"HEAD"):
            await self.health(request, client)
        else:
            await self.handle(request, client)

    async def handle(self, request: ClientRequest, client: ClientConnection) -> None:
        raise NotImplementedError

    async def ready_problems(self) -> dict[str, str]:
        """What keeps the proxy from being ready, by name (empty: ready)."""
        states = await asyncio.gather(*(self._upstream_state(url) for url in self.upstreams))
        return {url: state for url, state in zip(self.upstreams, states, strict=True) if state}

    async def _upstream_state(self, url: str) -> str:
        try:
            upstream = self.pool(url)
            fetch = upstream.fetch(upstream.request_bytes(b"GET", b"/health", (), b""))
            status, _ = await asyncio.wait_for(fetch, HEALTH_TIMEOUT_S)
        except (OSError, ValueError) as exc:  # TimeoutError is an OSError
            return f"unreachable: {describe(exc)}"
        return "" if status == 200 else f"HTTP {status}"

    async def health(self, request: ClientRequest, client: ClientConnection) -> None:
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

    def inference_only(self, request: ClientRequest, client: ClientConnection) -> bool:
        """Whether ``request`` is a POST to an inference path; else answer 404 or 405."""
        if request.path not in INFERENCE_PATHS:
            client.respond(404, b"404: Not Found", b"text/plain; charset=utf-8")
            return False
        if request.method != b"POST":
            message = b"405: Method Not Allowed"
            client.respond(405, message, b"text/plain; charset=utf-8", [b"Allow: POST"])
            return False
        return True


async def serve(proxy: Proxy, host: str, port: int) -> None:
    """Listen until SIGTERM or SIGINT; then close every connection. Raises ``OSError`` if the
    address cannot be bound."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(lambda: ClientConnection(proxy), host, port)
    await proxy.start()
    try:
        await stop.wait()
    finally:
        server.close()
        proxy.stop()
        await asyncio.sleep(0)  # let the transports' close callbacks run
