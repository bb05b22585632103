"""Interruptions: a measured cell's second stop signal is taken silently; Ctrl-C of a report is
one line and leaves no half-written report."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

from servematrix.backends import served
from servematrix.workflow import requested_report


def _run_pending_handlers() -> None:
    """Python runs a signal's handler between bytecodes, soon after the signal arrives."""
    for _ in range(1000):
        pass


def test_a_sigterm_pending_behind_ctrl_c_prints_nothing(monkeypatch):
    """Ctrl-C of a measured cell: SIGINT from the terminal and SIGTERM from Snakemake reach the
    job together. The first interrupts the cell; the second used to print CPython's
    ``OSError: Signal 15 ignored due to race condition`` (its handler had become SIG_IGN)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    previous = {sig: signal.signal(sig, served._on_stop_signal) for sig in served.STOP_SIGNALS}
    try:
        # Both pending on this thread at once (a process-directed signal could land on another
        # thread, a library's worker, and its handler run at once).
        signal.pthread_sigmask(signal.SIG_BLOCK, served.STOP_SIGNALS)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="signal SIGINT"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, served.STOP_SIGNALS)  # both arrive now
            _run_pending_handlers()
        _run_pending_handlers()  # the pending SIGTERM's turn
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, served.STOP_SIGNALS)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        served._stopped_by.clear()
    assert [str(hook.exc_value) for hook in unraisable] == []


@pytest.mark.parametrize(
    ("argv", "report"),
    [
        (["snakemake", "--report", "results/r.zip"], "results/r.zip"),
        (["snakemake", "--report=results/r.zip"], "results/r.zip"),
        (["snakemake", "--report"], "report.html"),
        (["snakemake", "--report", "--cores", "1"], "report.html"),
        (["snakemake", "--report", "r.html", "--report-after-run", "all"], None),
        (["snakemake", "--cores", "1", "all"], None),
    ],
)
def test_the_requested_report_is_read_as_snakemake_reads_it(argv, report):
    assert requested_report(argv) == report


def _interrupt_a_report(tmp_path, report: str, written: str | None) -> subprocess.CompletedProcess:
    """A process that asks for ``report`` (the handler installed), writes ``written`` into it
    as Snakemake would have begun to, then gets Ctrl-C."""
    lines = [
        "import os, pathlib, signal, time",
        "from servematrix.workflow import stop_report_on_interrupt",
        f"stop_report_on_interrupt({report!r})",
        f"pathlib.Path({report!r}).write_text({written!r})" if written else "",
        "os.kill(os.getpid(), signal.SIGINT)",
        "time.sleep(60)",
    ]
    code = "\n".join(lines)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_ctrl_c_of_a_report_is_one_line_and_removes_what_it_began(tmp_path):
    run = _interrupt_a_report(tmp_path, "report.zip", "PK half a zip")
    assert run.returncode == 130
    assert run.stderr == "servematrix: interrupted; the report report.zip was not written\n"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_the_report_is_written_leaves_the_last_one(tmp_path):
    (tmp_path / "report.html").write_text("the last run's report")
    run = _interrupt_a_report(tmp_path, "report.html", None)
    assert run.returncode == 130
    assert (tmp_path / "report.html").read_text() == "the last run's report"
