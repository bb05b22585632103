"""What every dataset shares: the error a workload raises, one drawn request, the interface a
dataset implements (`Dataset`), and the seeded streams and file reading they draw with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from servematrix.workload import TokenCounter
    from servematrix.workload.definition import Workload

# Independent streams of one seed: lengths, output lengths and token ids never share draws.
INPUT_STREAM, OUTPUT_STREAM, IDS_STREAM = 0, 1, 2
GROUP_STREAM, PREFIX_STREAM = 3, 4
"""Random prompts with shared system prompts: which one each request starts with, and their
tokens (streams of their own, so prompts without a shared prefix stay as they were)."""


class WorkloadError(ValueError):
    """A workload that cannot be built, naming the file and line or the setting at fault."""


@dataclass(frozen=True)
class Entry:
    """One dataset draw; ``prompt`` None when only the lengths were asked for."""

    prompt: list[int] | str | None
    input_len: int
    output_len: int
    prefix_group: int = 0


class Dataset(Protocol):
    """One dataset (``workload.dataset``): what it reads and which settings apply to it.

    ``READS_FILE``: it reads ``dataset_path`` (a file the config must name). ``TOKENIZED``:
    its prompts are text, counted with the served model's tokenizer (token-id prompts need
    none). ``DRAWS_LENGTHS``: lengths are drawn around ``input_len``/``output_len`` with
    ``range_ratio``, known before any job, and sessions can draw their turns the same way.
    ``SHARES_PREFIX``: ``prefix_len`` gives every prompt a shared start; ``GROUPS_PREFIXES``:
    ``prefix_groups`` of them. ``REPLAYS_TRACE``: it replays a trace (its timing settings
    apply)."""

    NAME: str
    READS_FILE: bool
    TOKENIZED: bool
    DRAWS_LENGTHS: bool
    SHARES_PREFIX: bool
    GROUPS_PREFIXES: bool
    REPLAYS_TRACE: bool

    def entries(
        self, w: Workload, count: int, counter: TokenCounter, vocab_size: int | None
    ) -> list[Entry]:
        """``count`` draws, measured requests first; prompts None without a ``vocab_size``."""
        ...

    def shared_prefix_tokens(self, w: Workload, counter: TokenCounter) -> int:
        """How many tokens every prompt starts with in common (0: none)."""
        ...

    def check(self, w: Workload) -> None:
        """Read the dataset's file as a cell would, raising `WorkloadError` for what would
        stop the cell (before any job, not inside one)."""
        ...


def rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def token_ids(generator: np.random.Generator, vocab_size: int, lengths: Sequence[int]) -> list:
    ids = generator.integers(0, vocab_size, sum(lengths))
    return [part.tolist() for part in np.split(ids, np.cumsum(lengths)[:-1])]


def dataset_file(w: Workload) -> Path:
    if not w.dataset_path:
        raise WorkloadError(f"dataset {w.dataset!r} needs a dataset_path")
    path = Path(w.dataset_path)
    if not path.is_file():
        raise WorkloadError(f"dataset file {path} does not exist")
    return path


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise WorkloadError(f"dataset file {path}: not UTF-8 text ({error})") from error
