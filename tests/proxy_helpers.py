"""Processes for the proxy tests: start, wait for health, stop; nothing outlives a test."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXED_SERVER = ROOT / "benchmarks" / "fixed_latency_server.py"
PROXY = [sys.executable, "-m", "servematrix.proxy"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Processes:
    """The processes a test started, each logging to a file under ``log_dir``."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        health_url: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.running[name] = process
        if health_url:
            self.wait_healthy(name, health_url, timeout_s)
        return process

    def wait_healthy(self, name: str, url: str, timeout_s: float = 60.0) -> None:
        process = self.running[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with {process.returncode}:\n{self.log(name)}")
            if get(url + "/health")[0] == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"{name} never became healthy:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def fixed_server(self, name: str, *flags: str) -> str:
        """A ``benchmarks/fixed_latency_server.py`` with engine id ``name``; returns its URL."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, str(FIXED_SERVER), "--port", str(port), "--name", name, *flags]
        self.start(name, argv, url)
        return url

    def proxy(self, name: str, kind: str, *flags: str, wait: bool = True) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.start(name, [*PROXY, kind, "--port", str(port), *flags], url if wait else None)
        return url

    def stop_all(self) -> None:
        for process in self.running.values():
            if process.poll() is None:
                process.terminate()
        for process in self.running.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def processes(log_dir: Path) -> Iterator[Processes]:
    group = Processes(log_dir)
    try:
        yield group
    finally:
        group.stop_all()


def wait_listening(url: str, timeout_s: float = 30.0) -> None:
    """Until ``url`` answers HTTP at all (``/health`` with any status)."""
    deadline = time.monotonic() + timeout_s
    while get(url + "/health")[0] == 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens at {url}")
        time.sleep(0.05)


def get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def post(
    url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def received(url: str) -> list[dict[str, Any]]:
    """The completion requests a fixed-latency server has received."""
    status, body = get(url + "/requests")
    assert status == 200
    return json.loads(body)


def raw_exchange(url: str, data: bytes, done: Callable[[bytes], bool] | None = None) -> bytes:
    """Send ``data`` on one connection; read until ``done(what came)`` (by default: one
    response with a ``Content-Length`` body, complete) or the connection's end."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        got = b""
        while not (done or _one_response)(got):
            more = sock.recv(65536)
            if not more:
                break
            got += more
        return got


def _one_response(got: bytes) -> bool:
    head, _, body = got.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False
