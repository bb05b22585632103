"""The ``jsonl`` dataset: a user's file, one request per line: ``{"prompt": "...",
"output_len": M}`` (``output_len`` optional, default the workload's) or ``{"input_len": N,
"output_len": M}`` (sent as N random token ids, as the random dataset). Blank lines are
skipped; the file's requests are used in order and repeated from the top when the cell needs
more."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from servematrix.common.files import json_object
from servematrix.workload.datasets.base import (
    IDS_STREAM,
    Entry,
    WorkloadError,
    dataset_file,
    read_text,
    rng,
    token_ids,
)

if TYPE_CHECKING:
    from servematrix.workload import TokenCounter
    from servematrix.workload.definition import Workload


class Jsonl:
    NAME = "jsonl"
    READS_FILE = True
    TOKENIZED = True
    DRAWS_LENGTHS = False
    SHARES_PREFIX = False
    GROUPS_PREFIXES = False
    REPLAYS_TRACE = False

    def entries(
        self, w: Workload, count: int, counter: TokenCounter, vocab_size: int | None
    ) -> list[Entry]:
        rows = _rows(w)
        chosen = [rows[k % len(rows)] for k in range(count)]
        ids = iter([])
        if vocab_size is not None:
            lengths = [length for prompt, length, _ in chosen if prompt is None]
            ids = iter(token_ids(rng(w.seed, IDS_STREAM), vocab_size, lengths))
        counted: dict[str, int] = {}
        entries = []
        for prompt, input_len, output_len in chosen:
            if prompt is None:
                entries.append(Entry(next(ids, None), input_len, output_len))
                continue
            if prompt not in counted:
                counted[prompt] = counter.count(prompt)
            entries.append(Entry(prompt, counted[prompt], output_len))
        return entries

    def shared_prefix_tokens(self, w: Workload, counter: TokenCounter) -> int:
        return 0

    def check(self, w: Workload) -> None:
        _rows(w)


def _rows(w: Workload) -> list[tuple[str | None, int, int]]:
    path = dataset_file(w)
    rows = [
        _row(path, number, line, w.output_len)
        for number, line in enumerate(read_text(path).splitlines(), start=1)
        if line.strip()
    ]
    if not rows:
        raise WorkloadError(f"dataset file {path}: no requests")
    return rows


def _row(
    path: Path, number: int, line: str, default_output_len: int
) -> tuple[str | None, int, int]:
    """(prompt or None, input_len (0 for a prompt: counted later), output_len) of one line."""
    where = f"dataset file {path} line {number}"
    row = json_object(where, line, WorkloadError)
    unknown = sorted(set(row) - {"prompt", "input_len", "output_len"})
    if unknown:
        raise WorkloadError(
            f"{where}: unknown key(s) {', '.join(unknown)} (known: prompt, input_len, output_len)"
        )
    if ("prompt" in row) == ("input_len" in row):
        raise WorkloadError(f"{where}: give either a prompt or an input_len")
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: prompt must be a non-empty string")
        return prompt, 0, _positive(where, row, "output_len", default_output_len)
    if "output_len" not in row:
        raise WorkloadError(f"{where}: a line with input_len needs an output_len")
    return None, _positive(where, row, "input_len", None), _positive(where, row, "output_len", None)


def _positive(where: str, row: dict, key: str, default: int | None) -> int:
    value = row.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value
