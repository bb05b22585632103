"""The cell's requests: one list, built before the clock starts, that every backend sends.

`build_requests` turns a `matrix.Workload` into the warm-up requests (request ids 0..W-1,
``scheduled_s`` 0.0: they are sent one at a time before the benchmark clock starts) followed
by the measured ones (ids W..W+N-1, sent at the seeded ``schedule.arrival_times``; ``qps: inf``
puts them all at t = 0). The load generator sends these prompts, the emulator serves them and
the simulator replays their lengths (`request_lengths`, which skips building prompts).
``max_concurrency`` is not applied here: the client (and the simulator standing in for it)
holds a request until a slot is free.

Datasets (reference/vllm-mooncake-spec.md §3.5):

* ``random``: exact token ids, so the server counts exactly ``input_len`` prompt tokens. With
  ``range_ratio`` r the input and output lengths are drawn uniformly from the integers in
  [floor(len·(1−r)), ceil(len·(1+r))] (at least 1), as ``vllm bench serve
  --random-range-ratio``. Ids are uniform in [0, vocab_size): pass the tokenizer's regular
  vocabulary size so no special token is drawn.
* ``sonnet``: vLLM's sonnet dataset as of the published study (``sample_sonnet_requests`` after
  #9235): the lines of a text file; ``avg`` tokens per line; per request the base prompt, the
  first ``round((prefix_len − base)/avg)`` lines (the shared prefix, at least none) and
  ``random.choices`` of the rest, up to ``round((input_len − base)/avg)`` lines, where
  ``base`` is the token count of the base prompt in the chat template. The prompt is sent in
  the model's chat template when its ``tokenizer_config.json`` has one, as vLLM's client sent
  ``prompt_formatted``; its input length is counted, so it is close to, not exactly,
  ``input_len``.
* ``jsonl``: a user's file, one request per line: ``{"prompt": "...", "output_len": M}``
  (``output_len`` optional, default the workload's) or ``{"input_len": N, "output_len": M}``
  (sent as N random token ids, as the random dataset). Blank lines are skipped; the file's
  requests are used in order and repeated from the top when the cell needs more.
* ``mooncake``: a Mooncake trace (``servematrix.replay``): ``num_prompts`` requests from
  ``trace_start_s``, each sent as token ids whose 512-token blocks are equal exactly where the
  trace's hash ids are; ``input_len`` caps the input (longer requests dropped or truncated, as
  ``input_overflow`` says) and ``output_len`` the output (``max_tokens`` is the trace's output
  length, at most ``output_len``). They are sent at the trace's timestamps scaled so the window's
  mean rate is the cell's ``qps`` (``trace_timing: timestamps``) or at the seeded schedule of the
  other datasets (``trace_timing: qps``).

Every draw is seeded by the workload's seed, and the measured requests come first in each
stream, so they do not change with ``warmup_requests``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from servematrix import replay, sessions
from servematrix.files import json_object
from servematrix.matrix import Workload
from servematrix.schedule import arrival_times
from servematrix.sessions import spread as _spread

SONNET_BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"
"""vLLM's ``sample_sonnet_requests`` base prompt, verbatim."""

_APPROXIMATE_TOKEN = re.compile(r"[^\W\d_]+|\d|[^\w\s]|_|\n")

# Independent streams of one seed: lengths, output lengths and token ids never share draws.
_INPUT_STREAM, _OUTPUT_STREAM, _IDS_STREAM = 0, 1, 2
_GROUP_STREAM, _PREFIX_STREAM = 3, 4
"""Random prompts with shared system prompts: which one each request starts with, and their
tokens (streams of their own, so prompts without a shared prefix stay as they were)."""


class WorkloadError(ValueError):
    """A workload that cannot be built, naming the file and line or the setting at fault."""


@dataclass(frozen=True)
class RequestSpec:
    """One request as the client sends it.

    ``prompt`` is token ids (random dataset, jsonl length lines) or text; ``input_len`` is its
    length in tokens (exact for ids, counted with the `TokenCounter` for text);
    ``output_len`` is the ``max_tokens`` sent. A session's later turn (`servematrix.sessions`)
    has ``after_id``, the request it follows: it is sent ``think_s`` after that one's answer
    ends, and its ``scheduled_s`` is only known then.
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


@dataclass(frozen=True)
class _Entry:
    """One dataset draw; ``prompt`` None when only the lengths were asked for."""

    prompt: list[int] | str | None
    input_len: int
    output_len: int
    prefix_group: int = 0


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
        warm = _random(replace(workload, num_prompts=0), workload.warmup_requests, None)
        return RequestLengths(
            [e.input_len for e in warm] + [t.input_len for t in turns],
            [e.output_len for e in warm] + [t.output_len for t in turns],
        )
    entries = _entries(workload, tokenizer, None)
    ordered = _warmups_first(workload, entries)
    text = [isinstance(entry.prompt, str) for entry in ordered]
    shared = 0
    if workload.dataset == "sonnet":
        shared = min(
            _sonnet_shared_tokens(workload, tokenizer or TokenCounter.approximate()),
            min(entry.input_len for entry in ordered),
        )
    trace = trace_window(workload) if workload.dataset == "mooncake" else None
    groups = []
    if workload.dataset == "random" and workload.prefix_len:
        shared = workload.prefix_len
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
    timestamps for a mooncake replay at ``trace_timing: timestamps``, else the seeded
    `schedule.arrival_times` (for sessions: of each user's first turn)."""
    w = workload
    if w.dataset == "mooncake" and w.trace_timing == "timestamps":
        return np.array(replay.send_times(trace_window(w).requests, w.qps))
    count = w.num_prompts if w.sessions is None else w.sessions.users  # first turns only
    return arrival_times(count, w.qps, w.burstiness, w.seed)


def trace_window(workload: Workload) -> replay.TraceWindow:
    """The mooncake dataset's window of its trace file (errors as `WorkloadError`); it has no
    warm-ups, which would change the window's cache state (the config refuses them too)."""
    w = workload
    if w.warmup_requests:
        raise WorkloadError("the mooncake dataset replays no warm-up requests (set them to 0)")
    try:
        return replay.window(
            _read_trace(_file_key(_dataset_file(w))),
            w.trace_start_s,
            w.num_prompts,
            w.input_len,
            w.input_overflow,
            where=f"trace file {w.dataset_path}",
        )
    except replay.TraceError as error:
        raise WorkloadError(str(error)) from error


def _file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path), stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=2)
def _read_trace(key: tuple[str, int, int]) -> list[replay.TraceRequest]:
    """A trace file's requests, read once per process and version of the file (the simulator
    asks for a cell's lengths and its send times)."""
    return replay.read_trace(key[0])


def _specs(workload: Workload, entries: list[_Entry]) -> list[RequestSpec]:
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
    """The measured turns of a sessions workload (`servematrix.sessions.plan`)."""
    assert workload.sessions is not None
    w = workload
    return sessions.plan(w.sessions, w.input_len, w.output_len, w.range_ratio, w.seed)


def _session_specs(workload: Workload, vocab_size: int) -> list[RequestSpec]:
    """Warm-ups as independent random requests of a first turn's lengths, then the turns:
    first turns at the arrival schedule, later ones after the turn they follow."""
    w = workload
    turns = session_plan(w)
    warm = _random(replace(w, num_prompts=0), w.warmup_requests, vocab_size)
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


def _warmups_first(workload: Workload, entries: list[_Entry]) -> list[_Entry]:
    """Datasets draw the measured requests first (so they do not depend on the number of
    warm-ups), then the warm-ups; requests are numbered warm-ups first."""
    n = workload.num_prompts
    return entries[n:] + entries[:n]


def _entries(
    workload: Workload, tokenizer: TokenCounter | None, vocab_size: int | None
) -> list[_Entry]:
    count = workload.num_prompts + workload.warmup_requests
    if workload.dataset == "random":
        return _random(workload, count, vocab_size)
    counter = tokenizer or TokenCounter.approximate()
    if workload.dataset == "sonnet":
        return _sonnet(workload, count, counter)
    if workload.dataset == "jsonl":
        return _jsonl(workload, count, counter, vocab_size)
    if workload.dataset == "mooncake":
        return _mooncake(workload, vocab_size)
    raise WorkloadError(
        f"unknown dataset {workload.dataset!r} (known: random, sonnet, jsonl, mooncake)"
    )


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _token_ids(rng: np.random.Generator, vocab_size: int, lengths: Sequence[int]) -> list:
    ids = rng.integers(0, vocab_size, sum(lengths))
    return [part.tolist() for part in np.split(ids, np.cumsum(lengths)[:-1])]


def _random(w: Workload, count: int, vocab_size: int | None) -> list[_Entry]:
    inputs = _spread(_rng(w.seed, _INPUT_STREAM), w.input_len, w.range_ratio, count)
    outputs = _spread(_rng(w.seed, _OUTPUT_STREAM), w.output_len, w.range_ratio, count)
    if w.prefix_len:
        return _random_with_system_prompts(w, inputs, outputs, vocab_size)
    if vocab_size is None:
        return [_Entry(None, i, o) for i, o in zip(inputs, outputs, strict=True)]
    prompts = _token_ids(_rng(w.seed, _IDS_STREAM), vocab_size, inputs)
    return [_Entry(p, i, o) for p, i, o in zip(prompts, inputs, outputs, strict=True)]


def _mooncake(w: Workload, vocab_size: int | None) -> list[_Entry]:
    requests = trace_window(w).requests
    outputs = [min(r.output_len, w.output_len) for r in requests]
    if vocab_size is None:
        return [_Entry(None, r.input_len, o) for r, o in zip(requests, outputs, strict=True)]
    built = replay.prompts(requests, w.seed, vocab_size)
    return [_Entry(p, len(p), o) for p, o in zip(built, outputs, strict=True)]


def _random_with_system_prompts(
    w: Workload, inputs: list[int], outputs: list[int], vocab_size: int | None
) -> list[_Entry]:
    """Random prompts that start with one of ``prefix_groups`` system prompts of
    ``prefix_len`` random tokens each (drawn uniformly per request), then random tokens up to
    the request's input length: the shape of vLLM's ``prefix_repetition`` dataset."""
    groups = _rng(w.seed, _GROUP_STREAM).integers(0, w.prefix_groups, len(inputs)).tolist()
    if vocab_size is None:
        return [_Entry(None, i, o, g) for i, o, g in zip(inputs, outputs, groups, strict=True)]
    prefixes = _token_ids(
        _rng(w.seed, _PREFIX_STREAM), vocab_size, [w.prefix_len] * w.prefix_groups
    )
    suffixes = _token_ids(_rng(w.seed, _IDS_STREAM), vocab_size, [i - w.prefix_len for i in inputs])
    return [
        _Entry(prefixes[g] + s, i, o, g)
        for s, i, o, g in zip(suffixes, inputs, outputs, groups, strict=True)
    ]


def _dataset_file(w: Workload) -> Path:
    if not w.dataset_path:
        raise WorkloadError(f"dataset {w.dataset!r} needs a dataset_path")
    path = Path(w.dataset_path)
    if not path.is_file():
        raise WorkloadError(f"dataset file {path} does not exist")
    return path


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise WorkloadError(f"dataset file {path}: not UTF-8 text ({error})") from error


def _sonnet_layout(w: Workload, counter: TokenCounter) -> tuple[list[str], list[str], int]:
    """The file's lines, the shared prefix lines, and how many lines each prompt draws."""
    path = _dataset_file(w)
    lines = _read_text(path).splitlines(keepends=True)
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


_PROMPT_END = "\x00"
"""Marks where the drawn lines start in a formatted sonnet prompt (no prompt contains it)."""


def _sonnet_shared_tokens(w: Workload, counter: TokenCounter) -> int:
    """The tokens every sonnet prompt shares: the chat template's head, the base prompt and the
    prefix lines, counted as the server counts the prompt (the drawn lines and the template's
    tail differ from prompt to prompt)."""
    _, prefix, _ = _sonnet_layout(w, counter)
    formatted = counter.format(SONNET_BASE_PROMPT + "".join(prefix) + _PROMPT_END)
    return counter.count(formatted[: formatted.index(_PROMPT_END)])


def _sonnet(w: Workload, count: int, counter: TokenCounter) -> list[_Entry]:
    lines, prefix, extra = _sonnet_layout(w, counter)
    rng = random.Random(w.seed)  # Python's generator, as vLLM's client seeds random.seed(seed)
    entries = []
    for _ in range(count):
        prompt = counter.format(SONNET_BASE_PROMPT + "".join(prefix + rng.choices(lines, k=extra)))
        entries.append(_Entry(prompt, counter.count(prompt), w.output_len))
    return entries


def check_dataset(w: Workload) -> None:
    """Read the workload's dataset file as a cell would, raising WorkloadError (naming the file
    and, for jsonl, the line) for what would stop the cell: before any job, not inside one."""
    if w.dataset == "jsonl":
        _jsonl_rows(w)
    elif w.dataset == "sonnet" and not _read_text(_dataset_file(w)).strip():
        raise WorkloadError(f"dataset file {w.dataset_path}: no text lines")


def _jsonl_rows(w: Workload) -> list[tuple[str | None, int, int]]:
    path = _dataset_file(w)
    rows = [
        _jsonl_row(path, number, line, w.output_len)
        for number, line in enumerate(_read_text(path).splitlines(), start=1)
        if line.strip()
    ]
    if not rows:
        raise WorkloadError(f"dataset file {path}: no requests")
    return rows


def _jsonl(w: Workload, count: int, counter: TokenCounter, vocab_size: int | None) -> list[_Entry]:
    rows = _jsonl_rows(w)
    chosen = [rows[k % len(rows)] for k in range(count)]
    ids = iter([])
    if vocab_size is not None:
        lengths = [length for prompt, length, _ in chosen if prompt is None]
        ids = iter(_token_ids(_rng(w.seed, _IDS_STREAM), vocab_size, lengths))
    counted: dict[str, int] = {}
    entries = []
    for prompt, input_len, output_len in chosen:
        if prompt is None:
            entries.append(_Entry(next(ids, None), input_len, output_len))
            continue
        if prompt not in counted:
            counted[prompt] = counter.count(prompt)
        entries.append(_Entry(prompt, counted[prompt], output_len))
    return entries


def _jsonl_row(
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
