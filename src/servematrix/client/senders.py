"""How one request goes out and comes back: the senders, the HTTP client they share, failures.

`servematrix.client.loadgen` runs a cell's requests; each one is `send_one`: sent now through a
`Sender` (the run's one aiohttp session, or ``openai.AsyncOpenAI`` over openai's aiohttp
transport, see ``CLIENTS``) with its precomputed body and headers, its response bytes fed to a
`servematrix.client.sse.StreamParser` as they arrive, timestamped before any parsing. A failure
(HTTP status, timeout, dropped connection, anything else) becomes the parser's error text,
never an exception: one bad request never stops a cell.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import time
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import httpx2
import openai
from openai import AsyncOpenAI, AsyncStream
from openai.types import Completion

from servematrix.client.sse import HTTPStatusError, StreamParser, status_message

log = logging.getLogger(__name__)
# httpx2 (under the openai client) logs every request at INFO: measurable work at 500 req/s.
logging.getLogger("httpx2").setLevel(logging.WARNING)
# How requests go out (the response is read the same way by both, `StreamParser`):
# "aiohttp": one aiohttp session, the precomputed body and headers posted as they are;
# "openai": the same through ``openai.AsyncOpenAI`` (over openai's own aiohttp transport),
# which builds request objects, parses URLs and copies options on every request: about 0.5 ms
# more client CPU per request, and at 100 QPS on a loaded 2-core machine ten times the send
# lag (benchmarks/loadgen_pacing.py). Kept to cross-check the default against the SDK.
CLIENTS = ("aiohttp", "openai")
# Response bytes are handed over as they arrive; a large buffer keeps long streams from
# stalling on it (vLLM's client with aiohttp's 64 KiB default: vllm-project/vllm#39963).
READ_BUFSIZE = 1 << 20
# Idle connections are dropped before vLLM's server drops them (uvicorn's keep-alive timeout
# is 5 s): a request sent on a connection the server is closing at that instant would fail.
KEEPALIVE_S = 4.0


class AiohttpSender:
    """POST the precomputed body on the run's one aiohttp session; feed the bytes as they come."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str):
        self.session = session
        self.url = f"{base_url}/completions"

    async def __call__(self, body: bytes, headers: dict[str, str], out: StreamParser) -> None:
        monotonic = time.monotonic
        feed = out.feed
        async with self.session.post(self.url, data=body, headers=headers) as response:
            if response.status != 200:
                raise status_message(response.status, await response.text(errors="replace"))
            async for data in response.content.iter_any():
                feed(data, monotonic())

    async def open_connections(self, url: str, count: int) -> None:
        async def one() -> None:
            async with self.session.get(url) as response:
                await response.read()

        await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)


class _Response(AsyncStream[Completion]):
    """Hands back the raw HTTP response of a streamed request sent through ``AsyncOpenAI``.

    The openai client builds, sends and status-checks the request, but its own stream would
    turn every chunk into a pydantic object before we could timestamp it: we read the bytes.
    """

    def __init__(self, *, response: httpx2.Response, **_: Any) -> None:
        self.response = response


class OpenAISender:
    def __init__(self, client: AsyncOpenAI):
        self.client = client

    async def __call__(self, body: bytes, headers: dict[str, str], out: StreamParser) -> None:
        monotonic = time.monotonic
        feed = out.feed
        try:
            stream = await self.client.post(
                "/completions",
                cast_to=Completion,
                content=body,
                options={"headers": headers},
                stream=True,
                stream_cls=_Response,
            )
        except openai.APIStatusError as error:
            raise HTTPStatusError(error.status_code, _error_message(error)) from None
        response = stream.response
        try:
            async for data in response.aiter_raw():
                feed(data, monotonic())
        finally:
            await response.aclose()

    async def open_connections(self, url: str, count: int) -> None:
        requests = (self.client.get(url, cast_to=httpx2.Response) for _ in range(count))
        await asyncio.gather(*requests, return_exceptions=True)


class Sender(Protocol):
    """Sends one request and feeds its response to a `StreamParser`; raises on failure."""

    async def __call__(self, body: bytes, headers: dict[str, str], out: StreamParser) -> None: ...

    async def open_connections(self, url: str, count: int) -> None:
        """``count`` concurrent GETs of ``url``, leaving that many connections in the pool."""


@dataclass(frozen=True)
class Limits:
    """How long one request may take: in all (``request_timeout_s``), and until the first bytes
    of its answer (``first_byte_timeout_s``: a server that hangs before answering is caught
    without waiting for the whole request's limit)."""

    request_timeout_s: float
    first_byte_timeout_s: float


async def send_one(
    send: Sender, body: bytes, headers: dict[str, str], limits: Limits
) -> StreamParser:
    """Send one request now and consume its stream; never raises (errors go into the result)."""
    out = StreamParser()
    loop = asyncio.get_running_loop()
    began = loop.time()
    first_s = min(limits.first_byte_timeout_s, limits.request_timeout_s)
    try:
        async with asyncio.timeout_at(began + first_s) as timer:
            out.on_first_bytes = functools.partial(
                timer.reschedule, began + limits.request_timeout_s
            )
            out.sent = time.monotonic()
            await send(body, headers, out)
    except TimeoutError:
        out.error, out.timed_out = _timed_out(out, limits, first_s), True
    except HTTPStatusError as error:
        out.error, out.status = str(error), error.status
    except (aiohttp.ClientError, openai.APIConnectionError, httpx2.TransportError) as error:
        out.error = f"connection error: {_connection_problem(out, error)}"
    except Exception as error:  # the row records it; one bad request never stops the cell
        out.error = describe(error)
    out.on_first_bytes = None
    out.finish()
    if out.sent == 0.0:
        out.sent = time.monotonic()
    return out


def _timed_out(out: StreamParser, limits: Limits, first_s: float) -> str:
    answered = out.on_first_bytes is None
    if not answered and first_s < limits.request_timeout_s:
        return f"no answer within the first-byte timeout of {first_s:g} s"
    return f"timed out after {limits.request_timeout_s:g} s"


DROPPED = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientPayloadError,
    aiohttp.http_exceptions.PayloadEncodingError,
    httpx2.RemoteProtocolError,
)
"""A connection the server closed before its answer was complete (whichever client saw it)."""


def _connection_problem(out: StreamParser, error: BaseException) -> str:
    """A dropped connection says when it dropped, as an HTTP error says its status: aiohttp's
    own texts ("Server disconnected", "400, message: Not enough data ...") do not."""
    cause = root_cause(error)
    if not isinstance(cause, DROPPED) and not isinstance(error, DROPPED):
        return describe(cause)
    reason = getattr(cause, "message", None) or str(cause)
    why = f"{type(cause).__name__}: {' '.join(str(reason).split())}"
    if out.on_first_bytes is not None:
        return f"the server closed the connection before answering ({why})"
    events = len(out.chunk_s)
    return f"the server closed the connection after {events} token event(s) ({why})"


def _error_message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(error.message)


def root_cause(error: BaseException) -> BaseException:
    """The exception that started it: the openai and httpx2 layers rename aiohttp's errors
    (a refused connection and a server closing mid-stream both surface as timeouts there)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def describe(error: BaseException) -> str:
    text = " ".join(str(error).split())  # one line, whatever the library put in its message
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def client_session(max_in_flight: int) -> aiohttp.ClientSession:
    """One connection pool for the whole run, big enough that no request waits for a socket.

    Timeouts are per request (``asyncio.timeout`` around each one), not per read. The
    environment's proxy settings are ignored: a benchmark talks to its server directly.
    """
    connector = aiohttp.TCPConnector(limit=max_in_flight + 1, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        read_bufsize=READ_BUFSIZE,
        trust_env=False,
    )


def openai_client(base_url: str, max_in_flight: int) -> AsyncOpenAI:
    """``AsyncOpenAI`` over openai's aiohttp transport: httpx2's own connection pool scans
    every pooled connection (a syscall per idle one) on each request and each release, which
    with hundreds in flight costs milliseconds per request."""
    limits = httpx2.Limits(
        max_connections=max_in_flight + 1,
        max_keepalive_connections=max_in_flight + 1,
        keepalive_expiry=KEEPALIVE_S,
    )
    http = openai.DefaultAioHttpClient(
        limits=limits, timeout=httpx2.Timeout(None), trust_env=False, follow_redirects=False
    )
    return AsyncOpenAI(
        base_url=base_url,
        api_key=api_key(),
        http_client=http,
        max_retries=0,
        timeout=None,
    )


def api_key() -> str:
    """``OPENAI_API_KEY`` as vLLM's client sends it (a server started with --api-key needs it)."""
    return os.environ.get("OPENAI_API_KEY", "EMPTY")


def raise_file_limit(needed: int) -> None:
    """One socket per request in flight: lift the soft open-file limit (often 1024) towards the
    hard one, so ``qps: inf`` with thousands of prompts does not fail with EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            log.warning(
                "open-file limit %d is below the %d sockets this run may need", hard, needed
            )
