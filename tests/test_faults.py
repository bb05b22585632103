"""Faults a new user meets, against real servers: every request failing, a server that hangs
before or after it starts answering, one that drops the connection, and an output that cannot
be written. Each ends in one line naming what went wrong, and no trace unless something was
measured."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from servematrix import cli
from servematrix.backends.cell import run_cell
from servematrix.client import loadgen
from servematrix.client.progress import Progress
from servematrix.spec import config, trace
from servematrix.workload import build_requests
from tests.test_loadgen_e2e import (
    BIN,
    MODEL,
    VOCAB,
    bench,
    emulator,
    free_port,
    hanging_server,
    workload,
)
from tests.workflow_helpers import copy_workflow, snakemake

pytestmark = pytest.mark.slow

EVENT = b'data: {"choices":[{"text":"a"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'


@contextmanager
def emulator_on(port: int, *flags: str) -> Iterator[None]:
    """The emulator on a given port (a server fixed and started again where it was)."""
    process = subprocess.Popen(
        [
            *(str(BIN / "servematrix-emulator"), "serve", MODEL, "--host", "127.0.0.1"),
            *("--port", str(port), *flags),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)


def _bench(url: str, output: Path, *extra: str):
    return bench(
        *["--base-url", url, "--model", MODEL, "--num-prompts", "4", "--qps", "inf"],
        *["--input-len", "50", "--output-len", "3", "-o", str(output), *extra],
    )


def test_bench_whose_requests_all_failed_is_one_line_and_no_trace(tmp_path):
    output = tmp_path / "trace.parquet"
    with emulator("--fail-fraction", "1") as url:
        done = _bench(url, output, "--warmup-requests", "0")
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"servematrix bench: all 4 requests to {url}/v1/completions failed; first: HTTP 500: "
        "Internal server error (injected fault); no trace written"
    )
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_failed_share_is_judged_on_the_measured_requests():
    """All failed, or more than the share: the reason; otherwise (warm-ups aside) None."""
    with emulator("--fail-fraction", "0.5") as url:
        result = loadgen.run(
            loadgen.ClientSettings(url, MODEL, None),
            build_requests(workload(num_prompts=20), VOCAB),
        )
    records = result.records
    failed = sum(not r.success for r in records if not r.warmup)
    assert 0 < failed < 20
    target = f"{url}/v1/completions"
    assert loadgen.failure(records, target) is None
    assert loadgen.failure(records, target, failed / 20) is None
    assert loadgen.failure(records, target, 0.0).startswith(
        f"{failed} of 20 requests to {target} failed, more than max_failed_share 0 allows; "
        "first: HTTP 500"
    )


@contextmanager
def raw_server(answer) -> Iterator[str]:
    """An HTTP server on a bare socket: /health answers 200, a completion gets ``answer(conn)``
    (which may close the connection at any point)."""
    listening = socket.create_server(("127.0.0.1", 0))
    listening.listen(64)

    def handle(conn: socket.socket) -> None:
        with conn:
            while True:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(65536)
                    if not data:
                        return
                    request += data
                if request.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                answer(conn)
                return

    def serve() -> None:
        while True:
            try:
                conn, _ = listening.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listening.getsockname()[1]}"
    finally:
        listening.close()


def _http_500(conn: socket.socket) -> None:
    body = b'{"error": {"message": "boom"}}'
    head = f"HTTP/1.1 500 Internal Server Error\r\nContent-Length: {len(body)}\r\n\r\n"
    conn.sendall(head.encode() + body)


def _closed_before_answering(conn: socket.socket) -> None:
    pass  # the handler closes the connection


def _closed_mid_stream(conn: socket.socket) -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    conn.sendall(head + f"{len(EVENT):x}\r\n".encode() + EVENT + b"\r\n")


@pytest.mark.parametrize("client", ["aiohttp", "openai"])
@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (_http_500, "HTTP 500: boom"),
        (
            _closed_before_answering,
            "connection error: the server closed the connection before answering "
            "(ServerDisconnectedError: Server disconnected)",
        ),
        (
            _closed_mid_stream,
            "connection error: the server closed the connection after 1 token event(s) "
            "(TransferEncodingError: Not enough data to satisfy transfer length header.)",
        ),
    ],
    ids=["HTTP 500", "closed before answering", "closed mid-stream"],
)
def test_a_dropped_connection_fails_a_request_as_an_http_500_does(client, answer, error):
    """Each a failed row whose error says what happened (aiohttp's own text for a cut stream
    was "TransferEncodingError: 400, message: ...", as if the server had answered 400), each
    counted as failed, each the run's failure."""
    progress = Progress(3, tty=False)
    with raw_server(answer) as url:
        settings = loadgen.ClientSettings(url, "m", None, client=client)
        result = loadgen.run(settings, build_requests(workload(num_prompts=3), 1000), progress)
    assert [r.error for r in result.records] == [error] * 4  # the warm-up and 3 measured
    assert (progress.done, progress.failed) == (3, 3)
    completions = f"{url}/v1/completions"
    assert loadgen.failure(result.records, completions) == (
        f"all 3 requests to {completions} failed; first: {error}"
    )


def _first_chunk_then_hang(conn: socket.socket) -> None:
    _closed_mid_stream(conn)
    threading.Event().wait(60)


def test_the_first_byte_timeout_and_the_request_timeout_are_told_apart():
    w = workload(num_prompts=2, warmup_requests=0)
    with hanging_server() as url:
        silent = loadgen.run(
            loadgen.ClientSettings(url, "m", None, first_byte_timeout_s=0.5),
            build_requests(w, 1000),
        )
    with raw_server(_first_chunk_then_hang) as url:
        stalled = loadgen.run(
            loadgen.ClientSettings(url, "m", None, request_timeout_s=1, first_byte_timeout_s=0.5),
            build_requests(w, 1000),
        )
    assert [r.error for r in silent.records] == [
        "no answer within the first-byte timeout of 0.5 s"
    ] * 2
    assert [r.error for r in stalled.records] == ["timed out after 1 s"] * 2
    assert all(len(r.chunk_s) == 1 for r in stalled.records)  # the chunk before the stall


def test_a_hung_warm_up_says_it_waits_then_gives_up_in_one_line(monkeypatch, caplog):
    monkeypatch.setattr(loadgen, "WAIT_REPORT_S", 0.1)
    with (
        hanging_server() as url,
        caplog.at_level(logging.INFO, logger="servematrix.client.loadgen"),
    ):
        settings = loadgen.ClientSettings(url, "m", None, first_byte_timeout_s=1)
        with pytest.raises(loadgen.LoadgenError) as stopped:
            loadgen.run(settings, build_requests(workload(num_prompts=2), 1000))
    target = f"{url}/v1/completions"
    assert str(stopped.value) == (
        f"the warm-up request to {target} got no answer: no answer within the first-byte "
        "timeout of 1 s; no measured request was sent"
    )
    waits = [m for m in caplog.messages if m.startswith("warm-up request 0: waiting")]
    assert waits and waits[0].startswith(f"warm-up request 0: waiting for {target} to answer: ")
    assert waits[0].endswith(" s so far (gives up at 1 s without a first byte, 600 s in all)")


def test_bench_with_a_hung_warm_up_is_one_line_and_no_trace(tmp_path):
    with hanging_server() as url:
        done = _bench(url, tmp_path / "trace.parquet", "--first-byte-timeout-s", "1")
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"servematrix bench: the warm-up request to {url}/v1/completions got no answer: no "
        "answer within the first-byte timeout of 1 s; no measured request was sent"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("output", ["/proc/x.parquet", "/proc/self/no/x.parquet"])
def test_bench_to_an_output_it_cannot_write_sends_nothing(output, capsys):
    """As root ``os.access`` says /proc is writable: the check makes a file to know."""
    asked: list[int] = []
    with hanging_server(asked) as url:
        code = cli.main(["bench", "--base-url", url, "--model", "m", "-o", output])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"servematrix bench: -o {output}: cannot write in /proc")
    assert asked == []  # not even the readiness check


def _external_config(url: str) -> dict:
    return {
        "backend": "external",
        "base_url": f"{url}/v1",
        "defaults": {"num_prompts": 6, "output_len": 3, "seed": 0, "warmup_requests": 0},
        "deploy": {"startup_timeout_s": 60},
        "models": {
            "M": {
                "hf_id": MODEL,
                "architecture": "qwen2.5-7b",
                "quantization": "gptq-int4",
                "tensor_parallel": 1,
                "gpus": [[0]],
            }
        },
        "studies": {
            "s": {
                "recipe": "v0",
                "models": ["M"],
                "modes": ["single"],
                "qps": [4],
                "input_len": [100],
            }
        },
    }


def _servematrix_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("servematrix:")]


def test_a_cell_whose_requests_all_failed_fails_and_is_measured_again(tmp_path):
    """HTTP 500 to every request, no warm-up: the cell's job fails with one line naming the
    server and the first error, and writes nothing; the server fixed (same port), the next
    run measures the cell. Both runs print the cell's progress, on the terminal and in its log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = _external_config(url)
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0].path
    log = workdir / cell.replace("/cells/", "/logs/").replace(".parquet", ".log")
    with emulator_on(port, "--fail-fraction", "1"):
        failed = snakemake(workdir, "--cores", "1", cell)
    assert failed.returncode == 1
    lines = _servematrix_lines(failed.stderr)
    assert lines[-2].startswith(f"servematrix: cell {cell}: 6/6 done, 6 failed, ")
    assert lines[-1] == (
        f"servematrix: cell {cell}: all 6 requests to {url}/v1/completions failed; first: "
        "HTTP 500: Internal server error (injected fault); no trace written"
    )
    assert "Traceback" not in failed.stderr
    assert not (workdir / cell).exists()
    assert f"cell {cell}: 6/6 done, 6 failed" in log.read_text()
    with emulator_on(port):
        measured = snakemake(workdir, "--cores", "1", cell)
    assert measured.returncode == 0, measured.stderr[-3000:]
    assert all(trace.read(workdir / cell).column("success").to_pylist())
    assert any(
        line.startswith(f"servematrix: cell {cell}: 6/6 done, 0 failed, ")
        for line in measured.stderr.splitlines()
    )
    assert f"cell {cell}: 6/6 done, 0 failed" in log.read_text()


def test_summarize_on_an_old_all_failed_trace_is_one_line(tmp_path, monkeypatch):
    """A trace written before failed cells were refused: the summary fails with one
    servematrix line (Snakemake then prints its own report of the job, as for any job)."""
    port = free_port()
    cfg = _external_config(f"http://127.0.0.1:{port}")
    workdir = copy_workflow(tmp_path, cfg)
    cell = config.load(cfg).all_cells()[0]
    monkeypatch.chdir(workdir)
    with emulator_on(port, "--fail-fraction", "1"):
        run_cell(cell, cell.path, keep_failed=True)
    done = snakemake(workdir, "--cores", "1", "results/external/summary/s.parquet")
    assert done.returncode == 1
    assert _servematrix_lines(done.stderr) == [
        f"servematrix: job failed: {cell.path}: all 6 measured requests failed; first error: "
        "HTTP 500: Internal server error (injected fault)"
    ]
    assert "Traceback" not in done.stderr and "metrics.py" not in done.stderr
