"""The emulated vLLM 0.6 ``MooncakeConnector`` (V0: ``SimpleBuffer`` over ``MooncakePipe``;
`servematrix.emulator.disagg` describes its etcd registration, lookup buffer and receive)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from servematrix.emulator.kvconnector import (
    ETCD_RETRY_S,
    KvConnector,
    KvTransferError,
    prompt_key,
    say,
)
from servematrix.emulator.pacing import TokenStream, WallClockEngine
from servematrix.engine.instance import StepResult
from servematrix.engine.transfer import KvLink, LookupBuffer, v0_receive_segments


class MooncakeV0(KvConnector):
    def __init__(
        self,
        role: str,
        link: KvLink,
        bytes_per_token_per_rank: float,
        config: Mapping[str, Any],
        config_path: str,
        kv_buffer_bytes: float,
    ):
        super().__init__(role, link, bytes_per_token_per_rank)
        self.config = config
        self.config_path = config_path
        self.etcd = _etcd_url(str(config["metadata_server"]), config_path)
        self.own_url = str(config["prefill_url" if role == "kv_producer" else "decode_url"])
        # Producer: the lookup buffer, its entries by prompt (prompt tokens), and the prompt
        # of each prefill in the engine, by engine request id, until its step ends.
        self.lookup = LookupBuffer(kv_buffer_bytes)
        self.buffer: dict[str, deque[int]] = defaultdict(deque)
        self._prefills: dict[int, tuple[str, int]] = {}
        self._freed = asyncio.Event()
        self._producer: str | None = None
        # Consumer: (receive s, producer's share s, bytes per rank) of each request whose KV
        # it found, by body until it is submitted, then by engine request id until its step.
        self._found: dict[int, tuple[float, float, float]] = {}
        self._receives: dict[int, tuple[float, float, float]] = {}

    def attach(self, engine: WallClockEngine) -> None:
        super().attach(engine)
        if self.role == "kv_consumer":
            engine.receive_hook = self._receive_step
        else:
            engine.release_hook = self._insert_finished

    async def start(self) -> None:
        await super().start()
        host, port = _host_port(self.own_url, self.config_path)
        if self.role == "kv_producer":
            app = web.Application(client_max_size=1 << 30)
            app.router.add_post("/servematrix/drop_select", self._drop_select)
            app.router.add_post("/servematrix/copy_chain", self._copy_chain)
            app.router.add_post("/servematrix/release", self._release)
            await self._listen(app, host, port, "the Mooncake transfer engine (prefill_url)")
        segment = {
            "name": self.own_url,
            "protocol": self.config.get("protocol", "tcp"),
            "devices": [],
            "buffers": [],
            "priority_matrix": {},
        }
        await self._etcd_put(f"mooncake/ram/{self.own_url}", segment)
        await self._etcd_put(
            f"mooncake/rpc_meta/{self.own_url}", {"ip_or_host_name": host, "rpc_port": port}
        )
        say(f"Mooncake segment {self.own_url} registered at etcd {self.etcd}")

    async def _etcd_put(self, key: str, value: Mapping[str, Any]) -> None:
        """Put one key through etcd's v3 JSON gateway, retrying while etcd is starting."""
        assert self.session is not None
        body = {"key": _b64(key), "value": _b64(json.dumps(value))}
        deadline = time.monotonic() + ETCD_RETRY_S
        while True:
            try:
                async with self.session.post(self.etcd + "/v3/kv/put", json=body) as response:
                    if response.status == 200:
                        return
                    problem = f"HTTP {response.status}: {await response.text()}"
            except aiohttp.ClientError as error:
                problem = str(error)
            if time.monotonic() > deadline:
                raise KvTransferError(
                    f"cannot register with etcd at {self.etcd} (metadata_server of "
                    f"{self.config_path}): {problem}"
                )
            await asyncio.sleep(0.2)

    async def _etcd_get(self, key: str) -> Any:
        assert self.session is not None
        async with self.session.post(self.etcd + "/v3/kv/range", json={"key": _b64(key)}) as r:
            answer = await r.json(content_type=None)
        kvs = answer.get("kvs") or []
        return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

    async def _drop_select(self, request: web.Request) -> web.Response:
        key = (await request.json())["prompt_key"]
        entries = self.buffer.get(key)
        if not entries:
            return web.json_response({"found": False})
        prompt_tokens = entries.popleft()
        if not entries:
            del self.buffer[key]
        return web.json_response({"found": True, "prompt_tokens": prompt_tokens})

    async def _insert_finished(self, result: StepResult, end_s: float) -> float:
        """Producer, at the end of each step: put the KV of the prefills it finished into the
        lookup buffer. While the buffer is full the inserts wait (``SimpleBuffer.insert``
        spins) and so do the step's outputs and the next step, as the simulator's producer
        stalls. Returns the instant the outputs leave."""
        stalled = False
        for request in result.finished:
            entry = self._prefills.pop(request.request_id, None)
            if entry is None:
                continue
            key, tokens = entry
            while not self.lookup.try_insert(self.bytes_per_token_per_rank * tokens):
                if not stalled:
                    say(
                        f"WARNING KV lookup buffer full ({self.lookup.used_bytes:.3g} bytes, "
                        f"kv_buffer_size {self.lookup.capacity_bytes:.3g}): prefill waits"
                    )
                    stalled = True
                self._freed.clear()
                await self._freed.wait()
            self.buffer[key].append(tokens)
        return max(end_s, time.monotonic()) if stalled else end_s

    async def _release(self, request: web.Request) -> web.Response:
        """The consumer's step that received entries has ended: their bytes leave the buffer
        (``drop_select`` removed them)."""
        self.lookup.release(float((await request.json())["bytes"]))
        self._freed.set()
        return web.json_response({"used_bytes": self.lookup.used_bytes})

    async def _copy_chain(self, request: web.Request) -> web.Response:
        """The producer's share of one receive (``KvLink.v0_producer_s``): ``seconds`` of work
        from ``start_s`` that advance only while this instance's engine is between steps
        (``transfer.V0_PRODUCER_CHAIN_SHARE``). Answers with the instant it is done.
        ``start_s`` is the consumer's ``time.monotonic()``: both run on one host."""
        body = await request.json()
        start_s, seconds = float(body["start_s"]), float(body["seconds"])
        while True:
            done_s = self._idle_finish_s(start_s, seconds)
            delay = done_s - time.monotonic()
            if delay <= 0:  # no step started before it: a later one cannot change it
                return web.json_response({"end_s": done_s})
            await asyncio.sleep(delay)

    def _idle_finish_s(self, start_s: float, seconds: float) -> float:
        """When ``seconds`` of engine idle time after ``start_s`` are done, given the steps
        known so far (idle after the last one)."""
        assert self.engine is not None
        later: list[tuple[float, float]] = []
        for step in reversed(self.engine.recent_steps):
            if step[1] <= start_s:
                break
            later.append(step)
        t, left = start_s, seconds
        for step_start, step_end in reversed(later):
            if step_start > t:
                if step_start - t >= left:
                    return t + left
                left -= step_start - t
            t = max(t, step_end)
        return t + left

    async def _receive_step(self, start_s: float, result: StepResult) -> float:
        """The end of a consumer step that receives KV (``WallClockEngine.receive_hook``): per
        received request, in order, the producer's share of its copy chain (done by the
        producer, between its own steps), then the rest of the receive; then the step's
        compute: `servematrix.engine.transfer.v0_receive_segments`, as the simulator's
        ``ReceiveStep`` times it."""
        ids = [r.request_id for r in result.emitted if r.request_id in self._receives]
        for request_id in self._receives:  # chunked prefill: received, no token yet
            if len(ids) >= result.num_received:
                break
            if request_id not in ids:
                ids.append(request_id)
        costs = [self._receives.pop(i) for i in ids[: result.num_received]]
        receives = [(receive_s, producer_s) for receive_s, producer_s, _ in costs]
        end_s = start_s
        for gated, seconds in v0_receive_segments(receives, result.duration_s):
            end_s = await self._producer_share(end_s, seconds) if gated else end_s + seconds
        self._spawn(self._release_at(end_s, sum(nbytes for _, _, nbytes in costs)))
        return end_s

    async def _release_at(self, end_s: float, nbytes: float) -> None:
        """Free the received entries' bytes in the producer's buffer when the step ends."""
        await asyncio.sleep(max(end_s - time.monotonic(), 0.0))
        assert self.session is not None
        url = (await self._producer_url()) + "/servematrix/release"
        try:
            async with self.session.post(url, json={"bytes": nbytes}) as response:
                await response.read()
        except aiohttp.ClientError as error:
            say(f"WARNING releasing {nbytes:.3g} bytes at {url} failed: {error}")

    async def _producer_share(self, start_s: float, seconds: float) -> float:
        assert self.session is not None
        url = (await self._producer_url()) + "/servematrix/copy_chain"
        try:
            async with self.session.post(
                url, json={"start_s": start_s, "seconds": seconds}
            ) as response:
                return float((await response.json(content_type=None))["end_s"])
        except (aiohttp.ClientError, ValueError, KeyError, KvTransferError) as error:
            # The receive itself succeeded (drop_select found the KV); time it ungated.
            say(f"WARNING producer copy chain at {url} failed ({error}); not gated")
            return start_s + seconds

    def submitted(self, body: Mapping[str, Any], stream: TokenStream) -> None:
        if self.role == "kv_consumer":
            costs = self._found.pop(id(body), None)
            if costs is not None:
                self._receives[stream.request.request_id] = costs
            return
        request = stream.request
        self._prefills[request.request_id] = (prompt_key(body.get("prompt")), request.prompt_tokens)

    async def before_submit(
        self, body: Mapping[str, Any], prompt_tokens: int, arrival_s: float, api_path_s: float
    ) -> tuple[float, dict[str, Any]]:
        if self.role != "kv_consumer":
            return arrival_s, {}
        producer = await self._producer_url()
        assert self.session is not None
        try:
            async with self.session.post(
                producer + "/servematrix/drop_select",
                json={"prompt_key": prompt_key(body.get("prompt"))},
            ) as response:
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as error:
            raise KvTransferError(
                f"KV receive failed: producer {producer} ({self.config['prefill_url']}): {error}"
            ) from None
        if not answer.get("found"):
            say("WARNING Failed to receive all KVs and hidden states, redo model forwarding")
            return arrival_s, {}
        per_rank = self.bytes_per_token_per_rank * prompt_tokens
        receive_s = self.link.v0_receive_s(per_rank)
        self._found[id(body)] = (receive_s, self.link.v0_producer_s(per_rank), per_rank)
        return arrival_s, {"receive_ms": receive_s * 1e3}

    async def _producer_url(self) -> str:
        if self._producer is None:
            prefill_url = str(self.config["prefill_url"])
            try:
                meta = await self._etcd_get(f"mooncake/rpc_meta/{prefill_url}")
            except (aiohttp.ClientError, ValueError) as error:
                raise KvTransferError(f"etcd at {self.etcd} unreachable: {error}") from None
            if meta is None:
                raise KvTransferError(
                    f"the producer segment {prefill_url} is not registered at etcd {self.etcd}"
                )
            self._producer = f"http://{meta['ip_or_host_name']}:{meta['rpc_port']}"
        return self._producer


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _host_port(url: str, source: str) -> tuple[str, int]:
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KvTransferError(f"{source}: {url!r} is not HOST:PORT")
    return host, int(port)


def _etcd_url(metadata_server: str, source: str) -> str:
    """``metadata_server`` as the etcd gateway's base URL (``IP:2379`` or ``etcd://IP:2379``)."""
    if "://" in metadata_server:
        scheme, _, rest = metadata_server.partition("://")
        if scheme != "etcd":
            raise KvTransferError(
                f"{source}: metadata_server {metadata_server!r}: the emulator speaks to etcd only"
            )
        metadata_server = rest.split(",")[0]
    host, port = _host_port(metadata_server, f"{source}: metadata_server")
    return f"http://{host}:{port}"
