"""The emulated vLLM 0.33 ``MooncakeConnector`` (V1; `servematrix.emulator.disagg` describes
its bootstrap server, side channel and pull)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from servematrix.emulator.kvconnector import (
    KvConnector,
    KvTransferError,
    WallClockLink,
    reach,
    say,
)
from servematrix.emulator.pacing import TokenStream
from servematrix.engine.transfer import KvLink, TransferLink


class MooncakeV1(KvConnector):
    def __init__(
        self,
        role: str,
        link: KvLink,
        bytes_per_token_per_rank: float,
        engine_id: str,
        host: str | None,
        bootstrap_port: int,
        abort_timeout_s: float,
    ):
        super().__init__(role, link, bytes_per_token_per_rank)
        self.engine_id = engine_id
        self.host = host
        self.bootstrap_port = bootstrap_port
        self.abort_timeout_s = abort_timeout_s
        self.registry: dict[str, dict[str, Any]] = {}  # bootstrap: dp rank -> entry
        self._ready: dict[str, asyncio.Future[str]] = {}  # transfer id -> "" or an error
        self._workers: dict[tuple[str, str], str] = {}  # (bootstrap, engine id) -> side channel
        self._link = WallClockLink(TransferLink(link.wire_bytes_per_s, link.setup_ms * 1e-3))

    async def start(self) -> None:
        await super().start()
        if self.role != "kv_producer":
            return
        app = web.Application()
        app.router.add_post("/register", self._register)
        app.router.add_get("/query", self._query)
        app.router.add_get("/servematrix/kv/{transfer_id}", self._pull)
        await self._listen(app, self.host, self.bootstrap_port, "the Mooncake bootstrap server")
        # The worker registers with the bootstrap server, as vLLM's TP0/PP0 worker does.
        me = f"http://{reach(self.host)}:{self.bootstrap_port}"
        registration = {
            "engine_id": self.engine_id,
            "dp_rank": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            # vLLM's worker advertises get_ip(): VLLM_HOST_IP when set (a multi-node
            # deployment sets it to the node's address), so a decoder elsewhere can reach it.
            "addr": f"tcp://{os.environ.get('VLLM_HOST_IP') or reach(self.host)}:"
            f"{self.bootstrap_port}",
        }
        assert self.session is not None
        async with self.session.post(me + "/register", json=registration) as response:
            if response.status != 200:
                raise KvTransferError(f"bootstrap /register answered HTTP {response.status}")
        say(f"Mooncake bootstrap server on port {self.bootstrap_port}, engine id {self.engine_id}")

    async def _register(self, request: web.Request) -> web.Response:
        entry = await request.json()
        dp = self.registry.setdefault(
            str(entry["dp_rank"]), {"engine_id": entry["engine_id"], "worker_addr": {}}
        )
        dp["worker_addr"].setdefault(str(entry["tp_rank"]), {})[str(entry["pp_rank"])] = entry[
            "addr"
        ]
        return web.json_response({"status": "ok"})

    async def _query(self, request: web.Request) -> web.Response:
        return web.json_response(self.registry)

    def _future(self, transfer_id: str) -> asyncio.Future[str]:
        future = self._ready.get(transfer_id)
        if future is None:
            future = self._ready[transfer_id] = asyncio.get_running_loop().create_future()
            # KV nobody pulls is freed after the abort timeout, as the real producer does.
            asyncio.get_running_loop().call_later(
                self.abort_timeout_s, self._ready.pop, transfer_id, None
            )
        return future

    async def _pull(self, request: web.Request) -> web.Response:
        transfer_id = request.match_info["transfer_id"]
        try:
            problem = await asyncio.wait_for(
                asyncio.shield(self._future(transfer_id)), self.abort_timeout_s
            )
        except TimeoutError:
            problem = f"no prefill for {transfer_id} within {self.abort_timeout_s:g} s"
        self._ready.pop(transfer_id, None)
        if problem:
            return web.json_response({"error": problem}, status=409)
        return web.json_response({"transfer_id": transfer_id})

    def submitted(self, body: Mapping[str, Any], stream: TokenStream) -> None:
        transfer_id = self._remote_decode(body)
        if transfer_id is not None:
            self._after_prefill(stream, lambda s: self._publish(transfer_id, s))

    def failed(self, body: Mapping[str, Any] | None, message: str) -> None:
        transfer_id = self._remote_decode(body) if body is not None else None
        if transfer_id is not None:
            self._resolve(transfer_id, f"the prefill failed: {message}")

    def _remote_decode(self, body: Mapping[str, Any]) -> str | None:
        params = body.get("kv_transfer_params")
        if self.role != "kv_producer" or not isinstance(params, dict):
            return None
        if not params.get("do_remote_decode"):
            return None
        if not params.get("transfer_id"):
            say(f"WARNING kv_transfer_params without transfer_id: {params}")
            return None
        return str(params["transfer_id"])

    def _publish(self, transfer_id: str, stream: TokenStream) -> None:
        self._resolve(transfer_id, "" if stream.due_s else "the prefill was aborted")

    def _resolve(self, transfer_id: str, problem: str) -> None:
        future = self._future(transfer_id)
        if not future.done():
            future.set_result(problem)

    async def before_submit(
        self, body: Mapping[str, Any], prompt_tokens: int, arrival_s: float, api_path_s: float
    ) -> tuple[float, dict[str, Any]]:
        params = body.get("kv_transfer_params")
        if self.role != "kv_consumer" or not isinstance(params, dict):
            return arrival_s, {}
        if not params.get("do_remote_prefill"):
            return arrival_s, {}
        engine_id = params.get("remote_engine_id")
        bootstrap = params.get("remote_bootstrap_addr")
        transfer_id = params.get("transfer_id")
        if not (engine_id and bootstrap and transfer_id):
            say(f"WARNING Got invalid KVTransferParams: {params}")
            return arrival_s, {}
        worker = await self._worker(str(bootstrap), str(engine_id))
        assert self.session is not None
        try:
            async with self.session.get(f"{worker}/servematrix/kv/{transfer_id}") as response:
                answer = await response.text()
        except aiohttp.ClientError as error:
            raise KvTransferError(
                f"KV load failed for {transfer_id}: producer {worker} unreachable: {error}"
            ) from None
        if response.status != 200:
            raise KvTransferError(
                f"KV load failed for {transfer_id} from engine {engine_id}: {answer}"
            )
        # As servematrix.simulate.disagg: after the prefill, the decode request's way through
        # this server's API path (engine.host), then the pull over the link.
        await asyncio.sleep(api_path_s)
        nbytes = self.bytes_per_token_per_rank * self.link.tp * prompt_tokens
        done_s = await self._link.transfer(nbytes)
        # All prompt KV is present; the last prompt token is recomputed to sample the first
        # output token (the simulator does the same).
        return done_s, {"num_computed": prompt_tokens - 1}

    async def _worker(self, bootstrap: str, engine_id: str) -> str:
        """The side channel of ``engine_id``'s TP0/PP0 worker, from the bootstrap ``/query``."""
        known = self._workers.get((bootstrap, engine_id))
        if known is not None:
            return known
        assert self.session is not None
        try:
            async with self.session.get(bootstrap.rstrip("/") + "/query") as response:
                entries = await response.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as error:
            raise KvTransferError(f"bootstrap server {bootstrap}/query failed: {error}") from None
        for entry in entries.values():
            if entry.get("engine_id") == engine_id:
                addr = entry["worker_addr"]["0"]["0"]
                host_port = addr.removeprefix("tcp://")
                url = self._workers[(bootstrap, engine_id)] = f"http://{host_port}"
                return url
        raise KvTransferError(f"engine id {engine_id} is not registered at {bootstrap}/query")
