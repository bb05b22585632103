"""``disagg-v0``: vLLM 0.6's ``disagg_prefill_proxy_server.py``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from servematrix.proxy.http import (
    ClientRequest,
    UpstreamError,
    describe,
    log,
    prefill_members,
    with_members,
)
from servematrix.proxy.relay import ClientConnection, Proxy
from servematrix.proxy.upstream import Upstream


class DisaggV0Proxy(Proxy):
    """Prefill (``max_tokens`` 1, awaited), then decode, per request."""

    kind = "disagg-v0"

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]):
        super().__init__([*prefill, *decode])
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)

    async def handle(self, request: ClientRequest, client: ClientConnection) -> None:
        if not self.inference_only(request, client):
            return
        prefill, decode = next(self._prefill), next(self._decode)
        lines = [line for line in request.forward if line[:13].lower() != b"content-type:"]
        lines.append(b"Content-Type: application/json")
        raw = request.body
        try:
            copy = with_members(raw, prefill_members(raw))
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
            raise UpstreamError(f"prefill instance {url} failed: {describe(exc)}") from None
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
