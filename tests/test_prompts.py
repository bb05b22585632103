"""Prompts as the server takes them: token ids decoded to text, and the refusal that asks for it."""

from __future__ import annotations

import pytest

from servematrix.spec.trace import RequestRecord
from servematrix.workload import RequestSpec, prompts


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    directory = tmp_path_factory.mktemp("model")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_a_refusal_of_id_prompts_is_recognized():
    guidellm = (
        "HTTP 400: 1 validation error for TextCompletionRequest prompt Input should be a valid "
        "string [type=string_type, input_value=[1, 2, 3], input_type=list]"
    )
    assert prompts.refuses_ids(guidellm)
    assert not prompts.refuses_ids("HTTP 400: This model's maximum context length is 2048 tokens")


def test_id_prompts_become_their_text_and_lengths_are_compared(tokenizer_dir):
    specs = [
        RequestSpec(0, True, 0.0, [40, 41, 42, 43], 4, 2),
        RequestSpec(1, False, 0.0, "already text", 2, 2),
    ]
    converted, description = prompts.as_text(specs, str(tokenizer_dir))
    assert isinstance(converted[0].prompt, str) and converted[0].prompt
    assert converted[1].prompt == "already text"
    assert str(tokenizer_dir) in description

    def row(prompt_tokens: int, success: bool = True) -> RequestRecord:
        return RequestRecord(
            0,
            False,
            0.0,
            0.0,
            prompt_tokens=prompt_tokens,
            success=success,
            request_input_len=4,
            request_output_len=2,
        )

    rows = [row(5), row(2), row(9, success=False)]
    assert prompts.input_len_difference(rows) == {"requests": 2, "mean": -0.5, "min": -2, "max": 1}


def test_without_a_tokenizer_the_refusal_is_one_line(tmp_path):
    with pytest.raises(prompts.PromptError, match=r"no tokenizer for .* \(give --tokenizer\)"):
        prompts.as_text([RequestSpec(0, True, 0.0, [1, 2], 2, 2)], str(tmp_path))
