"""What a backend hands back, and how a cell fails on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servematrix.spec.trace import RequestRecord


class CellError(RuntimeError):
    """A cell could not be measured (its deployment failed, its server never answered)."""


@dataclass
class BackendRun:
    """What a backend hands back: the requests as seen, and how it was set up."""

    records: list[RequestRecord]
    deployment: dict[str, Any]
