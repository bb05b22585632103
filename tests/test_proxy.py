"""The proxies as processes, against real fixed-latency servers over real HTTP."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servematrix.proxy.http import UpstreamError, with_members
from tests.proxy_helpers import (
    PROXY,
    ROOT,
    Processes,
    free_port,
    get,
    post,
    processes,
    raw_exchange,
    received,
    wait_listening,
)

STREAM = {"model": "m", "prompt": "hello", "max_tokens": 3, "stream": True}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with processes(tmp_path) as group:
        yield group


def events(body: bytes) -> list[bytes]:
    return [event for event in body.split(b"\n\n") if event]


def test_round_robin_strict_cycle_only_posts_advance_it(procs: Processes) -> None:
    a, b = procs.fixed_server("a"), procs.fixed_server("b")
    proxy = procs.proxy("proxy", "round-robin", "--upstream", a, "--upstream", b)
    served = []
    for _ in range(5):
        assert get(proxy + "/v1/models")[0] == 404  # a GET: relayed, does not advance the cycle
        assert get(proxy + "/health")[0] == 200
        status, _, body = post(proxy + "/v1/completions", {**STREAM, "stream": False})
        assert status == 200
        served.append(json.loads(body)["model"])
    assert served == ["a", "b", "a", "b", "a"]
    assert (len(received(a)), len(received(b))) == (3, 2)


def test_bytes_pass_through_unchanged(procs: Processes) -> None:
    a = procs.fixed_server("a")
    proxy = procs.proxy("proxy", "round-robin", "--upstream", a)
    raw = b'{"model":"m", "prompt":"hello","max_tokens":3,  "stream":true}'
    headers = {"X-Request-Id": "run-7", "X-Custom": "kept"}
    direct = post(a + "/v1/completions", raw, headers)
    proxied = post(proxy + "/v1/completions", raw, headers)
    assert proxied[0] == direct[0] == 200
    assert proxied[2] == direct[2]
    assert events(proxied[2])[-1] == b"data: [DONE]"
    assert proxied[1]["Content-Type"] == "text/event-stream; charset=utf-8"
    last = received(a)[-1]
    assert last["body"].encode() == raw
    assert last["headers"]["X-Request-ID"] == "run-7"
    assert last["headers"]["X-Custom"] == "kept"
    # Non-streamed: same body and length; an upstream error: same status and body.
    plain = {**STREAM, "stream": False}
    assert post(proxy + "/v1/completions", plain)[2] == post(a + "/v1/completions", plain)[2]
    assert post(proxy + "/v1/completions", plain)[1]["Content-Length"] == str(
        len(post(a + "/v1/completions", plain)[2])
    )
    assert post(proxy + "/nowhere", plain)[:1] == post(a + "/nowhere", plain)[:1] == (404,)


def test_proxy_health_reports_each_upstream(procs: Processes) -> None:
    a = procs.fixed_server("a")
    gone = f"http://127.0.0.1:{free_port()}"
    proxy = procs.proxy("proxy", "round-robin", "--upstream", a, "--upstream", gone, wait=False)
    wait_listening(proxy)
    status, body = get(proxy + "/health")
    assert status == 503
    states = json.loads(body)["upstreams"]
    assert states[a] == "ok"
    assert states[gone].startswith("unreachable")


def test_v0_prefill_copy_then_original_to_decode(procs: Processes) -> None:
    prefill, decode = procs.fixed_server("p"), procs.fixed_server("d")
    proxy = procs.proxy("proxy", "disagg-v0", "--prefill", prefill, "--decode", decode)
    raw = json.dumps(STREAM).encode()
    status, _, body = post(proxy + "/v1/completions", raw, {"X-Request-Id": "r1"})
    assert status == 200
    assert body == post(decode + "/v1/completions", raw)[2]
    (copy,), first = received(prefill), received(decode)[0]
    assert json.loads(copy["body"]) == {**STREAM, "max_tokens": 1}  # stream kept, as in 0.6.x
    assert first["body"].encode() == raw
    assert copy["headers"]["X-Request-ID"] == first["headers"]["X-Request-ID"] == "r1"
    assert copy["received_ns"] < first["received_ns"]


def test_v0_failed_prefill_fails_the_request(procs: Processes) -> None:
    prefill = procs.fixed_server("p", "--fail-status", "500")
    decode = procs.fixed_server("d")
    proxy = procs.proxy("proxy", "disagg-v0", "--prefill", prefill, "--decode", decode)
    status, _, body = post(proxy + "/v1/completions", STREAM)
    assert status == 502
    message = json.loads(body)["error"]["message"]
    assert f"prefill instance {prefill}/v1/completions answered HTTP 500" in message
    assert received(decode) == []


def test_v0_unreachable_prefill_fails_the_request(procs: Processes) -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    decode = procs.fixed_server("d")
    proxy = procs.proxy("proxy", "disagg-v0", "--prefill", gone, "--decode", decode, wait=False)
    wait_listening(proxy)
    status, _, body = post(proxy + "/v1/completions", STREAM)
    assert status == 502
    assert f"prefill instance {gone}/v1/completions failed" in json.loads(body)["error"]["message"]
    assert received(decode) == []


def test_v1_waits_for_engine_id_then_sends_the_mooncake_fields(procs: Processes) -> None:
    prefill_port = free_port()
    prefill = f"http://127.0.0.1:{prefill_port}"
    decode = procs.fixed_server("d")
    proxy = procs.proxy(
        "proxy",
        "disagg-v1",
        "--prefill",
        prefill,
        str(prefill_port),
        "--decode",
        decode,
        wait=False,
    )
    wait_listening(proxy)
    assert get(proxy + "/health")[0] == 503
    assert post(proxy + "/v1/completions", STREAM)[0] == 503
    server = [sys.executable, str(ROOT / "benchmarks" / "fixed_latency_server.py")]
    procs.start(
        "p", [*server, "--port", str(prefill_port), "--name", "engine-p"], health_url=prefill
    )
    procs.wait_healthy("proxy", proxy)
    body = {**STREAM, "stream_options": {"include_usage": True}}
    status, _, answer = post(proxy + "/v1/completions", body, {"X-Request-Id": "r9"})
    assert status == 200
    assert events(answer)[-1] == b"data: [DONE]"
    (to_decode,) = received(decode)
    deadline = time.monotonic() + 10  # the prefill is fire-and-forget: it may land after
    while not received(prefill) and time.monotonic() < deadline:
        time.sleep(0.05)
    (to_prefill,) = received(prefill)
    p, d = json.loads(to_prefill["body"]), json.loads(to_decode["body"])
    transfer_id = p["kv_transfer_params"]["transfer_id"]
    assert transfer_id.startswith("xfer-")
    assert p == {
        "model": "m",
        "prompt": "hello",
        "max_tokens": 1,
        "stream": False,
        "stream_options": None,  # vLLM's proxy deletes it; null means the same to vLLM
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
        },
    }
    assert d == {
        **body,
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": prefill,
            "remote_engine_id": "engine-p",
            "transfer_id": transfer_id,
        },
    }
    assert to_prefill["headers"]["X-data-parallel-rank"] == "0"
    assert to_prefill["headers"]["X-Request-ID"] == to_decode["headers"]["X-Request-ID"] == "r9"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"a": 1, "max_tokens": 6}', {"a": 1, "max_tokens": 1, "x": {"y": None}}),
        (b"  {}\n", {"max_tokens": 1, "x": {"y": None}}),
        (b'{ "max_tokens":6 ,"x":3 } ', {"max_tokens": 1, "x": {"y": None}}),
    ],
)
def test_with_members_overrides_by_appending(raw: bytes, expected: dict) -> None:
    out = with_members(raw, {"max_tokens": 1, "x": {"y": None}})
    assert out.startswith(raw.strip()[:-1].rstrip())  # the client's bytes, unchanged, first
    assert json.loads(out) == expected


@pytest.mark.parametrize("raw", [b"", b"[1]", b'"s"', b"{"])
def test_with_members_refuses_what_is_not_an_object(raw: bytes) -> None:
    with pytest.raises(UpstreamError, match="not a JSON object"):
        with_members(raw, {"a": 1})


def test_upstream_dying_mid_stream_ends_with_an_error_event(procs: Processes) -> None:
    a = procs.fixed_server("a", "--die-after-chunks", "2")
    proxy = procs.proxy("proxy", "round-robin", "--upstream", a)
    status, _, body = post(proxy + "/v1/completions", {**STREAM, "max_tokens": 5})
    assert status == 200
    *tokens, error, done = events(body)
    assert len(tokens) == 2
    assert done == b"data: [DONE]"
    message = json.loads(error[len(b"data: ") :])["error"]["message"]
    assert message.startswith(f"upstream {a}/v1/completions failed mid-response")


def test_port_in_use_is_one_clear_line(procs: Processes) -> None:
    a = procs.fixed_server("a")
    port = a.rsplit(":", 1)[1]
    result = subprocess.run(
        [*PROXY, "round-robin", "--port", port, "--upstream", a],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert f"proxy: cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["round-robin", "--port", "1", "--upstream", "localhost:80"], "not an http://HOST:PORT"),
        (["disagg-v1", "--port", "1", "--prefill", "http://h:1", "x", "--decode", "http://h:2"],
         "--prefill http://h:1 x"),
        (["disagg-v0", "--port", "1", "--prefill", "http://h:1"], "--decode"),
    ],
)  # fmt: skip
def test_bad_command_lines_name_the_argument(argv: list[str], expected: str) -> None:
    result = subprocess.run(
        [*PROXY, *argv], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode != 0
    assert expected in result.stderr


@pytest.mark.slow
def test_proxy_overhead_benchmark_prints_its_table() -> None:
    """A smoke test of benchmarks/proxy_overhead.py: its table, not its timings."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "proxy_overhead.py"),
            "--requests",
            "8",
            "--tokens",
            "3",
            "--concurrency",
            "1,2",
            "--rounds",
            "2",
            "--first-ms",
            "1",
            "--chunk-ms",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for path in ("direct", "round-robin", "disagg-v0", "disagg-v1"):
        assert sum(line.split()[:1] == [path] for line in lines) == 2, result.stdout


def test_keep_alive_pipelining_chunked_bodies_and_100_continue(procs: Processes) -> None:
    a = procs.fixed_server("a")
    proxy = procs.proxy("proxy", "round-robin", "--upstream", a)
    plain = json.dumps({**STREAM, "stream": False}).encode()
    one = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        len(plain),
        plain,
    )
    # Two requests in one send on one connection: two answers, in order.
    got = raw_exchange(proxy, one + one, lambda got: got.count(b'"model": "a"') == 2)
    assert got.count(b"HTTP/1.1 200 OK") == 2, got
    # A chunked request body reaches the upstream whole, with a Content-Length.
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, plain[:5], len(plain) - 5, plain[5:])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert raw_exchange(proxy, head + chunked).startswith(b"HTTP/1.1 200 OK")
    last = received(a)[-1]
    assert last["body"].encode() == plain
    assert last["headers"]["Content-Length"] == str(len(plain))
    assert "Transfer-Encoding" not in last["headers"]
    # Expect: 100-continue is answered before the body is sent.
    host, port = proxy.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(plain)
        )
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(plain)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")


def test_http10_head_and_malformed_requests(procs: Processes) -> None:
    a = procs.fixed_server("a")
    rr = procs.proxy("rr", "round-robin", "--upstream", a)
    v0 = procs.proxy("v0", "disagg-v0", "--prefill", a, "--decode", a)
    body = json.dumps(STREAM).encode()
    # HTTP/1.0: no chunked framing can reach the client; the body ends with the connection.
    got = raw_exchange(
        rr, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0]
    assert b"chunked" not in head.lower()
    assert rest == post(a + "/v1/completions", body)[2]
    # HEAD /health: the status and headers, no body, and the connection stays usable.
    got = raw_exchange(
        v0,
        b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        lambda got: got.endswith(b"}"),
    )
    assert got.count(b"HTTP/1.1 200 OK") == 2
    assert got.count(b'"proxy": "disagg-v0"') == 1
    # What the disaggregated proxies do not route; what nobody can parse.
    assert post(v0 + "/v1/models", STREAM)[0] == 404
    assert get(v0 + "/v1/completions")[0] == 405
    got = raw_exchange(rr, b"NONSENSE\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400 Bad Request")
    assert b"malformed request" in got


def test_a_pooled_connection_closed_by_the_server_is_replaced(tmp_path: Path) -> None:
    """An upstream that closes a kept-alive connection when a second request arrives on it,
    without answering (a request that meets the server's keep-alive timeout): the proxy sends
    the request again on a new connection, and the client never sees the failure."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def serve_one(connection: socket.socket) -> None:
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:  # the first request (no body: a GET)
                data += connection.recv(65536)
            connection.sendall(answer)
            connection.recv(65536)  # the second: closed unanswered

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    with processes(tmp_path) as procs, listener:
        upstream = f"http://127.0.0.1:{port}"
        proxy = procs.proxy("proxy", "round-robin", "--upstream", upstream, wait=False)
        wait_listening(proxy)
        for _ in range(4):
            assert get(proxy + "/v1/models") == (200, b"{}")


def test_sigterm_ends_the_proxy_at_once_and_cleanly(procs: Processes) -> None:
    a = procs.fixed_server("a", "--chunk-ms", "1000")
    proxy = procs.proxy("proxy", "round-robin", "--upstream", a)
    host, port = proxy.removeprefix("http://").split(":")
    body = json.dumps({**STREAM, "max_tokens": 100}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 OK")  # streaming, a chunk a second for 100 s
        process = procs.running["proxy"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0  # a hang guard, not a timing claim
        while more := sock.recv(65536):
            got += more
    assert b"[DONE]" not in got, "the stream was cut, not waited for"
    assert "Traceback" not in procs.log("proxy")
