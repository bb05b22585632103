"""``disagg-v1``: vLLM 0.33's ``mooncake_connector_proxy.py``."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from servematrix.proxy.http import (
    ClientRequest,
    UpstreamError,
    describe,
    log,
    prefill_members,
    with_members,
)
from servematrix.proxy.relay import ClientConnection, Proxy
from servematrix.proxy.upstream import Exchange, Upstream


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

    async def handle(self, request: ClientRequest, client: ClientConnection) -> None:
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
        prefill_copy = {
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "transfer_id": transfer_id,
            },
            "stream": False,
            **prefill_members(raw),
        }
        if b'"stream_options"' in raw:
            prefill_copy["stream_options"] = None  # vLLM's proxy deletes it: same meaning
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
            prefill_body = with_members(raw, prefill_copy)
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
        begun: Exchange | None,
        request_id: str,
    ) -> None:
        url = upstream.url + path.decode("latin-1")
        try:
            status, answer = await upstream.fetch(request, begun)
        except (OSError, ValueError) as exc:
            log.warning("prefill %s for %s failed: %s", url, request_id, describe(exc))
            return
        if status != 200:
            log.warning(
                "prefill %s for %s answered HTTP %d: %s",
                url,
                request_id,
                status,
                answer[:500].decode(errors="replace"),
            )
