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

All proxies share one pooled upstream client (keep-alive connections, no connection limit, no
total timeout, no decompression), so a request costs no connection set-up. If an upstream dies
in the middle of a streamed (SSE) response, the client gets one ``data: {"error": ...}`` event
naming the upstream, then ``data: [DONE]`` (vLLM's own shape for errors after the 200 header);
mid-way through any other body, the connection is cut. A client that goes away closes the
upstream response, so the server aborts the request as it would without the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

log = logging.getLogger("servematrix.proxy")

# Per-connection headers (RFC 9110 §7.6.1) and those the client library sets itself.
_REQUEST_DROP = frozenset(
    h.lower()
    for h in ("Host", "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "TE")
)
_RESPONSE_DROP = frozenset(
    h.lower() for h in ("Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive")
)
_INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
_HEALTH_TIMEOUT_S = 5.0


class UpstreamError(Exception):
    """An upstream failed before its response could be relayed; ``status`` is for the client."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


def error_body(message: str, status: int) -> bytes:
    """vLLM 0.33's error object (wire reference §4), for errors the proxy itself reports."""
    error = {"message": message, "type": "ProxyError", "param": None, "code": status}
    return json.dumps({"error": error}).encode()


def _error_response(message: str, status: int) -> web.Response:
    return web.Response(
        status=status, body=error_body(message, status), content_type="application/json"
    )


class _HeadersWithFirstChunk(web.StreamResponse):
    """A streamed response whose status line and headers leave with its first body chunk, in
    one write: one send fewer on the path to the first token (about 0.1 ms per request). It
    sets the flag ``web.Response`` sets; should aiohttp drop it, headers go out on their own."""

    _send_headers_immediately = False


class Proxy:
    """The shared parts: the pooled client, ``/health`` and the streaming relay."""

    kind = ""

    def __init__(self, upstreams: Sequence[str]):
        self.upstreams = list(upstreams)
        self.session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.router.add_get("/health", self.health)
        self.add_routes(app)
        return app

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def _stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def ready_problems(self) -> dict[str, str]:
        """What keeps the proxy from being ready, by name (empty: ready)."""
        states = await asyncio.gather(*(self._upstream_state(url) for url in self.upstreams))
        return {url: state for url, state in zip(self.upstreams, states, strict=True) if state}

    async def _upstream_state(self, url: str) -> str:
        assert self.session is not None
        try:
            async with self.session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=_HEALTH_TIMEOUT_S)
            ) as response:
                await response.read()
                return "" if response.status == 200 else f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"unreachable: {type(exc).__name__}: {exc}"

    async def health(self, request: web.Request) -> web.Response:
        problems = await self.ready_problems()
        body = {
            "proxy": self.kind,
            "status": "unhealthy" if problems else "ok",
            "upstreams": {url: problems.get(url, "ok") for url in self.upstreams},
            **{name: why for name, why in problems.items() if name not in self.upstreams},
        }
        return web.json_response(body, status=503 if problems else 200)

    async def relay(
        self,
        request: web.Request,
        method: str,
        url: str,
        headers: Any,
        body: bytes,
    ) -> web.StreamResponse:
        """Send one request upstream and stream its answer back to ``request``'s client."""
        assert self.session is not None
        try:
            upstream = await self.session.request(method, url, headers=headers, data=body)
        except aiohttp.ClientError as exc:
            return _error_response(f"upstream {url} unreachable: {exc}", 502)
        try:
            response = _HeadersWithFirstChunk(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _RESPONSE_DROP:
                    response.headers.add(name, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            sse = upstream.content_type == "text/event-stream"
            at_boundary = True
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    message = f"upstream {url} failed mid-response: {type(exc).__name__}: {exc}"
                    log.warning("%s", message)
                    if not (sse and at_boundary):
                        raise  # cut the connection: the client sees a truncated body
                    event = b"data: " + error_body(message, 502) + b"\n\ndata: [DONE]\n\n"
                    await response.write(event)
                    break
                if not chunk:
                    break
                try:
                    await response.write(chunk)
                except ConnectionResetError:
                    # The client went away. Closing the unfinished upstream response (below)
                    # tells the server, which aborts the request, as it would without a proxy.
                    upstream.close()
                    return response
                at_boundary = chunk.endswith(b"\n\n")
            await response.write_eof()
            return response
        finally:
            upstream.release()


def forward_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_DROP}


class RoundRobinProxy(Proxy):
    """Strict cycle over the upstreams (see the module docstring)."""

    kind = "round-robin"

    def __init__(self, upstreams: Sequence[str]):
        super().__init__(upstreams)
        self._cycle = itertools.cycle(self.upstreams)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{path:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        base = next(self._cycle) if request.method == "POST" else self.upstreams[0]
        body = await request.read()
        return await self.relay(
            request, request.method, base + request.path_qs, forward_headers(request), body
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

    def add_routes(self, app: web.Application) -> None:
        for path in _INFERENCE_PATHS:
            app.router.add_post(path, self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        prefill, decode = next(self._prefill), next(self._decode)
        headers = forward_headers(request)
        raw = await request.read()
        try:
            copy = with_members(raw, _prefill_members(raw))
            headers["Content-Type"] = "application/json"
            await self._prefill_request(prefill + request.path, headers, copy)
        except UpstreamError as exc:
            log.warning("%s", exc)
            return _error_response(str(exc), exc.status)
        return await self.relay(request, "POST", decode + request.path, headers, raw)

    async def _prefill_request(self, url: str, headers: dict[str, str], body: bytes) -> None:
        """Send the prefill copy and drain it; raise ``UpstreamError`` if it did not succeed
        (an error status, an error event in its stream, or no answer)."""
        assert self.session is not None
        try:
            async with self.session.post(url, headers=headers, data=body) as response:
                answer = await response.read()
        except aiohttp.ClientError as exc:
            raise UpstreamError(
                f"prefill instance {url} failed: {type(exc).__name__}: {exc}"
            ) from None
        if response.status != 200:
            # A client error (e.g. a prompt too long) keeps its status; anything else is 502.
            status = response.status if 400 <= response.status < 500 else 502
            raise UpstreamError(
                f"prefill instance {url} answered HTTP {response.status}: "
                f"{answer[:500].decode(errors='replace')}",
                status,
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
        self._tasks: set[asyncio.Task[None]] = set()

    def add_routes(self, app: web.Application) -> None:
        for path in _INFERENCE_PATHS:
            app.router.add_post(path, self.handle)

    async def _start(self, app: web.Application) -> None:
        await super()._start(app)
        self._spawn(self._learn_engine_ids())

    async def _stop(self, app: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()
        await super()._stop(app)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _learn_engine_ids(self) -> None:
        """Wait for each prefiller's ``/health``, then read its engine ids per data-parallel
        rank from its bootstrap server's ``/query``, retrying until both answer."""
        assert self.session is not None
        for prefiller in self.prefillers:
            url = prefiller["url"]
            while True:
                try:
                    if await self._upstream_state(url):
                        raise aiohttp.ClientError("not healthy yet")
                    async with self.session.get(prefiller["bootstrap_addr"] + "/query") as r:
                        r.raise_for_status()
                        data = await r.json(content_type=None)
                    self._engine_ids[url] = {
                        int(rank): entry["engine_id"] for rank, entry in data.items()
                    }
                    if self._engine_ids[url]:
                        break
                except (aiohttp.ClientError, ValueError, KeyError, TypeError, AttributeError):
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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._prefill_cycle is None:
            return _error_response("Service Unavailable: prefill engine ids not known yet", 503)
        raw = await request.read()
        prefiller, rank = next(self._prefill_cycle)
        decode = next(self._decode)
        request_id = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        transfer_id = f"xfer-{uuid.uuid4()}"
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        auth = request.headers.get("Authorization") or (
            f"Bearer {os.environ['OPENAI_API_KEY']}" if "OPENAI_API_KEY" in os.environ else None
        )
        if auth:
            headers["Authorization"] = auth
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
            decode_body = with_members(raw, decode_members)
        except UpstreamError as exc:
            return _error_response(str(exc), exc.status)
        self._spawn(
            self._prefill_request(
                prefiller["url"] + request.path,
                {**headers, "X-data-parallel-rank": str(rank)},
                prefill_body,
            )
        )
        await asyncio.sleep(0)  # the prefill goes out first, as from vLLM's proxy
        return await self.relay(request, "POST", decode + request.path, headers, decode_body)

    async def _prefill_request(self, url: str, headers: dict[str, str], body: bytes) -> None:
        assert self.session is not None
        try:
            async with self.session.post(url, headers=headers, data=body) as response:
                answer = await response.read()
            if response.status != 200:
                log.warning(
                    "prefill %s for %s answered HTTP %d: %s",
                    url,
                    headers["X-Request-Id"],
                    response.status,
                    answer[:500].decode(errors="replace"),
                )
        except aiohttp.ClientError as exc:
            log.warning("prefill %s for %s failed: %s", url, headers["X-Request-Id"], exc)


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


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy %(levelname)s %(message)s")
    proxy = build(args)
    try:
        import uvloop  # about 0.1 ms less per hop than asyncio's own loop

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
        web.run_app(proxy.app(), host=args.host, port=args.port, access_log=None, print=None)
    except OSError as exc:
        print(f"proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
