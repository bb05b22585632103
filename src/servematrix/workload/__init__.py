"""The cell's requests: one list, built before the clock starts, that every backend sends.

`build_requests` turns a `matrix.Workload` into the warm-up requests (request ids 0..W-1,
``scheduled_s`` 0.0: they are sent one at a time before the benchmark clock starts) followed
by the measured ones (ids W..W+N-1, sent at the seeded ``schedule.arrival_times``; ``qps: inf``
puts them all at t = 0). The load generator sends these prompts, the emulator serves them and
the simulator replays their lengths (`request_lengths`, which skips building prompts).
``max_concurrency`` is not applied here: the client (and the simulator standing in for it)
holds a request until a slot is free.

The datasets are `servematrix.workload.datasets`, one module each behind one registry.
Every draw is seeded by the workload's seed, and the measured requests come first in each
stream, so they do not change with ``warmup_requests``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from servematrix.workload import replay, sessions
from servematrix.workload.datasets import dataset_of
from servematrix.workload.datasets.base import Dataset, Entry
from servematrix.workload.datasets.base import WorkloadError as WorkloadError
from servematrix.workload.datasets.mooncake import trace_window
from servematrix.workload.datasets.random_ids import RandomIds
from servematrix.workload.datasets.sonnet import SONNET_BASE_PROMPT as SONNET_BASE_PROMPT
from servematrix.workload.definition import Workload
from servematrix.workload.schedule import arrival_times

RANDOM = RandomIds()
"""A sessions workload's warm-ups are random requests of a first turn's lengths."""

_APPROXIMATE_TOKEN = re.compile(r"[^\W\d_]+|\d|[^\w\s]|_|\n")


@dataclass(frozen=True)
class RequestSpec:
    """One request as the client sends it.

    ``prompt`` is token ids (random dataset, jsonl length lines) or text; ``input_len`` is its
    length in tokens (exact for ids, counted with the `TokenCounter` for text);
    ``output_len`` is the ``max_tokens`` sent. A session's later turn
    (`servematrix.workload.sessions`) has ``after_id``, the request it follows: it is sent
    ``think_s`` after that one's answer ends, and its ``scheduled_s`` is only known then.
    """

    request_id: int
    warmup: bool
    scheduled_s: float
    prompt: list[int] | str
    input_len: int
    output_len: int
    after_id: int | None = None
    think_s: float = 0.0


@dataclass(frozen=True)
class RequestLengths:
    """Input and output lengths of every request, indexed by request id (warm-ups first).

    ``text_prompt`` tells which prompts are text, not token ids (empty: none are);
    ``shared_prefix_tokens`` is how many tokens every prompt starts with in common (the sonnet
    dataset's chat-template head, base prompt and prefix lines; a random prompt's system
    prompt; 0: none, as random ids); ``prefix_groups`` which of the workload's system prompts
    each request starts with (empty: all share the one prefix).
    ``prefix_chains`` (mooncake only) are each prompt's prefix-cache segment keys, one per
    512-token block (`replay.engine_chains`); ``trace`` its window."""

    input_lens: list[int]
    output_lens: list[int]
    text_prompt: list[bool] = field(default_factory=list)
    shared_prefix_tokens: int = 0
    prefix_chains: list[tuple[int, ...]] = field(default_factory=list)
    trace: replay.TraceWindow | None = None
    prefix_groups: list[int] = field(default_factory=list)


class TokenCounter:
    """Counts the tokens of text prompts as the server will, or approximates them.

    With a Hugging Face ``tokenizer.json`` (read by the ``tokenizers`` package) a count is
    ``len(encode(text, add_special_tokens=True))``, what vLLM's server reports as
    ``prompt_tokens`` for a text prompt. Without one, the **approximation** counts one token
    per run of letters, per digit, per other non-space character and per line break: close
    to a BPE tokenizer on plain English words, short of it on rare or long words that BPE
    splits. It has not been calibrated against a real tokenizer; give the model's tokenizer
    for lengths that matter.
    """

    def __init__(self, description: str, tokenizer: Any = None, chat_template: Any = None):
        self.description = description
        self._tokenizer = tokenizer
        self._chat_template = chat_template

    @classmethod
    def approximate(cls) -> TokenCounter:
        return cls(
            "approximation (one token per word, digit, symbol and line break; no chat template)"
        )

    @classmethod
    def from_file(cls, tokenizer_json: str | os.PathLike[str]) -> TokenCounter:
        """A tokenizer file; a ``tokenizer_config.json`` next to it may bring a chat template."""
        from tokenizers import Tokenizer  # here: only text datasets need it

        path = Path(tokenizer_json)
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the tokenizers package raises plain Exception
            raise WorkloadError(f"tokenizer file {path}: cannot be read ({error})") from error
        template = _chat_template(path.parent / "tokenizer_config.json")
        suffix = " with its chat template" if template else ""
        return cls(f"tokenizer {path}{suffix}", tokenizer, template)

    @classmethod
    def for_model(cls, model_dir_or_name: str | None) -> TokenCounter:
        """The model's tokenizer if one is on this machine, else the approximation.

        Looks in a local model directory (``<dir>/tokenizer.json``) or, for a Hugging Face id,
        in the local hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or
        ``~/.cache/huggingface/hub``); it never downloads.
        """
        found = _local_tokenizer(model_dir_or_name) if model_dir_or_name else None
        return cls.from_file(found) if found else cls.approximate()

    def count(self, text: str) -> int:
        return len(self.tokens(text))

    @property
    def can_decode(self) -> bool:
        """Whether token ids can be turned back into text (a real tokenizer, not the
        approximation)."""
        return self._tokenizer is not None

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (special tokens kept as their text)."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def tokens(self, text: str) -> list[int] | list[str]:
        """The prompt's tokens as counted: the tokenizer's ids, or the approximation's pieces
        (the emulator's prefix cache compares prompts by them)."""
        if self._tokenizer is None:
            return _APPROXIMATE_TOKEN.findall(text)
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def format(self, prompt: str) -> str:
        """``prompt`` as one user message in the chat template (unchanged without one)."""
        if self._chat_template is None:
            return prompt
        return self._chat_template.render(
            messages=[{"role": "user", "content": prompt}], add_generation_prompt=True
        )


def _chat_template(config_path: Path) -> Any:
    """The Jinja chat template of a ``tokenizer_config.json``, rendered as transformers does
    (sandboxed, trimmed blocks); None when there is none."""
    if not config_path.is_file():
        return None
    try:
        data = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise WorkloadError(f"tokenizer config {config_path}: not valid JSON ({error})") from error
    template = data.get("chat_template") if isinstance(data, dict) else None
    if not isinstance(template, str):
        return None
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise WorkloadError(f"chat template of {config_path}: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    specials = {
        key: value
        for key, value in data.items()
        if key in ("bos_token", "eos_token") and isinstance(value, str)
    }
    return env.from_string(template, globals=specials)


def _local_tokenizer(model: str) -> Path | None:
    local = Path(model) / "tokenizer.json"
    if local.is_file():
        return local
    if "/" not in model or model.startswith((".", "/")):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    snapshots = Path(hub) / f"models--{model.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/tokenizer.json")) if snapshots.is_dir() else []
    return found[-1] if found else None


def build_requests(
    workload: Workload, vocab_size: int, tokenizer: TokenCounter | None = None
) -> list[RequestSpec]:
    """Every request of the cell, warm-ups first, deterministic for the workload's seed.

    ``vocab_size`` bounds the random token ids; ``tokenizer`` counts text prompts (None: the
    approximation of `TokenCounter`).
    """
    if vocab_size < 1:
        raise WorkloadError(f"vocab_size must be >= 1, got {vocab_size}")
    if workload.sessions is not None:
        return _session_specs(workload, vocab_size)
    entries = _entries(workload, tokenizer, vocab_size)
    return _specs(workload, entries)


def request_lengths(workload: Workload, tokenizer: TokenCounter | None = None) -> RequestLengths:
    """The lengths `build_requests` would give each request, without building random prompts
    (what the simulator needs, at a fraction of the cost)."""
    if workload.sessions is not None:
        turns = session_plan(workload)
        warm = RANDOM.entries(
            replace(workload, num_prompts=0), workload.warmup_requests, None, None
        )
        return RequestLengths(
            [e.input_len for e in warm] + [t.input_len for t in turns],
            [e.output_len for e in warm] + [t.output_len for t in turns],
        )
    dataset = dataset_of(workload.dataset)
    entries = _entries(workload, tokenizer, None)
    ordered = _warmups_first(workload, entries)
    text = [isinstance(entry.prompt, str) for entry in ordered]
    shared = dataset.shared_prefix_tokens(workload, _counter(dataset, tokenizer))
    shared = min(shared, min(entry.input_len for entry in ordered)) if shared else 0
    trace = trace_window(workload) if dataset.REPLAYS_TRACE else None
    groups = [entry.prefix_group for entry in ordered] if workload.prefix_groups > 1 else []
    return RequestLengths(
        [entry.input_len for entry in ordered],
        [entry.output_len for entry in ordered],
        text if any(text) else [],
        shared,
        replay.engine_chains(trace.requests) if trace else [],
        trace,
        groups,
    )


def measured_sends(workload: Workload) -> np.ndarray:
    """When each measured request is sent (s from the benchmark start): the trace's scaled
    timestamps for a replay at ``trace_timing: timestamps``, else the seeded
    `schedule.arrival_times` (for sessions: of each user's first turn)."""
    w = workload
    if dataset_of(w.dataset).REPLAYS_TRACE and w.trace_timing == "timestamps":
        return np.array(replay.send_times(trace_window(w).requests, w.qps))
    count = w.num_prompts if w.sessions is None else w.sessions.users  # first turns only
    return arrival_times(count, w.qps, w.burstiness, w.seed)


def _specs(workload: Workload, entries: list[Entry]) -> list[RequestSpec]:
    w = workload
    sends = measured_sends(w).tolist()
    scheduled = [0.0] * w.warmup_requests + sends
    return [
        RequestSpec(
            request_id=k,
            warmup=k < w.warmup_requests,
            scheduled_s=scheduled[k],
            prompt=entry.prompt if entry.prompt is not None else [],
            input_len=entry.input_len,
            output_len=entry.output_len,
        )
        for k, entry in enumerate(_warmups_first(workload, entries))
    ]


def session_plan(workload: Workload) -> list[sessions.Turn]:
    """The measured turns of a sessions workload (`servematrix.workload.sessions.plan`)."""
    assert workload.sessions is not None
    w = workload
    return sessions.plan(w.sessions, w.input_len, w.output_len, w.range_ratio, w.seed)


def _session_specs(workload: Workload, vocab_size: int) -> list[RequestSpec]:
    """Warm-ups as independent random requests of a first turn's lengths, then the turns:
    first turns at the arrival schedule, later ones after the turn they follow."""
    w = workload
    turns = session_plan(w)
    warm = RANDOM.entries(replace(w, num_prompts=0), w.warmup_requests, None, vocab_size)
    firsts = iter(arrival_times(w.sessions.users, w.qps, w.burstiness, w.seed).tolist())
    specs = [
        RequestSpec(k, True, 0.0, entry.prompt or [], entry.input_len, entry.output_len)
        for k, entry in enumerate(warm)
    ]
    for turn, prompt in zip(turns, sessions.prompts(turns, vocab_size, w.seed), strict=True):
        after = None if turn.after is None else turn.after + w.warmup_requests
        specs.append(
            RequestSpec(
                request_id=len(specs),
                warmup=False,
                scheduled_s=next(firsts) if after is None else math.nan,
                prompt=prompt,
                input_len=turn.input_len,
                output_len=turn.output_len,
                after_id=after,
                think_s=turn.think_s,
            )
        )
    return specs


def _warmups_first(workload: Workload, entries: list[Entry]) -> list[Entry]:
    """Datasets draw the measured requests first (so they do not depend on the number of
    warm-ups), then the warm-ups; requests are numbered warm-ups first."""
    n = workload.num_prompts
    return entries[n:] + entries[:n]


def _entries(
    workload: Workload, tokenizer: TokenCounter | None, vocab_size: int | None
) -> list[Entry]:
    dataset = dataset_of(workload.dataset)
    count = workload.num_prompts + workload.warmup_requests
    return dataset.entries(workload, count, _counter(dataset, tokenizer), vocab_size)


def _counter(dataset: Dataset, tokenizer: TokenCounter | None) -> TokenCounter | None:
    """The tokenizer given, else the approximation for a dataset of text prompts."""
    return tokenizer or (TokenCounter.approximate() if dataset.TOKENIZED else None)


def check_dataset(w: Workload) -> None:
    """Read the workload's dataset file as a cell would, raising WorkloadError (naming the file
    and, for jsonl, the line) for what would stop the cell: before any job, not inside one."""
    dataset_of(w.dataset).check(w)
