"""The workload's requests: datasets, lengths, determinism, arrivals and bad dataset files.

Text datasets are counted with a real (tiny) tokenizer built here with the ``tokenizers``
package, never one from a model hub.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from servematrix.spec.matrix import Workload
from servematrix.workload import (
    SONNET_BASE_PROMPT,
    TokenCounter,
    WorkloadError,
    build_requests,
    request_lengths,
)
from servematrix.workload.schedule import arrival_times

VOCAB = 5000
POEM = [
    "Shall I compare thee to a summer's day?",
    "Thou art more lovely and more temperate:",
    "Rough winds do shake the darling buds of May,",
    "And summer's lease hath all too short a date;",
    "Sometime too hot the eye of heaven shines,",
    "And often is his gold complexion dimm'd;",
    "And every fair from fair sometime declines,",
    "By chance or nature's changing course untrimm'd;",
]


def workload(**changes) -> Workload:
    base = Workload(
        qps=4.0,
        input_len=64,
        output_len=8,
        num_prompts=50,
        seed=0,
        dataset="random",
        burstiness=1.0,
        warmup_requests=2,
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture
def sonnet_file(tmp_path: Path) -> Path:
    path = tmp_path / "sonnet.txt"
    path.write_text("".join(f"{line}\n" for line in POEM * 4))
    return path


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A word-level tokenizer over the poem's words, the base prompt's and some JSON-test
    words: one token per whitespace-separated word or punctuation mark."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    pre = Whitespace()
    text = " ".join([*POEM, SONNET_BASE_PROMPT, "hello there general kenobi"])
    words = sorted({word for word, _ in pre.pre_tokenize_str(text)})
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre
    folder = tmp_path / "tiny-model"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_random_prompts_are_exact_token_ids():
    requests = build_requests(workload(), VOCAB)
    assert [r.request_id for r in requests] == list(range(52))
    for r in requests:
        assert len(r.prompt) == r.input_len == 64 and r.output_len == 8
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in r.prompt)
    assert len({tuple(r.prompt) for r in requests}) == 52  # every prompt differs


def test_warmups_come_first_at_time_zero_then_the_schedule():
    w = workload()
    requests = build_requests(w, VOCAB)
    assert [r.warmup for r in requests] == [True, True] + [False] * 50
    assert [r.scheduled_s for r in requests[:2]] == [0.0, 0.0]
    expected = arrival_times(50, 4.0, 1.0, 0).tolist()
    assert [r.scheduled_s for r in requests[2:]] == expected


def test_qps_inf_sends_every_measured_request_at_time_zero():
    requests = build_requests(workload(qps=math.inf), VOCAB)
    assert {r.scheduled_s for r in requests} == {0.0}


def test_same_seed_same_requests_other_seed_other_requests():
    w = workload(range_ratio=0.5)
    assert build_requests(w, VOCAB) == build_requests(w, VOCAB)
    other = build_requests(dataclasses.replace(w, seed=1), VOCAB)
    assert [r.prompt for r in other] != [r.prompt for r in build_requests(w, VOCAB)]


def test_measured_requests_do_not_depend_on_the_number_of_warmups():
    one = build_requests(workload(warmup_requests=1, range_ratio=0.3), VOCAB)
    five = build_requests(workload(warmup_requests=5, range_ratio=0.3), VOCAB)
    strip = [(r.prompt, r.input_len, r.output_len, r.scheduled_s) for r in one[1:]]
    assert strip == [(r.prompt, r.input_len, r.output_len, r.scheduled_s) for r in five[5:]]


def test_range_ratio_spreads_lengths_uniformly_within_the_bounds():
    w = workload(input_len=100, output_len=10, num_prompts=3000, range_ratio=0.5)
    lengths = request_lengths(w)
    inputs, outputs = np.array(lengths.input_lens), np.array(lengths.output_lens)
    assert inputs.min() == 50 and inputs.max() == 150  # both ends reached in 3000 draws
    assert outputs.min() == 5 and outputs.max() == 15
    assert abs(inputs.mean() - 100) < 2
    assert len(set(inputs.tolist())) == 101


def test_range_ratio_never_draws_an_empty_request():
    lengths = request_lengths(workload(input_len=1, output_len=1, range_ratio=0.9))
    assert set(lengths.input_lens) == {1, 2} and set(lengths.output_lens) == {1, 2}


def test_zero_range_ratio_gives_the_exact_lengths():
    lengths = request_lengths(workload())
    assert set(lengths.input_lens) == {64} and set(lengths.output_lens) == {8}


def test_request_lengths_match_the_built_requests(sonnet_file, tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"input_len": 7, "output_len": 2}\n{"prompt": "hello there"}\n')
    counter = TokenCounter.approximate()
    for w in (
        workload(range_ratio=0.4),
        workload(dataset="sonnet", dataset_path=str(sonnet_file), input_len=120, prefix_len=30),
        workload(dataset="jsonl", dataset_path=str(jsonl)),
    ):
        built = build_requests(w, VOCAB, counter)
        lengths = request_lengths(w, counter)
        assert lengths.input_lens == [r.input_len for r in built]
        assert lengths.output_lens == [r.output_len for r in built]


def test_sonnet_prompts_share_a_prefix_and_count_with_the_tokenizer(sonnet_file, tokenizer_dir):
    counter = TokenCounter.for_model(str(tokenizer_dir))
    assert str(tokenizer_dir / "tokenizer.json") in counter.description
    w = workload(dataset="sonnet", dataset_path=str(sonnet_file), input_len=200, prefix_len=60)
    requests = build_requests(w, VOCAB, counter)
    lines = sonnet_file.read_text().splitlines(keepends=True)
    # This tokenizer: base prompt 12 tokens, poem lines 8-12 (10 on average), so 5 shared
    # prefix lines (round((60 - 12) / 10)) and 19 lines in all (round((200 - 12) / 10)).
    assert counter.count(SONNET_BASE_PROMPT) == 12
    assert sum(counter.count(line) for line in lines) / len(lines) == 10
    prefix = SONNET_BASE_PROMPT + "".join(lines[:5])
    for r in requests:
        assert isinstance(r.prompt, str) and r.prompt.startswith(prefix)
        assert r.input_len == counter.count(r.prompt)
        assert 12 + 19 * 8 <= r.input_len <= 12 + 19 * 12  # whole lines: near, not at, 200
        assert r.prompt.count("\n") == 1 + 19
    assert len({r.prompt for r in requests}) > 40
    assert build_requests(w, VOCAB, counter) == requests


def test_sonnet_prompt_uses_the_chat_template_when_the_model_has_one(sonnet_file, tokenizer_dir):
    template = "{% for m in messages %}<|user|> {{ m.content }}{% endfor %}"
    template += "{% if add_generation_prompt %} <|assistant|>{% endif %}"
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    counter = TokenCounter.for_model(str(tokenizer_dir))
    assert "chat template" in counter.description
    w = workload(dataset="sonnet", dataset_path=str(sonnet_file), input_len=100)
    for r in build_requests(w, VOCAB, counter):
        assert r.prompt.startswith("<|user|> " + SONNET_BASE_PROMPT)
        assert r.prompt.endswith(" <|assistant|>")


def test_tokenizer_is_found_in_the_local_hub_cache(tmp_path, tokenizer_dir, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert str(snapshot) in TokenCounter.for_model("org/tiny").description
    assert TokenCounter.for_model("org/absent").description.startswith("approximation")


def test_the_approximation_counts_words_symbols_and_line_breaks():
    counter = TokenCounter.for_model(None)
    assert counter.description.startswith("approximation")
    assert counter.count("Shall I compare thee to a summer's day?\n") == 12
    assert counter.count("in 2024, x_y") == 9
    assert counter.format("text") == "text"


def test_jsonl_prompts_and_lengths_in_file_order_repeated(tmp_path):
    path = tmp_path / "shared.jsonl"
    rows = [
        {"prompt": "hello there general kenobi", "output_len": 3},
        {"input_len": 12, "output_len": 5},
        {"prompt": "hello"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = workload(dataset="jsonl", dataset_path=str(path), num_prompts=4, warmup_requests=1)
    requests = build_requests(w, VOCAB, TokenCounter.approximate())
    measured = requests[1:]
    assert [r.input_len for r in measured] == [4, 12, 1, 4]
    assert [r.output_len for r in measured] == [3, 5, 8, 3]  # a prompt line may omit output_len
    assert measured[0].prompt == "hello there general kenobi"
    assert len(measured[1].prompt) == 12 and all(0 <= t < VOCAB for t in measured[1].prompt)
    assert requests[0].warmup and requests[0].input_len == 12  # the draw after the measured


def test_missing_dataset_file_is_one_clear_error(tmp_path):
    for dataset in ("sonnet", "jsonl"):
        w = workload(dataset=dataset, dataset_path=str(tmp_path / "nope.txt"))
        with pytest.raises(WorkloadError) as caught:
            build_requests(w, VOCAB)
        assert str(caught.value) == f"dataset file {tmp_path / 'nope.txt'} does not exist"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", ', "not valid JSON (Expecting property name enclosed in double quotes)"),
        ("[1, 2]", "expected an object, got list"),
        ('{"prompt": ""}', "prompt must be a non-empty string"),
        ('{"input_len": 0, "output_len": 4}', "input_len must be an integer >= 1, got 0"),
        ('{"input_len": 3}', "a line with input_len needs an output_len"),
        ('{"input_len": 3, "output_len": true}', "output_len must be an integer >= 1, got True"),
        ('{"prompt": "a", "input_len": 3}', "give either a prompt or an input_len"),
        ('{"text": "a"}', "unknown key(s) text (known: prompt, input_len, output_len)"),
    ],
)
def test_malformed_jsonl_line_names_the_file_and_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{line}\n')
    w = workload(dataset="jsonl", dataset_path=str(path))
    with pytest.raises(WorkloadError) as caught:
        build_requests(w, VOCAB)
    assert str(caught.value) == f"dataset file {path} line 3: {message}"


def test_empty_dataset_files_are_rejected(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match=r"empty\.jsonl: no requests"):
        build_requests(workload(dataset="jsonl", dataset_path=str(empty)), VOCAB)
    with pytest.raises(WorkloadError, match=r"empty\.jsonl: no text lines"):
        build_requests(workload(dataset="sonnet", dataset_path=str(empty)), VOCAB)


def test_sonnet_input_shorter_than_the_base_prompt_is_rejected(sonnet_file):
    w = workload(dataset="sonnet", dataset_path=str(sonnet_file), input_len=8)
    with pytest.raises(WorkloadError) as caught:
        build_requests(w, VOCAB)
    assert str(caught.value) == (
        f"dataset file {sonnet_file}: input_len 8 must exceed the 13 tokens of the base prompt"
    )


def test_random_prompts_start_with_one_of_the_shared_system_prompts():
    w = workload(prefix_len=32, prefix_groups=3)
    requests = build_requests(w, VOCAB)
    heads = {tuple(r.prompt[:32]) for r in requests}
    assert len(heads) == 3  # every request starts with one of three system prompts
    assert all(len(r.prompt) == r.input_len == 64 for r in requests)
    assert len({tuple(r.prompt[32:]) for r in requests}) == len(requests)  # own suffixes
    lengths = request_lengths(w)
    assert lengths.shared_prefix_tokens == 32
    group_of = {head: k for k, head in enumerate(sorted(heads))}
    by_group = [group_of[tuple(r.prompt[:32])] for r in requests]
    # request_lengths names the same system prompt for each request as build_requests sends
    for k, group in enumerate(lengths.prefix_groups):
        assert by_group[k] == by_group[lengths.prefix_groups.index(group)]


def test_every_dataset_is_one_registry_entry_the_schema_offers():
    """A dataset is a module in servematrix/datasets and a line in its registry; the schema's
    enum offers exactly those (so a new dataset touches its module, the registry and the
    schema)."""
    import yaml

    from servematrix.workload import WorkloadError
    from servematrix.workload.datasets import DATASETS, dataset_of

    schema = yaml.safe_load(Path("config/schema.yaml").read_text(encoding="utf-8"))
    offered = schema["$defs"]["workload"]["properties"]["dataset"]["enum"]
    assert offered == list(DATASETS)
    for name, dataset in DATASETS.items():
        assert name == dataset.NAME and type(dataset).__module__.startswith(
            "servematrix.workload.datasets."
        )
    with pytest.raises(WorkloadError, match=r"unknown dataset 'nope' \(known: random, sonnet"):
        dataset_of("nope")


def test_a_new_dataset_reaches_the_requests_through_the_registry_alone(monkeypatch):
    """A dataset registered at run time (no other file changed) gives the cell's requests."""
    from servematrix.workload.datasets import DATASETS
    from servematrix.workload.datasets.base import Entry

    class Constant:
        NAME, READS_FILE, TOKENIZED, DRAWS_LENGTHS = "constant", False, False, False
        SHARES_PREFIX = GROUPS_PREFIXES = REPLAYS_TRACE = False

        def entries(self, w, count, counter, vocab_size):
            return [Entry(None if vocab_size is None else [7] * 3, 3, 2) for _ in range(count)]

        def shared_prefix_tokens(self, w, counter):
            return 0

        def check(self, w):
            pass

    monkeypatch.setitem(DATASETS, "constant", Constant())
    w = Workload(qps=2.0, input_len=3, output_len=2, num_prompts=4, seed=0,
                 dataset="constant", burstiness=1.0, warmup_requests=1)  # fmt: skip
    requests = build_requests(w, vocab_size=100)
    assert [r.prompt for r in requests] == [[7, 7, 7]] * 5
    assert request_lengths(w).input_lens == [3] * 5
