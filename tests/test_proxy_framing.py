"""The proxies' HTTP/1.1 framing (llhttp, through httptools): adversarial requests over real
sockets get a 400 (or 431) and a closed connection, never a wait; and the readers find every
message's end across any split of its bytes. Every read is bounded by a socket timeout, so a
hang fails the test instead of stalling it; no test asserts on timing."""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servematrix.proxy.http import MAX_HEAD_BYTES, RequestReader, ResponseReader
from tests.proxy_helpers import processes, raw_exchange, received

BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2, "stream": False}).encode()
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
CHUNKED_200 = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def until_closed(_: bytes) -> bool:
    return False  # read until the proxy closes the connection


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A round-robin proxy in front of one fixed-latency server: (proxy URL, server URL)."""
    with processes(tmp_path_factory.mktemp("framing")) as procs:
        a = procs.fixed_server("a")
        yield procs.proxy("proxy", "round-robin", "--upstream", a), a


@pytest.mark.parametrize(
    ("head_and_body", "reason"),
    [
        # The body's end is ambiguous: the old parser kept the last value and waited for
        # 27 bytes that never came. llhttp refuses repeated ones even when equal.
        (b"Content-Length: 3\r\nContent-Length: 30\r\n\r\nabc", b"Duplicate Content-Length"),
        (b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc", b"Duplicate Content-Length"),
        (
            b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            b"Transfer-Encoding can't be present with Content-Length",
        ),
        (b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", b"chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n", b"chunk size"),
        (b"Transfer-Encoding: chunked\r\n\r\n1ffffffffffffffff\r\n", b"Chunk size overflow"),
        (b"Transfer-Encoding: gzip\r\n\r\nabc", b"only a chunked or a Content-Length body"),
        (b"Content-Length: 3x\r\n\r\nabc", b"Content-Length"),
        (b"Content-Length : 3\r\n\r\nabc", b"header field char"),  # space before :
        (b"X-Folded: a\r\n b\r\nContent-Length: 3\r\n\r\nabc", b"whitespace"),  # obs-fold
    ],
)
def test_ambiguous_framing_is_a_400_and_a_closed_connection(
    proxy: tuple[str, str], head_and_body: bytes, reason: bytes
) -> None:
    url, server = proxy
    before = len(received(server))
    got = raw_exchange(url, POST + head_and_body, until_closed)
    assert got.startswith(b"HTTP/1.1 400 Bad Request"), got
    assert b"Connection: close" in got
    assert reason in got, got
    assert len(received(server)) == before  # nothing reached the upstream


def test_bare_lf_line_ends_and_unknown_versions_are_refused(proxy: tuple[str, str]) -> None:
    url, _ = proxy
    got = raw_exchange(url, b"GET /health HTTP/1.1\nHost: x\n\n", until_closed)
    assert got.startswith(b"HTTP/1.1 400 Bad Request"), got
    got = raw_exchange(url, b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", until_closed)
    assert got.startswith(b"HTTP/1.1 400 Bad Request"), got
    assert b"unsupported version HTTP/2.0" in got


def test_a_good_request_then_garbage_gets_its_answer_then_a_400(proxy: tuple[str, str]) -> None:
    url, _ = proxy
    good = POST + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    got = raw_exchange(url, good + b"NONSENSE\r\n\r\n", until_closed)
    first, _, rest = got.partition(b"HTTP/1.1 400 Bad Request")
    assert first.startswith(b"HTTP/1.1 200 OK") and b'"model": "a"' in first, got
    assert b"malformed request" in rest


def test_a_truncated_body_reaches_no_upstream(proxy: tuple[str, str]) -> None:
    """The client sends 10 of 100 bytes and half-closes: the proxy closes too, unanswered."""
    url, server = proxy
    before = len(received(server))
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(POST + b"Content-Length: 100\r\n\r\n" + BODY[:10])
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""  # closed, nothing sent; a hang is a socket timeout
    assert len(received(server)) == before


def test_an_endless_head_is_a_431_at_its_bound(proxy: tuple[str, str]) -> None:
    """Slowloris by size: a header line that never ends is refused once the head passes
    ``MAX_HEAD_BYTES``, whatever the reads' sizes. (The proxy has no head timeout: a client that
    stalls mid-head holds only its own connection, as the next test shows.)"""
    url, _ = proxy
    host, port = url.removeprefix("http://").split(":")
    line = b"X-Long: " + b"a" * MAX_HEAD_BYTES  # no CRLF: the head goes on
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # All of it, and no more: bytes still unread when the proxy closes would reset the
        # connection before its answer could be read.
        sock.sendall(POST + line)
        got = b""
        while more := sock.recv(65536):
            got += more
    assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), got


def test_a_stalled_head_holds_only_its_own_connection(proxy: tuple[str, str]) -> None:
    url, _ = proxy
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as stalled:
        stalled.sendall(POST + b"Content-Len")  # and nothing more
        good = POST + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
        assert raw_exchange(url, good).startswith(b"HTTP/1.1 200 OK")
        # A head that arrives a byte at a time is still one request.
        stalled.sendall(b"gth: %d\r\n\r\n" % len(BODY))
        for byte in BODY:
            stalled.sendall(bytes([byte]))
        got = b""
        while b'"model": "a"' not in got:
            got += stalled.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 OK"), got


def cut(wire: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(c for c in cuts if c < len(wire)), len(wire)]
    return [wire[a:b] for a, b in itertools.pairwise(points)]


@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    extension=st.booleans(),
)
def test_requests_are_found_across_any_split(
    chunks: list[bytes], cuts: list[int], extension: bool
) -> None:
    ext = b";x=1" if extension else b""
    framed = b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c in chunks)
    chunked = POST + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\nT: t\r\n\r\n"
    plain = POST + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    reader = RequestReader()
    for piece in cut(chunked + plain, cuts):
        reader.feed(piece)
    assert reader.refusal is None
    assert [r.body for r in reader.ready] == [b"".join(chunks), BODY]
    assert reader.ready[0].forward == [] and reader.ready[0].fields[b"transfer-encoding"]


@given(
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_a_chunked_response_is_relayed_whole_across_any_split(
    chunks: list[bytes], cuts: list[int]
) -> None:
    """The relayed bytes are a chunked body of the same payload, and what follows the
    response's end (here the start of another) is noticed, not relayed."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    framed = b"".join(b"%x;e=1\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\nT: t\r\n\r\n"
    reader = ResponseReader(head_only=False, keep_payload=False)
    relayed = b"".join(reader.feed(piece) for piece in cut(head + framed + b"HTTP/1.1", cuts))
    assert reader.done and reader.chunked and reader.extra
    assert reader.status == 200 and reader.lines[0] == b"Content-Type: text/event-stream"
    again = ResponseReader(head_only=False, keep_payload=True)
    again.feed(head + relayed)
    assert again.done and not again.extra and bytes(again.payload) == b"".join(chunks)


def test_a_head_answer_ends_at_its_head() -> None:
    reader = ResponseReader(head_only=True, keep_payload=False)
    assert reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 42\r\n\r\n") == b""
    assert reader.done and not reader.extra and reader.keep_alive
    interim = ResponseReader(head_only=False, keep_payload=False)
    interim.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n")
    assert interim.status == 201 and not interim.done
    assert interim.feed(b"{}") == b"{}" and interim.done


@pytest.mark.parametrize("line", [b"zz\r\n", b"\r\n", b"-1\r\n"])
def test_a_bad_chunk_size_line_is_refused(line: bytes) -> None:
    reader = RequestReader()
    reader.feed(POST + b"Transfer-Encoding: chunked\r\n\r\n" + line)
    assert reader.refusal is not None and reader.refusal[0] == 400
    assert not reader.ready
    response = ResponseReader(False, False)
    response.feed(CHUNKED_200 + line)
    assert "malformed response" in str(response.error) and not response.done
