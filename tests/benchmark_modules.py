"""The benchmark scripts' modules, for tests of their pure parts: the scripts import their
sibling modules by name, so ``benchmarks/`` is on the path while they load."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(*names: str) -> list[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(BENCHMARKS))
