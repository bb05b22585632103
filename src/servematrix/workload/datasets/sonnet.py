"""The ``sonnet`` dataset: vLLM's sonnet dataset as of the published study
(``sample_sonnet_requests`` after #9235): the lines of a text file; ``avg`` tokens per line; per
request the base prompt, the first ``round((prefix_len − base)/avg)`` lines (the shared prefix,
at least none) and ``random.choices`` of the rest, up to ``round((input_len − base)/avg)``
lines, where ``base`` is the token count of the base prompt in the chat template. The prompt is
sent in the model's chat template when its ``tokenizer_config.json`` has one, as vLLM's client
sent ``prompt_formatted``; its input length is counted, so it is close to, not exactly,
``input_len``."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from servematrix.workload.datasets.base import Entry, WorkloadError, dataset_file, read_text

if TYPE_CHECKING:
    from servematrix.workload import TokenCounter
    from servematrix.workload.definition import Workload

SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"
"""vLLM's ``sample_sonnet_requests`` base prompt, verbatim."""
_PROMPT_END = "\x00"
"""Marks where the drawn lines start in a formatted sonnet prompt (no prompt contains it)."""


class Sonnet:
    NAME = "sonnet"
    READS_FILE = True
    TOKENIZED = True
    DRAWS_LENGTHS = False
    SHARES_PREFIX = True
    GROUPS_PREFIXES = False
    REPLAYS_TRACE = False

    def entries(
        self, w: Workload, count: int, counter: TokenCounter, vocab_size: int | None
    ) -> list[Entry]:
        lines, prefix, extra = _layout(w, counter)
        rng = random.Random(w.seed)  # Python's generator, as vLLM's client seeds random.seed(seed)
        entries = []
        for _ in range(count):
            prompt = counter.format(
                SONNET_BASE_PROMPT + "".join(prefix + rng.choices(lines, k=extra))
            )
            entries.append(Entry(prompt, counter.count(prompt), w.output_len))
        return entries

    def shared_prefix_tokens(self, w: Workload, counter: TokenCounter) -> int:
        """The chat template's head, the base prompt and the prefix lines, counted as the
        server counts the prompt (the drawn lines and the template's tail differ from prompt
        to prompt)."""
        _, prefix, _ = _layout(w, counter)
        formatted = counter.format(SONNET_BASE_PROMPT + "".join(prefix) + _PROMPT_END)
        return counter.count(formatted[: formatted.index(_PROMPT_END)])

    def check(self, w: Workload) -> None:
        if not read_text(dataset_file(w)).strip():
            raise WorkloadError(f"dataset file {w.dataset_path}: no text lines")


def _layout(w: Workload, counter: TokenCounter) -> tuple[list[str], list[str], int]:
    """The file's lines, the shared prefix lines, and how many lines each prompt draws."""
    path = dataset_file(w)
    lines = read_text(path).splitlines(keepends=True)
    if not any(line.strip() for line in lines):
        raise WorkloadError(f"dataset file {path}: no text lines")
    avg = sum(counter.count(line) for line in lines) / len(lines)
    base = counter.count(counter.format(SONNET_BASE_PROMPT))
    if w.input_len <= base:
        raise WorkloadError(
            f"dataset file {path}: input_len {w.input_len} must exceed the {base} tokens of "
            "the base prompt"
        )
    num_input_lines = round((w.input_len - base) / avg)
    num_prefix_lines = max(round((w.prefix_len - base) / avg), 0)
    return lines, lines[:num_prefix_lines], max(num_input_lines - num_prefix_lines, 0)
