"""Streaming pass-through proxies in front of serving instances, runnable as a process.

Command lines (what ``servematrix.deploy`` starts; every flag but ``--host`` is required)::

    python -m servematrix.proxy round-robin --port 8090 --upstream http://127.0.0.1:8100 \\
        --upstream http://127.0.0.1:8200
    python -m servematrix.proxy disagg-v0 --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200
    python -m servematrix.proxy disagg-v1 --port 8000 --prefill http://127.0.0.1:8010 8998 \\
        --decode http://127.0.0.1:8020

(``--host`` defaults to 127.0.0.1; ``--upstream``, ``--prefill`` and ``--decode`` may repeat,
each list is cycled.) ``GET /health`` is answered by the proxy itself: 200 when every upstream's
``/health`` is 200 (and, for ``disagg-v1``, the prefillers' engine ids are known), else 503;
the JSON body names each upstream's state.

* ``round-robin`` does what vLLM's ``round_robin_proxy.py`` does (wire reference §10): each
  request goes to the next upstream of a strict cycle, method, path, headers and body unchanged,
  and the upstream's status, headers and bytes come back unchanged as they arrive. Unlike it,
  only POST requests advance the cycle (a GET goes to the first upstream): a client's readiness
  polling must not change which instance the first inference request reaches, since the
  simulator assumes the first warm-up takes the first slot (``simulate.round_robin_targets``).
* ``disagg-v0`` is the 0.6.x ``disagg_prefill_proxy_server.py`` (§9): a copy of the request with
  ``max_tokens`` 1 (the client's bytes with ``"max_tokens":1`` appended, :func:`with_members`)
  goes to the prefiller and is drained, then the unmodified request goes to the decoder and its
  response is streamed back. Unlike the original (which sent the decode anyway
  and answered 200 with an empty body), a failed prefill fails the request: the client gets an
  error naming the prefill instance and its answer, and the decoder never sees the request.
* ``disagg-v1`` is vLLM 0.33's ``mooncake_connector_proxy.py`` (§8): at start it waits for each
  prefiller's ``/health``, then learns its engine ids from the bootstrap server's ``/query``
  (503 until then). Per request it mints ``transfer_id = "xfer-<uuid4>"``, sends the prefill
  (``kv_transfer_params`` with ``do_remote_decode``, ``stream`` false, ``max_tokens`` 1,
  ``stream_options`` null) without waiting for it, and at once streams the decode request
  (``do_remote_prefill``, ``remote_bootstrap_addr``, ``remote_engine_id``, ``transfer_id``). The
  decoder pulls the KV when the prefill has produced it. Differences from the original, all
  outside the KV protocol: the changed members are appended to the client's JSON bytes rather
  than the body decoded and re-encoded (:func:`with_members`; the prefill copy says
  ``"stream_options": null`` where the original deletes the key, which vLLM reads alike);
  the client's ``X-Request-Id`` (if any) is kept on both requests so
  servers' per-request logs line up with the client's (the original replaces it with the uuid);
  the decoder's status and content type are relayed (the original relabels its bytes as
  ``application/json``); a failed prefill is logged, and the decoder's pull then fails the
  request, as in vLLM.

**The relay.** A proxy must add well under a millisecond, and an aiohttp server plus client cost
~0.8 ms of CPU per request on a small machine (``benchmarks/proxy_overhead.py``). So the proxies
relay HTTP/1.1 on asyncio protocols (uvloop's event loop when installed), with llhttp (through
``httptools``, the parser uvicorn runs on) reading every message's head and finding its body's
end: a request's head and its ``Content-Length`` (or chunked) body are read, the request goes
out in one write on a pooled keep-alive upstream connection (no connection limit, 30 s to
connect, no total timeout, ``TCP_NODELAY`` on every socket), and the upstream's response body is
written to the client from the upstream connection's receive callback as it arrives: a
``Content-Length`` body (or one that ends with the connection) as it came, a chunked one chunked
again, one chunk per piece received (so the client never holds half a chunk; chunk extensions
and trailers are dropped), its content coding untouched; only ``Connection``/``Keep-Alive``
headers are hop-by-hop. The response head waits for the first body bytes so both leave in one
write. If an upstream dies in the middle of a streamed (SSE) response, the client gets one
``data: {"error": ...}`` event naming the upstream, then ``data: [DONE]`` (vLLM's own shape for
errors after the 200 header); mid-way through any other body, the connection is cut. A client
that goes away closes the upstream connection, so the server aborts the request as it would
without the proxy. An HTTP/1.0 client's request goes upstream as HTTP/1.0 on a connection of its
own (no chunked answer can reach it). A request llhttp refuses, whose end would be ambiguous
(RFC 9112 §6.3: a repeated ``Content-Length``, even with equal values, one beside
``Transfer-Encoding``, a bad chunk size) or that is otherwise malformed (bare LF line ends, a
space before a colon, folded header lines, an HTTP version but 1.0 and 1.1, a transfer coding
but chunked), is answered 400, a head still unfinished after 64 KiB 431, and a body over 1 GiB
413; each is logged (``refused a request from ...``) and its connection closed after the requests
before it are answered. There is no read timeout: a client that stalls mid-request holds only its
own connection. SIGTERM or SIGINT closes the listener and every connection, and the process
exits 0.

The modules: ``http`` (messages, read by llhttp), ``upstream`` (the pooled upstream connections),
``relay`` (client connections and what every policy shares), one module per policy
(``roundrobin``, ``disagg_v0``, ``disagg_v1``) and ``cli``.
"""
