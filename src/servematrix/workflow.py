"""Glue between Snakemake and the package: clean config errors and script logging."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from servematrix.config import ConfigError


@contextlib.contextmanager
def fail_on_config_error() -> Iterator[None]:
    """Turn a ConfigError into one line on stderr and exit 1, instead of a Snakemake traceback."""
    try:
        yield
    except ConfigError as error:
        print(f"servematrix: {error}", file=sys.stderr)
        sys.stderr.flush()
        sys.exit(1)


def log_to(path: str) -> logging.Logger:
    """Send the package's log records (and warnings) to a job's Snakemake log file."""
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    logger = logging.getLogger("servematrix")
    previous_hook = sys.excepthook

    def log_uncaught(kind, error, tb):
        # The job's own log must say why it failed, not only Snakemake's console.
        logger.error("job failed: %s", error, exc_info=(kind, error, tb))
        previous_hook(kind, error, tb)

    sys.excepthook = log_uncaught
    return logger
