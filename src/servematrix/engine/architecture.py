"""Model architectures, read from the Hugging Face ``config.json`` files shipped in the package."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES_DIR = Path(__file__).resolve().parents[1] / "data" / "architectures"


class UnknownArchitectureError(KeyError):
    def __init__(self, name: str):
        known = ", ".join(sorted(p.name for p in ARCHITECTURES_DIR.iterdir() if p.is_dir()))
        super().__init__(f"unknown architecture {name!r} (shipped: {known})")


@dataclass(frozen=True)
class Architecture:
    name: str
    hf_architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of the attention projections and the gated MLP of one decoder layer."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_attention_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attention + 3 * h * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        copies = 1 if self.tie_word_embeddings else 2
        return copies * self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_layers * self.linear_params_per_layer + self.embedding_params

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token, all TP shards together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def architecture_dir(name: str) -> Path:
    path = ARCHITECTURES_DIR / name
    if not (path / "config.json").is_file():
        raise UnknownArchitectureError(name)
    return path


def load_architecture(name: str) -> Architecture:
    config = json.loads((architecture_dir(name) / "config.json").read_text())
    heads = config["num_attention_heads"]
    return Architecture(
        name=name,
        hf_architecture=config["architectures"][0],
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim", config["hidden_size"] // heads),
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
