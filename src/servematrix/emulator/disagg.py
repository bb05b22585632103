"""The emulator in disaggregated modes: the Mooncake connectors' producer and consumer roles,
played for real between two emulator processes, timed by the simulator's KV transfer model.

An instance started with ``--kv-transfer-config`` naming ``MooncakeConnector`` and role
``kv_producer`` or ``kv_consumer`` gets a :class:`KvConnector`; the HTTP server calls it around
:meth:`WallClockEngine.submit` (``before_submit`` on the consumer, ``submitted`` and ``failed``
on the producer). Timing comes from ``servematrix.engine.transfer`` with the bytes the simulator
moves (``simulate._Disaggregated``), so the emulator and the simulator agree on a cell.

**v1** (vLLM 0.33 in-tree ``MooncakeConnector``, wire reference §8):

* The producer runs the bootstrap server on ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (default 8998), on
  the instance's ``--host``: ``POST /register`` (``{engine_id, dp_rank, tp_rank, pp_rank,
  addr}``, reply ``{"status":"ok"}``) and ``GET /query`` (``{"<dp>": {"engine_id",
  "worker_addr": {"<tp>": {"<pp>": "tcp://ip:port"}}}}``). Its one worker registers itself
  there over HTTP at start, with the engine id of the config (``engine_id``, else a uuid4) and
  as address the bootstrap server's own port, where the worker's side channel
  ``GET /servematrix/kv/{transfer_id}`` answers once the prefill of that ``transfer_id`` has
  finished (long poll; an error if it failed). The prefill's response carries
  ``kv_transfer_params: null``, as the real connector's does.
* The consumer, for a request with ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_bootstrap_addr`` and ``transfer_id``: reads the producer's worker address from
  ``/query``, pulls by ``transfer_id`` (waiting for the producer's prefill), then moves the KV
  over the modelled link, a :class:`~servematrix.engine.transfer.TransferLink` (setup, then the
  prompt's KV bytes at the link's bandwidth, shared by concurrent transfers) paced by the wall
  clock. The request joins the engine when its transfer completes, with every prompt token
  computed but the last, as in the simulator. Incomplete parameters: vLLM logs ``Got invalid
  KVTransferParams`` and prefills locally, and so does the emulator. A failed pull fails the
  request (policy ``fail``: HTTP 500).

**v0** (vLLM 0.6 ``MooncakeConnector``: ``SimpleBuffer`` over ``MooncakePipe``, §9):

* Both read ``MOONCAKE_CONFIG_PATH`` and register their segment (``prefill_url`` /
  ``decode_url``) in the etcd of ``metadata_server`` (its v3 JSON gateway): keys
  ``mooncake/ram/<url>`` and ``mooncake/rpc_meta/<url>`` = ``{"ip_or_host_name", "rpc_port"}``.
* The producer inserts every finished prefill's KV into its lookup buffer, keyed by the prompt,
  and serves ``POST /servematrix/drop_select`` on ``prefill_url``'s port (pop the first match).
* The consumer finds the producer's address in etcd and ``drop_select``s each request's prompt:
  found, the request joins the engine with the receive inside the forward pass of the step
  that would prefill it (``KvLink.v0_receive_s``: it stalls that whole step, as in the
  simulator); not found, vLLM's ``Failed to receive all KVs and hidden states, redo model
  forwarding`` and a local prefill.

  The producer's share of that receive (``KvLink.v0_producer_s``) is done by the producer,
  and advances only while the producer's engine is between steps (``POST
  /servematrix/copy_chain``, answered when done; the two processes share one host's monotonic
  clock); the consumer's step ends after it, the rest of the receive and its compute.

  The lookup buffer holds ``kv_buffer_size`` bytes (per rank); an insert into a full buffer
  waits, holding the producer's outputs and next step back, until a consumer step that
  received entries ends (``POST /servematrix/release``), as the simulator's producer stalls.
"""

from __future__ import annotations

import array
import asyncio
import base64
import hashlib
import itertools
import json
import os
import sys
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Mapping
from math import inf
from typing import Any

import aiohttp
from aiohttp import web

from servematrix.emulator.pacing import TokenStream, WallClockEngine
from servematrix.engine.architecture import Architecture
from servematrix.engine.instance import StepResult
from servematrix.engine.kvcache import kv_bytes_per_token_per_gpu
from servematrix.engine.transfer import KvLink, LookupBuffer, TransferLink, kv_link

DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_ABORT_TIMEOUT_S = 480.0
"""``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``: how long a producer keeps KV nobody pulled, and so
how long a pull may wait for its prefill."""
ETCD_RETRY_S = 10.0
KV_LINK_ENV = "SERVEMATRIX_EMULATOR_KV_LINK"
DEFAULT_KV_BUFFER_BYTES = 1e9
"""vLLM 0.6's ``KVTransferConfig.kv_buffer_size`` default (the recipe passes 2e9)."""


def _say(message: str) -> None:
    print(f"servematrix-emulator: {message}", file=sys.stderr, flush=True)


class KvTransferError(Exception):
    """A KV transfer, or the connector's set-up, failed; the message names who and why."""


def _reach(host: str | None) -> str:
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
        me = f"http://{_reach(self.host)}:{self.bootstrap_port}"
        registration = {
            "engine_id": self.engine_id,
            "dp_rank": 0,
            "tp_rank": 0,
            "pp_rank": 0,
            "addr": f"tcp://{_reach(self.host)}:{self.bootstrap_port}",
        }
        assert self.session is not None
        async with self.session.post(me + "/register", json=registration) as response:
            if response.status != 200:
                raise KvTransferError(f"bootstrap /register answered HTTP {response.status}")
        _say(f"Mooncake bootstrap server on port {self.bootstrap_port}, engine id {self.engine_id}")

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
            _say(f"WARNING kv_transfer_params without transfer_id: {params}")
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
            _say(f"WARNING Got invalid KVTransferParams: {params}")
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
        # As simulate._Disaggregated: after the prefill, the decode request's way through
        # this server's API path (engine.host), then the pull over the link.
        await asyncio.sleep(api_path_s)
        nbytes = self.bytes_per_token_per_rank * self.link.tp * prompt_tokens
        done_s = await self._link.transfer(nbytes)
        # All prompt KV is present; the last prompt token is recomputed to sample the first
        # output token (simulate._Disaggregated does the same).
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
        _say(f"Mooncake segment {self.own_url} registered at etcd {self.etcd}")

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
                    _say(
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
        compute. The simulator's ``_ReceiveStep`` times it the same way."""
        ids = [r.request_id for r in result.emitted if r.request_id in self._receives]
        for request_id in self._receives:  # chunked prefill: received, no token yet
            if len(ids) >= result.num_received:
                break
            if request_id not in ids:
                ids.append(request_id)
        costs = [self._receives.pop(i) for i in ids[: result.num_received]]
        t = start_s
        for receive_s, producer_s, _ in costs:
            t = await self._producer_share(t, producer_s)
            t += receive_s - producer_s
        end_s = t + result.duration_s - sum(receive_s for receive_s, _, _ in costs)
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
            _say(f"WARNING releasing {nbytes:.3g} bytes at {url} failed: {error}")

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
            _say(f"WARNING producer copy chain at {url} failed ({error}); not gated")
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
            _say("WARNING Failed to receive all KVs and hidden states, redo model forwarding")
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


def _bytes_per_token_per_rank(arch: Architecture, tp: int, recipe: str) -> float:
    """What the simulator moves per prompt token and TP rank: the rank's KV heads, plus in V0
    the last hidden state, which every rank sends (``simulate._Disaggregated``)."""
    hidden = arch.hidden_size * 2 if recipe == "v0" else 0
    return kv_bytes_per_token_per_gpu(arch, tp) + hidden


def connector(
    kv_transfer_config: Mapping[str, Any] | None,
    recipe: str,
    arch: Architecture,
    tensor_parallel: int,
    host: str | None,
    environ: Mapping[str, str] = os.environ,
) -> KvConnector | None:
    """The connector an instance's ``--kv-transfer-config`` asks for (None: not
    disaggregated); raises :class:`KvTransferError` for what the emulator cannot play.

    The link is the preset of (recipe, protocol), with the overrides of
    ``SERVEMATRIX_EMULATOR_KV_LINK`` (a JSON object with the keys of the config's
    ``engine.kv_link``), so a cell that overrides the simulator's link times the emulator's
    transfers alike."""
    if kv_transfer_config is None:
        return None
    overrides_text = environ.get(KV_LINK_ENV)
    try:
        overrides = json.loads(overrides_text) if overrides_text else None
    except ValueError as error:
        raise KvTransferError(f"{KV_LINK_ENV}: invalid JSON: {error}") from None
    name = kv_transfer_config.get("kv_connector")
    role = kv_transfer_config.get("kv_role")
    if name != "MooncakeConnector" or role not in ("kv_producer", "kv_consumer"):
        raise KvTransferError(
            f"--kv-transfer-config: the emulator plays MooncakeConnector as kv_producer or "
            f"kv_consumer, not {name} as {role}"
        )
    per_token = _bytes_per_token_per_rank(arch, tensor_parallel, recipe)
    if recipe == "v1":
        extra = kv_transfer_config.get("kv_connector_extra_config") or {}
        protocol = extra.get("mooncake_protocol", "rdma")
        return MooncakeV1(
            role,
            _link("v1", protocol, tensor_parallel, overrides),
            per_token,
            engine_id=str(kv_transfer_config.get("engine_id") or uuid.uuid4()),
            host=host,
            bootstrap_port=int(
                environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(DEFAULT_BOOTSTRAP_PORT))
            ),
            abort_timeout_s=float(
                environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", str(DEFAULT_ABORT_TIMEOUT_S))
            ),
        )
    path = environ.get("MOONCAKE_CONFIG_PATH", "")
    try:
        with open(path) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise KvTransferError(f"MOONCAKE_CONFIG_PATH {path}: {error}") from None
    missing = [k for k in ("prefill_url", "decode_url", "metadata_server") if k not in config]
    if missing:
        raise KvTransferError(f"{path}: missing {', '.join(missing)}")
    protocol = config.get("protocol", "tcp")
    buffer_bytes = float(kv_transfer_config.get("kv_buffer_size", DEFAULT_KV_BUFFER_BYTES))
    link = _link("v0", protocol, tensor_parallel, overrides)
    return MooncakeV0(role, link, per_token, config, path, buffer_bytes)


def _link(recipe: str, protocol: str, tp: int, overrides: Any) -> KvLink:
    if overrides is not None and not isinstance(overrides, dict):
        raise KvTransferError(f"{KV_LINK_ENV}: expected a JSON object, got {overrides!r}")
    try:
        return kv_link(recipe, protocol, tp, overrides)
    except KeyError as error:
        raise KvTransferError(str(error).strip('"')) from None
