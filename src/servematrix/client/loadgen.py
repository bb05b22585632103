"""The load generator: send a cell's requests to an OpenAI-compatible server, record every chunk.

Semantics follow vLLM's benchmark client (reference/vllm-mooncake-spec.md §3.1) where they are
defined, and the design's trace schema everywhere:

- One shared aiohttp session whose pool holds every request that can be in flight at once; no
  retries. Streaming ``POST /v1/completions`` with ``max_tokens``, ``temperature 0``,
  ``ignore_eos`` and ``stream_options`` asking for (continuous) usage, so the server says how
  many tokens each chunk carries; header ``X-Request-Id: <run prefix>-<request_id>``.
  ``client="openai"`` sends the same bytes through ``openai.AsyncOpenAI`` instead; it costs
  more per request (see ``senders.CLIENTS``), so it is not the default.
- The JSON bodies are encoded before the clock starts: at send time nothing on the event loop
  grows with the prompt (a 32k-token prompt is ~200 kB of JSON, milliseconds to encode).
- t = 0 is one ``time.monotonic()`` reading (kept in the trace metadata, so a server's own
  monotonic timestamps on the same host line up). Each measured request is sent at
  ``t0 + scheduled_s``: absolute targets, so a late wake-up never delays later sends. With
  ``max_concurrency`` a request then waits for a free slot, in schedule order, as
  ``vllm bench serve --max-concurrency``; ``sent_s`` is when it is actually sent, so the send lag
  then includes that wait.
- The response bytes are read as they arrive and timestamped before any parsing
  (`servematrix.client.sse.StreamParser`); openai's own stream would build a pydantic object per
  chunk first. Every chunk with ``choices`` is a token event, empty text included (vLLM 0.33's rule;
  vLLM 0.6's client skipped empty-text chunks: see ``servematrix.client.sse``): its arrival time
  goes into ``chunk_s`` and its share of ``usage.completion_tokens`` into ``chunk_tokens``.
  ``end_s`` is the last token event, not ``[DONE]`` (vLLM's current E2EL).
- ``prompt_tokens``/``completion_tokens`` are the server's last usage; a server that sends none
  gets the planned input length and the number of token events instead.
- Warm-up requests go one at a time before t = 0, so their times are negative. Then up to
  ``PREOPEN_CONNECTIONS`` connections are opened (concurrent ``GET /health``), so connection
  set-up is not inside the TTFT of the first requests that overlap.
- Success is HTTP 200, a stream that ends with ``[DONE]`` and at least one completion token: a
  completed request is never a failed row. Any failure (HTTP status, error event in the
  stream, dropped connection, timeout, a stream without a token or cut before ``[DONE]``) is a
  row with ``success = False`` and the error text; the chunks that did arrive are kept; the
  run continues.

Here: the settings, readiness, the warm-ups and the run loop that paces the sends; how one
request goes out and is read (the senders, the HTTP client) is `servematrix.client.senders`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import secrets
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import openai

from servematrix.client.progress import Progress
from servematrix.client.senders import (
    CLIENTS,
    AiohttpSender,
    Limits,
    OpenAISender,
    Sender,
    api_key,
    client_session,
    describe,
    openai_client,
    raise_file_limit,
    root_cause,
    send_one,
)
from servematrix.client.sse import StreamParser, record
from servematrix.common.terminal import TERMINAL, WAIT_REPORT_S
from servematrix.spec.trace import RequestRecord
from servematrix.workload import prompts
from servematrix.workload.prompts import encode_body

if TYPE_CHECKING:
    from servematrix.workload import RequestSpec

log = logging.getLogger(__name__)

# Readiness probing: how often, and how long one probe may take (a socket that accepts but
# never answers must not eat the whole readiness budget in one probe).
READY_POLL_S = 0.5
READY_PROBE_TIMEOUT_S = 5.0
# Send timers are set this early; what is left before the instant is spent yielding to the
# loop (see `_sleep_until`).
SPIN_S = 0.0005
# Connections opened before the clock starts, so the first requests that overlap do not pay
# for a TCP connection inside their TTFT (vLLM's client runs its warm-ups concurrently and so
# starts with as many); more are opened during the run as needed.
PREOPEN_CONNECTIONS = 64


class LoadgenError(RuntimeError):
    """A run that cannot start: bad settings or a server that never became ready."""


def normalize_base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]/v1`` without a trailing slash, or LoadgenError.

    A missing ``/v1`` is added, so ``http://host:8000`` works as it does for ``vllm bench``.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadgenError(f"base URL {url!r} is not an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in range)
    except ValueError:
        raise LoadgenError(f"base URL {url!r} has an invalid port") from None
    if parts.query or parts.fragment:
        raise LoadgenError(f"base URL {url!r} must not have a query or fragment")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass
class ClientSettings:
    base_url: str  # e.g. http://127.0.0.1:8000/v1 (a missing /v1 is added)
    model: str
    max_concurrency: int | None
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 600.0
    ignore_eos: bool = True
    client: str = "aiohttp"  # or "openai": see CLIENTS
    refused_timeout_s: float | None = None
    """Give up sooner when the port has refused every connection this long (a server the
    user says is running); None waits ``ready_timeout_s`` (a server still loading its model
    refuses until it listens)."""
    prompt_format: str = "auto"  # see prompts.PROMPT_FORMATS
    tokenizer: str | None = None  # decodes id prompts to text (default: the model's)
    first_byte_timeout_s: float = 600.0
    """A request whose answer has not begun this long fails (see `senders.Limits`)."""

    def __post_init__(self) -> None:
        self.base_url = normalize_base_url(self.base_url)
        if self.client not in CLIENTS:
            raise LoadgenError(f"client must be one of {', '.join(CLIENTS)}, got {self.client!r}")
        if self.prompt_format not in prompts.PROMPT_FORMATS:
            raise LoadgenError(
                f"prompt_format must be one of {', '.join(prompts.PROMPT_FORMATS)}, "
                f"got {self.prompt_format!r}"
            )
        if not self.model:
            raise LoadgenError("model name is empty")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadgenError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        timeouts = ("request_timeout_s", "first_byte_timeout_s", "ready_timeout_s")
        for name in (*timeouts, "refused_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise LoadgenError(f"{name} must be > 0, got {value}")

    @property
    def limits(self) -> Limits:
        return Limits(self.request_timeout_s, self.first_byte_timeout_s)

    @property
    def completions_url(self) -> str:
        return f"{self.base_url}/completions"

    @property
    def server_root(self) -> str:
        """The URL without ``/v1``: where vLLM serves ``/health``."""
        return self.base_url.removesuffix("/v1")


@dataclass
class RunResult:
    records: list[RequestRecord]  # warm-ups first, then the measured requests; by request_id
    origin_monotonic_s: float  # the time.monotonic() value that is t = 0 of the records
    request_id_prefix: str = ""  # X-Request-Id is f"{request_id_prefix}-{request_id}"
    client: str = "aiohttp"  # ClientSettings.client
    prompts: dict[str, Any] = field(default_factory=lambda: {"format": "ids"})
    """How prompts went out: ids, or text (the tokenizer, and the server's prompt_tokens
    minus the planned length, ``prompts.input_len_difference``)."""

    def metadata(self) -> dict[str, Any]:
        """The trace metadata entries that belong to the client."""
        return {
            "clock": {"origin_monotonic_s": self.origin_monotonic_s},
            "client": {
                "request_id_prefix": self.request_id_prefix,
                "client": self.client,
                "prompts": self.prompts,
                "aiohttp": _version("aiohttp"),
                "openai": openai.__version__,
            },
        }


def _version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


async def wait_ready(settings: ClientSettings, session: aiohttp.ClientSession | None = None) -> str:
    """Poll ``GET /health`` (else ``GET /v1/models``) until it answers 200; return that URL.

    Says at once what it waits for, where and for how long, then every ``WAIT_REPORT_S``.
    Raises LoadgenError naming the URL when ``ready_timeout_s`` passes first (or
    ``refused_timeout_s`` of refused connections), or when the server lists its models and
    ours is not among them (every request would fail with 404).
    """
    if session is None:
        async with client_session(1) as own:
            return await wait_ready(settings, own)
    began = time.monotonic()
    deadline = began + settings.ready_timeout_s
    health = f"{settings.server_root}/health"
    models = f"{settings.base_url}/models"
    headers = {"Authorization": f"Bearer {api_key()}"}
    problem, refused_since, reported = "no answer", None, None
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            break
        if refused_since is not None and now - refused_since >= (
            settings.refused_timeout_s or math.inf
        ):
            raise LoadgenError(
                f"nothing listens at {settings.server_root}: every connection refused for "
                f"{now - refused_since:.0f} s; is the server running at that address? "
                f"(last probe: {problem})"
            )
        if reported is None or now - reported >= WAIT_REPORT_S:
            _report_wait(settings, health, now - began, problem if reported else None)
            reported = now
        probe_s = min(READY_PROBE_TIMEOUT_S, remaining)
        timeout = aiohttp.ClientTimeout(total=probe_s)
        refused = False
        try:
            async with session.get(health, timeout=timeout, headers=headers) as response:
                status, url = response.status, health
            if status == 404:  # an OpenAI-compatible server without /health
                async with session.get(models, timeout=timeout, headers=headers) as response:
                    status, url = response.status, models
            if status == 200:
                async with session.get(models, timeout=timeout, headers=headers) as response:
                    _check_model(settings, response.status, await response.read())
                return url
            problem = f"HTTP {status} from {url}"
        except TimeoutError:
            problem = f"no answer within {probe_s:.1f} s"
        except aiohttp.ClientError as error:
            cause = root_cause(error)
            problem = describe(cause)
            refused = isinstance(cause, ConnectionRefusedError) or isinstance(
                getattr(error, "os_error", None), ConnectionRefusedError
            )
        refused_since = (refused_since or time.monotonic()) if refused else None
        await asyncio.sleep(min(READY_POLL_S, max(0.0, deadline - time.monotonic())))
    raise LoadgenError(
        f"server at {settings.server_root} never became ready within "
        f"{settings.ready_timeout_s:g} s (last probe: {problem})"
    )


def _report_wait(
    settings: ClientSettings, health: str, waited_s: float, problem: str | None
) -> None:
    """The wait's first line (what, where, how long), or a later one (how far, why)."""
    if problem is None:
        refused = settings.refused_timeout_s
        sooner = f" ({refused:g} s if its port refuses connections)" if refused else ""
        message = f"waiting up to {settings.ready_timeout_s:g} s{sooner} for GET {health} to answer"
    else:
        message = (
            f"still waiting for {health}: {waited_s:.0f} s of {settings.ready_timeout_s:g} s "
            f"(last probe: {problem})"
        )
    log.info("%s", message, extra=TERMINAL)


def _check_model(settings: ClientSettings, status: int, body: bytes) -> None:
    if status != 200:
        return  # not every OpenAI-compatible server lists its models; requests will tell
    try:
        served = [card["id"] for card in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return
    if served and settings.model not in served:
        raise LoadgenError(
            f"server at {settings.server_root} does not serve model {settings.model!r} "
            f"(it serves: {', '.join(served)})"
        )


def _as_text(
    requests: Sequence[RequestSpec], settings: ClientSettings
) -> tuple[list[RequestSpec], dict[str, Any]]:
    try:
        converted, tokenizer = prompts.as_text(requests, settings.tokenizer or settings.model)
    except prompts.PromptError as error:
        raise LoadgenError(str(error)) from None
    return converted, {"format": "text", "tokenizer": tokenizer}


def _encode(
    requests: Sequence[RequestSpec], settings: ClientSettings, prefix: str
) -> tuple[dict[int, bytes], dict[int, dict[str, str]]]:
    """Every body and header set, encoded before the clock starts (nothing on the event loop
    grows with the prompt at send time)."""
    bodies = {r.request_id: encode_body(r, settings) for r in requests}
    common = {"Content-Type": "application/json", "Authorization": f"Bearer {api_key()}"}
    if settings.client == "openai":  # the SDK adds its own
        common = {}
    headers = {
        r.request_id: {**common, "X-Request-Id": f"{prefix}-{r.request_id}"} for r in requests
    }
    return bodies, headers


async def run_requests(
    settings: ClientSettings, requests: Sequence[RequestSpec], progress: Progress | None = None
) -> RunResult:
    """Wait for the server, run the warm-ups one by one, then the measured requests on time.

    A warm-up the server refuses with a 4xx stops the run (LoadgenError with the server's
    reason), unless it refuses token-id prompts and ``prompt_format`` is ``auto``: then the
    prompts go out as text (see ``servematrix.workload.prompts``) from the warm-up on."""
    if not any(not r.warmup for r in requests):
        raise LoadgenError("no measured requests to send")
    prefix = secrets.token_hex(4)
    how: dict[str, Any] = {"format": "ids"}
    if settings.prompt_format == "text":
        requests, how = _as_text(requests, settings)
    bodies, headers = _encode(requests, settings, prefix)
    max_in_flight = min(settings.max_concurrency or len(requests), len(requests))
    raise_file_limit(max_in_flight + 64)
    async with client_session(max_in_flight) as session:
        ready_url = await wait_ready(settings, session)
        sdk_client = None
        if settings.client == "openai":
            sdk_client = openai_client(settings.base_url, max_in_flight)
            send: Sender = OpenAISender(sdk_client)
        else:
            send = AiohttpSender(session, settings.base_url)
        # Out of the garbage collector's sight for the run: the prompts and bodies (lists of
        # thousands of ints each) made every full collection a stall of ~0.4 s on a 2-core
        # machine (5000 x 1k or 200 x 32k tokens), which the sends behind it waited for.
        gc.collect()
        gc.freeze()
        try:
            warm, refused = await _warm_up(send, settings, requests, bodies, headers)
            ids = any(isinstance(r.prompt, list) for r in requests)
            if (
                refused
                and settings.prompt_format == "auto"
                and ids
                and prompts.refuses_ids(refused)
            ):
                log.warning("the server refuses token-id prompts (%s); sending text", refused)
                requests, how = _as_text(requests, settings)
                bodies, headers = _encode(requests, settings, prefix)
                warm, refused = await _warm_up(send, settings, requests, bodies, headers)
            if refused:
                raise LoadgenError(
                    f"the server at {settings.server_root} refused the warm-up request "
                    f"({refused}); no measured request was sent"
                )
            measured = sorted(
                (r for r in requests if not r.warmup),
                key=lambda r: (r.after_id is not None, r.scheduled_s),
            )
            await send.open_connections(ready_url, min(max_in_flight, PREOPEN_CONNECTIONS))
            result = await _run(send, settings, warm, measured, bodies, headers, prefix, progress)
        finally:
            gc.unfreeze()
            if sdk_client is not None:
                await sdk_client.close()
    if how["format"] == "text":
        how["input_len_difference"] = prompts.input_len_difference(result.records)
    result.prompts = how
    return result


async def _warm_up(
    send: Sender,
    settings: ClientSettings,
    requests: Sequence[RequestSpec],
    bodies: dict[int, bytes],
    headers: dict[int, dict[str, str]],
) -> tuple[list[tuple[RequestSpec, StreamParser]], str | None]:
    """The warm-up requests, one at a time, until one is refused with a 4xx (then its error).

    A warm-up that hangs says so every ``WAIT_REPORT_S``; one that times out stops the run
    (LoadgenError): every measured request would wait as long. Any other failure (an HTTP 500,
    a dropped connection) is a warning, and the measured requests say whether it lasts."""
    warm: list[tuple[RequestSpec, StreamParser]] = []
    for spec in (r for r in requests if r.warmup):
        sending = send_one(send, bodies[spec.request_id], headers[spec.request_id], settings.limits)
        raw = await _reporting_wait(sending, settings, spec.request_id)
        warm.append((spec, raw))
        if raw.status is not None and 400 <= raw.status < 500:
            return warm, raw.error
        if raw.timed_out:
            raise LoadgenError(
                f"the warm-up request to {settings.completions_url} got no answer: "
                f"{raw.error}; no measured request was sent"
            )
        if raw.error:
            log.warning("warm-up request %d failed: %s", spec.request_id, raw.error)
    return warm, None


async def _reporting_wait(
    sending: Coroutine[Any, Any, StreamParser], settings: ClientSettings, request_id: int
) -> StreamParser:
    """The warm-up's answer; meanwhile, every ``WAIT_REPORT_S``, a line saying what it waits
    for, how long so far and the limit."""
    task = asyncio.ensure_future(sending)
    began = time.monotonic()
    while not (await asyncio.wait({task}, timeout=WAIT_REPORT_S))[0]:
        log.info(
            "warm-up request %d: waiting for %s to answer: %.0f s so far (gives up at %g s "
            "without a first byte, %g s in all)",
            request_id,
            settings.completions_url,
            time.monotonic() - began,
            min(settings.first_byte_timeout_s, settings.request_timeout_s),
            settings.request_timeout_s,
            extra=TERMINAL,
        )
    return task.result()


async def _run(
    send: Sender,
    settings: ClientSettings,
    warm: list[tuple[RequestSpec, StreamParser]],
    measured: list[RequestSpec],
    bodies: dict[int, bytes],
    headers: dict[int, dict[str, str]],
    prefix: str,
    progress: Progress | None,
) -> RunResult:
    """The measured requests, each at its instant; then every request as a record.

    A session's later turn (``after_id``) goes from the task of the turn it follows, at the
    monotonic time that turn's answer ended (its last chunk, or its error) plus ``think_s``."""
    results: dict[int, StreamParser] = {}
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    following = {spec.after_id: spec for spec in measured if spec.after_id is not None}
    scheduled: dict[int, float] = {}
    limits = settings.limits

    async def one(spec: RequestSpec) -> None:
        try:
            raw = await send_one(send, bodies[spec.request_id], headers[spec.request_id], limits)
        finally:
            if slots is not None:
                slots.release()
        results[spec.request_id] = raw
        if progress is not None:
            progress.finished(raw.error is None)
        after = following.get(spec.request_id)
        if after is not None:
            due = (raw.chunk_s[-1] if raw.chunk_s else time.monotonic()) + after.think_s
            scheduled[after.request_id] = due - origin
            await _sleep_until(due)
            await one(after)

    if progress is not None:
        progress.start()
        reporter = asyncio.create_task(progress.run())
    origin = time.monotonic()
    tasks = []
    try:
        for spec in (spec for spec in measured if spec.after_id is None):
            await _sleep_until(origin + spec.scheduled_s)
            if slots is not None:
                await slots.acquire()
            tasks.append(asyncio.create_task(one(spec)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if progress is not None:
            reporter.cancel()
            progress.close()
    records = [record(spec, raw, origin, scheduled_s=raw.sent - origin) for spec, raw in warm]
    records += [
        record(spec, results[spec.request_id], origin, scheduled.get(spec.request_id))
        for spec in measured
    ]
    records.sort(key=lambda r: r.request_id)
    return RunResult(records, origin, prefix, settings.client)


async def _sleep_until(target: float) -> None:
    """Return at the monotonic time ``target`` (at once when it has passed).

    asyncio's timers wake up to a millisecond late: epoll rounds its timeout up to whole ms.
    Set ``SPIN_S`` early, the timer fires somewhere in [target - SPIN_S, target - SPIN_S +
    1 ms); when that is early, the rest is spent yielding to the loop (which keeps serving the
    streams in flight). With 0.5 ms a send is at most ~0.5 ms late from the timer, and the
    yielding costs ~0.13 ms of CPU per request on average instead of ~0.6 ms for a timer set
    a whole millisecond early.
    """
    monotonic = time.monotonic
    delay = target - monotonic() - SPIN_S
    if delay > 0:
        await asyncio.sleep(delay)
    while monotonic() < target:
        await asyncio.sleep(0)


def run(
    settings: ClientSettings, requests: Sequence[RequestSpec], progress: Progress | None = None
) -> RunResult:
    return asyncio.run(run_requests(settings, requests, progress))


def failure(
    records: Sequence[RequestRecord], url: str, max_failed_share: float = 1.0
) -> str | None:
    """Why a run's requests are no result, or None: every measured request failed, or more
    than ``max_failed_share`` of them did. Names the URL they went to and the first error."""
    measured = [r for r in records if not r.warmup]
    failed = [r for r in measured if not r.success]
    if not failed:
        return None
    first = f"first: {failed[0].error}"
    if len(failed) == len(measured):
        return f"all {len(measured)} requests to {url} failed; {first}"
    if len(failed) > max_failed_share * len(measured):
        return (
            f"{len(failed)} of {len(measured)} requests to {url} failed, more than "
            f"max_failed_share {max_failed_share:g} allows; {first}"
        )
    return None
