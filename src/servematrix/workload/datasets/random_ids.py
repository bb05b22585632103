"""The ``random`` dataset: exact token ids, so the server counts exactly ``input_len`` prompt
tokens. With ``range_ratio`` r the input and output lengths are drawn uniformly from the
integers in [floor(len·(1−r)), ceil(len·(1+r))] (at least 1), as ``vllm bench serve
--random-range-ratio``. Ids are uniform in [0, vocab_size): pass the tokenizer's regular
vocabulary size so no special token is drawn. With ``prefix_len`` every prompt starts with one
of ``prefix_groups`` system prompts (vLLM's ``prefix_repetition`` shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from servematrix.workload.datasets.base import (
    GROUP_STREAM,
    IDS_STREAM,
    INPUT_STREAM,
    OUTPUT_STREAM,
    PREFIX_STREAM,
    Entry,
    rng,
    token_ids,
)
from servematrix.workload.sessions import spread

if TYPE_CHECKING:
    from servematrix.workload import TokenCounter
    from servematrix.workload.definition import Workload


class RandomIds:
    NAME = "random"
    READS_FILE = False
    TOKENIZED = False
    DRAWS_LENGTHS = True
    SHARES_PREFIX = True
    GROUPS_PREFIXES = True
    REPLAYS_TRACE = False

    def entries(
        self, w: Workload, count: int, counter: TokenCounter | None, vocab_size: int | None
    ) -> list[Entry]:
        inputs = spread(rng(w.seed, INPUT_STREAM), w.input_len, w.range_ratio, count)
        outputs = spread(rng(w.seed, OUTPUT_STREAM), w.output_len, w.range_ratio, count)
        if w.prefix_len:
            return _with_system_prompts(w, inputs, outputs, vocab_size)
        if vocab_size is None:
            return [Entry(None, i, o) for i, o in zip(inputs, outputs, strict=True)]
        prompts = token_ids(rng(w.seed, IDS_STREAM), vocab_size, inputs)
        return [Entry(p, i, o) for p, i, o in zip(prompts, inputs, outputs, strict=True)]

    def shared_prefix_tokens(self, w: Workload, counter: TokenCounter) -> int:
        return w.prefix_len

    def check(self, w: Workload) -> None:
        """Nothing to read."""


def _with_system_prompts(
    w: Workload, inputs: list[int], outputs: list[int], vocab_size: int | None
) -> list[Entry]:
    """Random prompts that start with one of ``prefix_groups`` system prompts of
    ``prefix_len`` random tokens each (drawn uniformly per request), then random tokens up to
    the request's input length: the shape of vLLM's ``prefix_repetition`` dataset."""
    groups = rng(w.seed, GROUP_STREAM).integers(0, w.prefix_groups, len(inputs)).tolist()
    if vocab_size is None:
        return [Entry(None, i, o, g) for i, o, g in zip(inputs, outputs, groups, strict=True)]
    prefixes = token_ids(rng(w.seed, PREFIX_STREAM), vocab_size, [w.prefix_len] * w.prefix_groups)
    suffixes = token_ids(rng(w.seed, IDS_STREAM), vocab_size, [i - w.prefix_len for i in inputs])
    return [
        Entry(prefixes[g] + s, i, o, g)
        for s, i, o, g in zip(suffixes, inputs, outputs, groups, strict=True)
    ]
