"""Interruptions: a measured cell's second stop signal is taken silently."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from servematrix import cell


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
    previous = {sig: signal.signal(sig, cell._on_stop_signal) for sig in cell.STOP_SIGNALS}
    try:
        # Both pending on this thread at once (a process-directed signal could land on another
        # thread, a library's worker, and its handler run at once).
        signal.pthread_sigmask(signal.SIG_BLOCK, cell.STOP_SIGNALS)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="signal SIGINT"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, cell.STOP_SIGNALS)  # both arrive now
            _run_pending_handlers()
        _run_pending_handlers()  # the pending SIGTERM's turn
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, cell.STOP_SIGNALS)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        cell._stopped_by.clear()
    assert [str(hook.exc_value) for hook in unraisable] == []
