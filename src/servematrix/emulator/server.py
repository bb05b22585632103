"""The HTTP side: vLLM's OpenAI endpoints around a :class:`WallClockEngine`, on aiohttp.

Generated text is one token per step, `` t0``, `` t1``, ...; when the handler falls behind the
engine, the tokens released meanwhile go out in one chunk (as vLLM merges queued deltas), with
exact continuous usage. Emulator-only routes, under ``/servematrix/`` (no vLLM has them):

* ``GET /servematrix/requests`` (``?prefix=P``: only the ids starting with P): per
  ``X-Request-Id`` the server's own ``time.monotonic()`` timestamps (arrival, the engine's due
  time of every token, its step's end, when each chunk was written, the end) and the request's
  ``preemptions`` (how often the engine preempted it; final once the request has ended);
  ``DELETE`` clears the log.
* ``GET /servematrix/kv_cache``: the KV pool in blocks, in use now and at its exact peak;
  ``POST /servematrix/kv_cache/reset_peak`` starts a new peak (a cell on a warm deployment).
  ``/metrics`` has vLLM's usage gauge too, but a sampler misses a peak between two samples.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from servematrix.emulator import prefixes, wire
from servematrix.emulator.kvconnector import KvConnector, KvTransferError
from servematrix.emulator.pacing import TokenStream, WallClockEngine
from servematrix.engine.admission import (
    ContextLengthError,
    granted_max_tokens,
    kv_capacity_message,
)
from servematrix.recipes import recipe_version
from servematrix.workload import TokenCounter

EMPTY_TEXT_FRACTION = 0.02
"""Real vLLM streams a token whose text is ``""`` when the token is a special token or a
partial UTF-8 character (the rest of the character comes with the next one). How often depends
on the tokenizer and the text: rare in English with a BPE tokenizer, every second request on
the random-weight test model. The emulator sends one chunk in 50 that way, so every client and
proxy path it tests meets them; the usage counts are unchanged."""


@dataclass
class Faults:
    """Injected failures, drawn per request from one seeded stream in arrival order."""

    fail_fraction: float = 0.0
    drop_after_chunks: int | None = None
    drop_fraction: float = 1.0
    die_after_requests: int | None = None
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


@dataclass
class ServerSettings:
    recipe: str
    served_names: list[str]
    root: str
    max_model_len: int
    fingerprint: str
    kv_role: str | None
    faults: Faults
    text_counter: TokenCounter  # text prompts: the model's tokenizer, else the approximation
    api_request_ms: float = 0.0
    """The API server's serial work per request (``HostCost.request_ms``): the engine queues
    requests through it, except one arriving with its prompt's KV (a KV consumer's), on whose
    path to the engine it is added, as in the simulator."""
    request_latency_ms: float = 0.0
    """Latency on every request's way in beside that work (``HostCost.request_latency_ms``): the
    request reaches the engine that much later, as in the simulator."""
    vocab_size: int | None = None
    """The model's vocabulary: a prompt id beyond it gets vLLM's 400 (None: not checked)."""
    empty_text_fraction: float = EMPTY_TEXT_FRACTION
    """The share of streamed chunks sent with ``"text": ""``, drawn per chunk from a stream
    seeded by the seed and the response id (see ``EMPTY_TEXT_FRACTION``)."""


@dataclass
class RequestLog:
    """One request's server-side timeline (monotonic seconds)."""

    arrival_s: float
    prompt_tokens: int = 0
    max_tokens: int = 0
    token_due_s: list[float] = field(default_factory=list)
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_s: float | None = None
    status: int = 200
    outcome: str = "running"
    kv_transfer_params: Any = None
    preemptions: int = 0


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class Emulator:
    def __init__(
        self, settings: ServerSettings, engine: WallClockEngine, kv: KvConnector | None = None
    ):
        self.settings = settings
        self.engine = engine
        self.kv = kv  # disaggregated roles (emulator.disagg)
        self.requests: dict[str, RequestLog] = {}
        self.num_requests = 0
        caching = engine.instance.scheduler.config.prefix_caching
        self.prefix_caching = caching  # --enable-prefix-caching

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_fastapi_errors], client_max_size=1 << 30)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/servematrix/requests", self.request_log)
        app.router.add_delete("/servematrix/requests", self.clear_request_log)
        app.router.add_get("/servematrix/kv_cache", self.kv_cache)
        app.router.add_post("/servematrix/kv_cache/reset_peak", self.reset_kv_peak)
        route_env = recipe_version(self.settings.recipe).commands.prefix_cache_reset_env
        if route_env is not None and all(os.environ.get(k) == v for k, v in route_env.items()):
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json(wire.dumps({"version": recipe_version(self.settings.recipe).vllm_version}))

    async def models(self, request: web.Request) -> web.Response:
        s = self.settings
        return _json(wire.model_list(s.served_names, s.root, s.max_model_len, int(time.time())))

    async def metrics(self, request: web.Request) -> web.Response:
        engine, counters = self.engine, self.engine.counters
        scheduler = engine.instance.scheduler
        text = wire.metrics_text(
            self.settings.recipe,
            self.settings.served_names[0],
            running=engine.num_running,
            waiting=engine.num_waiting,
            kv_usage=engine.kv_usage,
            prompt_tokens=counters.prompt_tokens,
            generation_tokens=counters.generation_tokens,
            preemptions=counters.preemptions,
            prefix_cache=(scheduler.prefix_queries_tokens, scheduler.prefix_hits_tokens),
            histograms={
                "vllm:request_prefill_time_seconds": (counters.prefill_time_s, counters.prefills),
                "vllm:request_decode_time_seconds": (counters.decode_time_s, counters.finished),
                "vllm:request_generation_tokens": (
                    counters.finished_generation_tokens,
                    counters.finished,
                ),
            },
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """0.33's dev-mode route: every cached prefix dropped, or ``success: false`` while a
        running request still holds one."""
        success = self.engine.reset_prefix_cache()
        return _json(wire.dumps({"success": success}))

    async def request_log(self, request: web.Request) -> web.Response:
        prefix = request.query.get("prefix", "")
        logs = {key: vars(log) for key, log in self.requests.items() if key.startswith(prefix)}
        return _json(json.dumps(logs))

    async def kv_cache(self, request: web.Request) -> web.Response:
        return _json(json.dumps(self.engine.kv_cache()))

    async def reset_kv_peak(self, request: web.Request) -> web.Response:
        self.engine.reset_kv_peak()
        return _json(json.dumps(self.engine.kv_cache()))

    async def clear_request_log(self, request: web.Request) -> web.Response:
        self.requests.clear()
        return _json("{}")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_s = time.monotonic()
        self.num_requests += 1
        faults = self.settings.faults
        if faults.die_after_requests is not None and self.num_requests > faults.die_after_requests:
            print(
                f"servematrix-emulator: fault injection: dying at request {self.num_requests} "
                f"(--die-after-requests {faults.die_after_requests})",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        fail = faults.rng.random() < faults.fail_fraction
        drop = faults.drop_after_chunks is not None and faults.rng.random() < faults.drop_fraction
        header_id = request.headers.get("X-Request-Id")
        rid = wire.response_id(self.settings.recipe, header_id)
        log = RequestLog(arrival_s)
        self.requests[header_id or rid] = log
        body = None
        try:
            body = await self._parse(request)
            if fail:
                raise RequestError(
                    500, "Internal server error (injected fault)", "InternalServerError"
                )
            prompt_tokens, max_tokens = self._lengths(body)
        except RequestError as error:
            log.status, log.outcome, log.end_s = error.status, error.message, time.monotonic()
            if self.kv is not None:
                self.kv.failed(body, error.message)
            return self._error(error)
        log.prompt_tokens, log.max_tokens = prompt_tokens, max_tokens
        log.kv_transfer_params = body.get("kv_transfer_params")
        if self.engine.can_ever_admit(prompt_tokens):
            covered: dict[str, Any] = {}  # how a KV consumer's prompt is covered
            latency_s = self.settings.request_latency_ms * 1e-3
            if latency_s:
                await asyncio.sleep(max(arrival_s + latency_s - time.monotonic(), 0.0))
                arrival_s += latency_s
            if self.kv is not None:
                api_path_s = self.settings.api_request_ms * 1e-3
                try:
                    arrival_s, covered = await self.kv.before_submit(
                        body, prompt_tokens, arrival_s, api_path_s
                    )
                except KvTransferError as error:
                    log.status, log.outcome, log.end_s = 500, str(error), time.monotonic()
                    return self._error(RequestError(500, str(error), "InternalServerError"))
            # The request counts as arrived when its headers were read (the simulator, the
            # ground truth, has no network either, and parsing a long prompt's body takes
            # milliseconds); a KV consumer's has waited out its API path before its transfer.
            if self.prefix_caching and not covered:
                covered = prefixes.request_fields(self._tokens(body))
            stream = self.engine.submit(prompt_tokens, max_tokens, arrival_s, **covered)
            if self.kv is not None:
                self.kv.submitted(body, stream)
        else:
            stream = self._ignore(body, log)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.settings.served_names[0],
        }
        try:
            if body.get("stream"):
                return await self._stream(request, body, head, stream, log, drop)
            return await self._complete(head, stream, log)
        except ConnectionResetError:  # the client went away: vLLM aborts the request
            return web.Response(status=499)
        finally:
            self.engine.abort(stream)  # no-op when it finished
            log.preemptions = stream.request.num_preemptions
            if log.end_s is None:
                log.end_s = time.monotonic()
                log.outcome = "aborted" if log.outcome == "running" else log.outcome

    def _ignore(self, body: dict[str, Any], log: RequestLog) -> TokenStream:
        """A prompt the KV pool can never admit (:meth:`WallClockEngine.can_ever_admit`): as
        vLLM 0.6.6, a warning in the log and a 200 answer without a token (the empty output is
        not streamed; the usage chunk, if asked for, counts 0 completion tokens)."""
        message = kv_capacity_message(log.prompt_tokens)
        print(f"WARNING {time.strftime('%m-%d %H:%M:%S')} scheduler.py] {message}", flush=True)
        log.outcome = f"ignored: {message}"
        if self.kv is not None:
            self.kv.failed(body, message)
        return self.engine.ignored(log.prompt_tokens, log.max_tokens)

    async def _parse(self, request: web.Request) -> dict[str, Any]:
        dialect = recipe_version(self.settings.recipe).server
        if dialect.json_content_type_only and request.content_type != "application/json":
            raise RequestError(
                400,
                "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                "Bad Request",
            )
        try:
            body = json.loads(await request.read())
        except ValueError as error:
            raise RequestError(
                400, f"1 validation error:\n  JSON decode error: {error}", "Bad Request", "body"
            ) from None
        if not isinstance(body, dict):
            raise RequestError(
                400,
                "1 validation error:\n  Input should be a valid dictionary",
                "Bad Request",
                "body",
            )
        model = body.get("model")
        names = self.settings.served_names
        if model is None and dialect.model_required:
            raise RequestError(
                400, "1 validation error for CompletionRequest\nmodel\n  Field required"
            )
        if (
            model is not None
            and model not in names
            and os.environ.get("VLLM_SKIP_MODEL_NAME_VALIDATION") != "1"
        ):
            if dialect.unknown_model_lists_aliases:
                message = f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}."
                raise RequestError(404, message, "NotFoundError", "model")
            raise RequestError(404, f"The model `{model}` does not exist.", "NotFoundError")
        options = body.get("stream_options")
        given = options if dialect.empty_stream_options_allowed else options is not None
        if given and not body.get("stream"):
            message = "Stream options can only be defined when `stream=True`."
            if dialect.error_names_parameter:
                message += " (parameter=stream_options)"
                raise RequestError(400, message, param="stream_options")
            raise RequestError(400, message)
        return body

    def _tokens(self, body: dict[str, Any]) -> list[int] | list[str]:
        """The tokens of a prompt ``_lengths`` accepted (text: as it counted them)."""
        prompt = _single_prompt(body)
        return self.settings.text_counter.tokens(prompt) if isinstance(prompt, str) else prompt

    def _lengths(self, body: dict[str, Any]) -> tuple[int, int]:
        """Prompt tokens and the output length, with vLLM's context-length rules (§4,
        ``servematrix.engine.admission``, shared with the simulator)."""
        prompt = _single_prompt(body)
        if prompt == [] and recipe_version(self.settings.recipe).server.empty_prompt_batch_error:
            raise RequestError(400, "You must pass at least one prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise RequestError(
                400, "Either prompt or prompt_embeds must be provided and non-empty."
            )
        if isinstance(prompt, str):
            tokens, is_text = self.settings.text_counter.count(prompt), True
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
        ):
            tokens, is_text = len(prompt), False
        else:
            raise RequestError(
                400, "servematrix-emulator serves one prompt (text or token ids) per request"
            )
        limit = self.settings.max_model_len
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
        ):
            raise RequestError(
                400, _integer_error("body.max_tokens", max_tokens), "Bad Request", "body.max_tokens"
            )
        try:
            granted = granted_max_tokens(self.settings.recipe, tokens, max_tokens, limit, is_text)
        except ContextLengthError as error:
            raise RequestError(error.status, error.message, param=error.param) from None
        vocab = self.settings.vocab_size
        if not is_text and vocab is not None and max(prompt) > vocab - 1:
            # After the length check, as vLLM's input processor does (renderers/base.py).
            raise RequestError(400, f"Token id {max(prompt)} is out of vocabulary")
        return tokens, granted

    def _error(self, error: RequestError) -> web.Response:
        recipe = self.settings.recipe
        body = wire.error_body(recipe, error.message, error.kind, error.status, error.param)
        return web.Response(status=error.status, text=body, content_type="application/json")

    async def _complete(self, head: dict, stream: TokenStream, log: RequestLog) -> web.Response:
        while not stream.finished:
            await stream.wait(len(stream.due_s))
        n = len(stream.due_s)
        log.token_due_s = list(stream.due_s)
        text = "".join(f" t{i}" for i in range(n))
        s = self.settings
        body = wire.completion(
            s.recipe,
            head,
            text,
            stream.request.prompt_tokens,
            n,
            self._kv_params(log),
            s.fingerprint,
        )
        response = _json(body)
        log.end_s = time.monotonic()
        log.chunk_s, log.chunk_tokens = [log.end_s], [n]
        _ended(log)
        return response

    async def _stream(
        self,
        request: web.Request,
        body: dict,
        head: dict,
        stream: TokenStream,
        log: RequestLog,
        drop: bool,
    ) -> web.StreamResponse:
        recipe = self.settings.recipe
        dialect = recipe_version(recipe).server
        options = body.get("stream_options")
        if dialect.include_usage_by_default:
            include_usage = options is not None and options.get("include_usage", True) is not False
        else:
            include_usage = bool(options and options.get("include_usage", False))
        continuous = include_usage and bool(options and options.get("continuous_usage_stats"))
        response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"}
        )
        await response.prepare(request)
        prompt_tokens = stream.request.prompt_tokens
        total = stream.request.max_tokens
        fingerprint = self.settings.fingerprint
        # Without a usage chunk the last token chunk carries the fingerprint (0.33).
        closing = dialect.extended_response_fields and not include_usage
        closing_fingerprint = fingerprint if closing else None
        sent = 0
        drop_after = self.settings.faults.drop_after_chunks if drop else None
        empty = random.Random(f"{self.settings.faults.seed}:{head['id']}")
        empty_fraction = self.settings.empty_text_fraction
        while sent < total:
            await stream.wait(sent)
            due = stream.due_s
            ready = len(due)
            if ready == sent:  # finished early: aborted by the engine side
                break
            text = "".join(f" t{i}" for i in range(sent, ready))
            if empty.random() < empty_fraction:
                text = ""  # a special token or a partial character, as vLLM streams them
            last = ready == total
            counts = wire.usage(recipe, prompt_tokens, ready, chunk=True) if continuous else None
            chunk = wire.token_chunk(
                recipe,
                head,
                text,
                "length" if last else None,
                counts,
                self._kv_params(log) if last else None,
                closing_fingerprint if last else None,
            )
            await response.write(chunk)
            log.chunk_s.append(time.monotonic())
            log.chunk_tokens.append(ready - sent)
            log.token_due_s.extend(due[sent:ready])
            sent = ready
            if drop_after is not None and len(log.chunk_s) >= drop_after and not last:
                log.outcome = "dropped (injected fault)"
                log.end_s = time.monotonic()
                request.transport.abort()
                return response
        if include_usage:
            final = wire.usage(recipe, prompt_tokens, sent, chunk=False)
            await response.write(wire.usage_chunk(recipe, head, final, fingerprint))
        await response.write(wire.SSE_DONE)
        await response.write_eof()
        log.end_s = time.monotonic()
        _ended(log)
        return response

    def _kv_params(self, log: RequestLog) -> Any:
        """The request's ``kv_transfer_params`` back (0.33); a Mooncake producer answers null,
        as the real connector does (§8). 0.6 has no such field."""
        dialect = recipe_version(self.settings.recipe).server
        if not dialect.extended_response_fields or self.settings.kv_role == "kv_producer":
            return None
        return log.kv_transfer_params


def _integer_error(loc: str, value: Any) -> str:
    """A pydantic integer error as vLLM's validation handler writes it (one error dict)."""
    if isinstance(value, str):
        kind, msg = (
            "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer",
        )
    elif isinstance(value, float):
        kind, msg = (
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
        )
    else:
        kind, msg = "int_type", "Input should be a valid integer"
    error = {"type": kind, "loc": loc, "msg": msg, "input": value}
    return f"1 validation error:\n  {error}"


def _single_prompt(body: dict[str, Any]) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]  # a batch of one
    return prompt


def _ended(log: RequestLog) -> None:
    """A response sent in full: "ok", unless the request was ignored (it keeps why)."""
    if log.outcome == "running":
        log.outcome = "ok"


def _json(text: str) -> web.Response:
    return web.Response(text=text, content_type="application/json")


@web.middleware
async def _fastapi_errors(request: web.Request, handler) -> web.StreamResponse:
    """Unknown routes and methods answer as FastAPI does: ``{"detail":"Not Found"}``."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.Response(
            status=404, text='{"detail":"Not Found"}', content_type="application/json"
        )
    except web.HTTPMethodNotAllowed:
        return web.Response(
            status=405, text='{"detail":"Method Not Allowed"}', content_type="application/json"
        )
