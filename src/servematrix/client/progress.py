"""The load generator's progress line: done / failed / elapsed / achieved rate.

Off a terminal (a workflow's cell, its output captured) the line is a log record marked for
the terminal (`servematrix.common.terminal`): a cell's job log gets it, and so does the person
watching Snakemake.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TextIO

from servematrix.common.terminal import TERMINAL

log = logging.getLogger("servematrix.client.loadgen")


class Progress:
    """Done / failed / elapsed / achieved rate of the measured requests.

    On a terminal: one line on stderr, redrawn a few times a second. Otherwise: a log line every
    ``log_interval_s``. Requests only bump counters; a periodic task does the printing.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        tty: bool | None = None,
        log_interval_s: float = 5.0,
        label: str = "requests",
    ):
        self.total = total
        self.done = 0
        self.failed = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval_s = 0.2 if self.tty else log_interval_s
        self.label = label
        self._start = time.monotonic()

    def finished(self, success: bool) -> None:
        self.done += 1
        self.failed += not success

    def start(self) -> None:
        self._start = time.monotonic()

    def line(self) -> str:
        elapsed = time.monotonic() - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (
            f"{self.done}/{self.total} done, {self.failed} failed, "
            f"{elapsed:.1f} s, {rate:.2f} req/s"
        )

    def report(self) -> None:
        if self.tty:
            width = 20
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{bar}] {self.line()}\x1b[K")
            self.stream.flush()
        else:
            log.info("%s: %s", self.label, self.line(), extra=TERMINAL)

    def close(self) -> None:
        self.report()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.report()
