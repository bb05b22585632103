"""Ignoring the stop signals that follow the first, without CPython's race-condition warning."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any


def _ignored(signum: int, frame: Any) -> None:
    """A later stop signal: nothing to do, the first one is already being handled."""


def ignore_further(signals: Iterable[signal.Signals]) -> None:
    """From now on, ``signals`` do nothing.

    Not ``SIG_IGN``: a signal that arrived together with the one being handled (Ctrl-C reaches
    a job from the terminal and, as SIGTERM, from Snakemake) is already pending in the
    interpreter, and CPython reports a pending signal whose handler became ``SIG_IGN`` as
    ``OSError: Signal 15 ignored due to race condition`` on stderr. A Python handler that does
    nothing takes it silently."""
    for sig in signals:
        signal.signal(sig, _ignored)
