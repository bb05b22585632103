"""What every emulated KV connector role shares (`servematrix.emulator.disagg` describes the
roles): the modelled link paced by the wall clock, the connector's hooks around the engine,
and the errors and names they report."""

from __future__ import annotations

import array
import asyncio
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Mapping
from math import inf
from typing import Any

import aiohttp
from aiohttp import web

from servematrix.emulator.pacing import TokenStream, WallClockEngine
from servematrix.engine.transfer import KvLink, TransferLink

DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_ABORT_TIMEOUT_S = 480.0
"""``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``: how long a producer keeps KV nobody pulled, and so
how long a pull may wait for its prefill."""
ETCD_RETRY_S = 10.0
KV_LINK_ENV = "SERVEMATRIX_EMULATOR_KV_LINK"
DEFAULT_KV_BUFFER_BYTES = 1e9
"""vLLM 0.6's ``KVTransferConfig.kv_buffer_size`` default (the recipe passes 2e9)."""


def say(message: str) -> None:
    print(f"servematrix-emulator: {message}", file=sys.stderr, flush=True)


class KvTransferError(Exception):
    """A KV transfer, or the connector's set-up, failed; the message names who and why."""


def reach(host: str | None) -> str:
    """The address a peer on this host uses for a server bound to ``host``."""
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::") else host


def prompt_key(prompt: Any) -> str:
    """The v0 lookup buffer's key: a digest of the prompt itself (``SimpleBuffer`` matches
    token ids). Token ids are packed, not JSON-encoded: 32k of them take ~1 ms, not ~15."""
    if isinstance(prompt, str):
        data = prompt.encode()
    else:
        try:
            data = array.array("q", prompt).tobytes()
        except (TypeError, OverflowError):
            data = json.dumps(prompt, separators=(",", ":")).encode()
    return hashlib.sha256(data).hexdigest()


class WallClockLink:
    """A :class:`TransferLink` paced by ``time.monotonic()``: ``transfer`` returns when the
    modelled transfer is over, with the modelled completion instant (timer lateness delays the
    wake-up, never the instant)."""

    def __init__(self, link: TransferLink):
        self.link = link
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future[float]] = {}
        self._timer: asyncio.TimerHandle | None = None

    async def transfer(self, nbytes: float) -> float:
        key = next(self._keys)
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        self.link.start(time.monotonic(), key, nbytes)
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        nxt = self.link.next_event_s()
        if nxt < inf:
            delay = max(nxt - time.monotonic(), 0.0)
            self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        for done_s, key in self.link.advance(time.monotonic()):
            future = self._waiting.pop(key)
            if not future.done():  # its request may have been cancelled meanwhile
                future.set_result(done_s)
        self._schedule()


class KvConnector:
    """One instance's side of the connector; see the module docstring."""

    def __init__(self, role: str, link: KvLink, bytes_per_token_per_rank: float):
        self.role = role
        self.link = link
        self.bytes_per_token_per_rank = bytes_per_token_per_rank
        self.session: aiohttp.ClientSession | None = None
        self.engine: WallClockEngine | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, engine: WallClockEngine) -> None:
        """The instance's engine (before :meth:`start`)."""
        self.engine = engine

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _listen(self, app: web.Application, host: str | None, port: int, what: str) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port).start()
        except OSError as error:
            raise KvTransferError(f"{what} cannot listen on port {port}: {error}") from None

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def before_submit(
        self, body: Mapping[str, Any], prompt_tokens: int, arrival_s: float, api_path_s: float
    ) -> tuple[float, dict[str, Any]]:
        """Consumer: get the request's KV; returns the instant it may join the engine and the
        engine ``Request`` fields that say how its prompt is covered. ``api_path_s`` is the
        modelled API path of a request that arrives with its KV (latency and serial work):
        a consumer whose KV covers the prompt waits it out on the request's way there."""
        return arrival_s, {}

    def submitted(self, body: Mapping[str, Any], stream: TokenStream) -> None:
        """Producer: a request is in the engine."""

    def failed(self, body: Mapping[str, Any] | None, message: str) -> None:
        """Producer: a request was refused before it reached the engine."""

    def _after_prefill(self, stream: TokenStream, then: Any) -> None:
        """Call ``then(stream)`` once the engine produced the first token (or gave up)."""

        async def wait() -> None:
            await stream.wait(0)
            then(stream)

        self._spawn(wait())
