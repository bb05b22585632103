"""Lines a person at the terminal must see, not only a job's log file.

A job's log records go to its log file (``workflow.log_to``, ``workflow.in_process_job``); the
records marked here (and every warning) go to the terminal as well: what a job is waiting
for, for how long, and a step-time fallback. ``log.info(message, extra=TERMINAL)`` marks a record.
"""

from __future__ import annotations

import logging

TERMINAL = {"terminal": True}
WAIT_REPORT_S = 15.0
"""How often a wait says it is still waiting (it says so at once when it starts)."""


def for_terminal(record: logging.LogRecord) -> bool:
    """A warning or worse, or a record marked with ``extra=TERMINAL``."""
    return record.levelno >= logging.WARNING or bool(getattr(record, "terminal", False))
