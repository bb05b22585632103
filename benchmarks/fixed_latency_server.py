"""A tiny OpenAI-completions server with fixed latencies, for proxy benchmarks and tests.

    python benchmarks/fixed_latency_server.py --port 8100 [--first-ms 5] [--chunk-ms 2]

``POST /v1/completions`` answers after ``--first-ms`` with ``max_tokens`` chunks (default 16)
``--chunk-ms`` apart, in vLLM 0.33's streamed shape (wire reference §2), or one JSON body
when ``stream`` is false. With ``--stamp`` every chunk carries ``"server_ns"``, the server's
``time.monotonic_ns()`` when it was written, so a client on the same host can measure each
chunk's delivery time (without it, the bytes of an answer depend only on the request).
``GET /health`` is 200; ``GET /query`` answers like a Mooncake bootstrap server with engine id
``--name``; ``GET /requests`` lists the completion requests received (headers, body and
``received_ns``, oldest first). Faults for tests: ``--fail-status N`` answers every completion
with HTTP N; ``--die-after-chunks K`` exits the process after K chunks of a stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from aiohttp import web


def app(args: argparse.Namespace) -> web.Application:
    received: list[dict[str, object]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        received.append(
            {
                "headers": dict(request.headers),
                "body": raw.decode(),
                "received_ns": time.monotonic_ns(),
            }
        )
        if args.fail_status:
            error = {"message": "configured failure", "type": "X", "param": None}
            return web.json_response({"error": error}, status=args.fail_status)
        body = json.loads(raw)
        tokens = int(body.get("max_tokens") or 16)
        await asyncio.sleep(args.first_ms / 1e3)
        head = {"id": "cmpl-fixed", "object": "text_completion", "created": 0, "model": args.name}
        if not body.get("stream"):
            choice = {"index": 0, "text": " t" * tokens, "finish_reason": "length"}
            return web.json_response({**head, "choices": [choice]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for i in range(tokens):
            if i:
                await asyncio.sleep(args.chunk_ms / 1e3)
            if args.die_after_chunks is not None and i == args.die_after_chunks:
                os._exit(1)
            last = i == tokens - 1
            choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}
            chunk = {**head, "choices": [choice]}
            if args.stamp:
                chunk["server_ns"] = time.monotonic_ns()
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def query(request: web.Request) -> web.Response:
        return web.json_response({"0": {"engine_id": args.name, "worker_addr": {}}})

    async def requests(request: web.Request) -> web.Response:
        return web.json_response(received)

    application = web.Application()
    application.router.add_post("/v1/completions", completions)
    application.router.add_get("/health", health)
    application.router.add_get("/query", query)
    application.router.add_get("/requests", requests)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--name", default="fixed")
    parser.add_argument("--first-ms", type=float, default=5.0)
    parser.add_argument("--chunk-ms", type=float, default=2.0)
    parser.add_argument("--stamp", action="store_true")
    parser.add_argument("--fail-status", type=int, default=0)
    parser.add_argument("--die-after-chunks", type=int, default=None)
    args = parser.parse_args()
    web.run_app(app(args), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
