"""Model architectures, read from a Hugging Face ``config.json``.

A model's ``architecture`` names one of three sources (``resolve_config_json``):

- a name shipped with servematrix (``qwen2.5-7b``: ``data/architectures/<name>/config.json``);
- a local path: a ``.json`` file, or a model directory holding ``config.json`` (relative paths are
  taken from the current directory, where ``snakemake`` and ``servematrix check`` run);
- a Hugging Face id (``meta-llama/Llama-3.1-8B``): its ``config.json`` is fetched once with
  ``huggingface_hub`` into the Hugging Face cache, and read from there afterwards (no network
  with ``HF_HUB_OFFLINE=1``, and none once cached).

The engine models dense decoder-only transformers with full attention. A ``config.json`` with a
feature it does not model (mixture of experts, multi-head latent attention, sliding-window
attention, state-space layers, an encoder, a vision tower) is refused with an error naming the
feature, rather than simulated as something it is not.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES_DIR = Path(__file__).resolve().parents[1] / "data" / "architectures"
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
REQUIRED_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
SLIDING_WINDOW_APPROXIMATED = {"Cohere2ForCausalLM"}
"""Sliding-window models modelled with full attention on purpose (documented in SOURCES.md)."""

# (config.json key, feature): a key present with a truthy value means the feature.
UNSUPPORTED_KEYS = (
    ("num_experts", "mixture of experts"),
    ("num_local_experts", "mixture of experts"),
    ("n_routed_experts", "mixture of experts"),
    ("moe_intermediate_size", "mixture of experts"),
    ("kv_lora_rank", "multi-head latent attention (MLA)"),
    ("q_lora_rank", "multi-head latent attention (MLA)"),
    ("ssm_state_size", "state-space (Mamba) layers"),
    ("mamba_d_state", "state-space (Mamba) layers"),
    ("hybrid_override_pattern", "hybrid attention/state-space layers"),
    ("layers_block_type", "hybrid attention/state-space layers"),
    ("is_encoder_decoder", "an encoder-decoder model"),
    ("vision_config", "a vision tower (multimodal model)"),
    ("text_config", "a nested text_config (multimodal model)"),
)


class ArchitectureError(ValueError):
    """An architecture that cannot be found or modelled; the message is one line."""


class UnknownArchitectureError(ArchitectureError):
    def __init__(self, name: str):
        super().__init__(
            f"unknown architecture {name!r}: give a shipped name ({', '.join(shipped())}), "
            "a path to a config.json, or a Hugging Face id such as org/model"
        )


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

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token, all TP shards together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def shipped() -> list[str]:
    return sorted(p.name for p in ARCHITECTURES_DIR.iterdir() if (p / "config.json").is_file())


def architecture_dir(name: str) -> Path:
    """The folder of an architecture shipped with servematrix."""
    path = ARCHITECTURES_DIR / name
    if not (path / "config.json").is_file():
        raise UnknownArchitectureError(name)
    return path


def resolve_config_json(name: str) -> Path:
    """The ``config.json`` behind an architecture name, local path or Hugging Face id."""
    if (ARCHITECTURES_DIR / name / "config.json").is_file():
        return ARCHITECTURES_DIR / name / "config.json"
    path = Path(name).expanduser()
    if path.suffix == ".json" or path.is_dir() or name.startswith((".", "/", "~")):
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ArchitectureError(f"no such file {str(path)!r} (architecture {name!r})")
        return path
    if HF_ID.match(name):
        return _hub_config_json(name)
    raise UnknownArchitectureError(name)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_config_json(repo_id: str) -> Path:
    """``config.json`` of a Hub model from the Hugging Face cache, fetched there on first use."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    cached = huggingface_hub.try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return Path(cached)
    if _offline():
        raise ArchitectureError(
            f"Hugging Face model {repo_id!r} has no config.json in the Hugging Face cache and "
            "HF_HUB_OFFLINE is set: fetch it once online, or give a path to a local config.json"
        )
    try:
        # One request, not retried, first: a download whose first request finds no network
        # retries for ~25 s before it gives up, and then reports the file as missing.
        huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, "config.json"))
        return Path(huggingface_hub.hf_hub_download(repo_id, "config.json"))
    except errors.GatedRepoError:
        why = "is gated: accept its licence on huggingface.co, then log in (hf auth login)"
    except errors.RepositoryNotFoundError:
        why = "does not exist on the Hugging Face Hub (or is private: log in)"
    except errors.RemoteEntryNotFoundError:
        why = "has no config.json"
    except (httpx2.TransportError, errors.LocalEntryNotFoundError) as error:
        why = (
            f"needs its config.json from the Hugging Face Hub, which cannot be reached "
            f"({_first_line(error)}): connect once (it is cached then), or give the model an "
            f"`architecture:`, a shipped name ({', '.join(shipped())}) or a local config.json"
        )
    except (errors.HfHubHTTPError, OSError) as error:
        why = f"could not be fetched ({_first_line(error)})"
    raise ArchitectureError(f"Hugging Face model {repo_id!r} {why}")


def _first_line(error: Exception) -> str:
    text = str(error).splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def unsupported_feature(config: dict[str, Any]) -> str | None:
    """The first feature of a ``config.json`` the engine does not model, or None."""
    for key, feature in UNSUPPORTED_KEYS:
        if config.get(key):
            return f"{feature} ({key}: {json.dumps(config[key])[:40]})"
    architectures = config.get("architectures") or ["?"]
    if not str(architectures[0]).endswith("ForCausalLM"):
        return f"not a causal language model (architectures: {architectures[0]})"
    layer_types = config.get("layer_types") or []
    window = config.get("sliding_window")
    sliding = any("sliding" in str(kind) for kind in layer_types) or (
        isinstance(window, int) and config.get("use_sliding_window") is not False
    )
    if sliding and architectures[0] not in SLIDING_WINDOW_APPROXIMATED:
        return f"sliding-window attention (sliding_window: {window})"
    return None


def load_architecture(name: str) -> Architecture:
    """The architecture behind a shipped name, a local path or a Hugging Face id."""
    return load_architecture_file(resolve_config_json(name), name)


def load_architecture_file(path: Path, name: str) -> Architecture:
    """The architecture in a Hugging Face ``config.json`` anywhere (a user's model directory)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ArchitectureError(f"{path}: not a readable config.json ({error})") from None
    if not isinstance(config, dict):
        raise ArchitectureError(f"{path}: a config.json must be a JSON object")
    feature = unsupported_feature(config)
    if feature:
        raise ArchitectureError(f"{path}: servematrix does not model {feature}")
    for key in REQUIRED_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArchitectureError(f"{path}: {key} must be a positive integer, got {value!r}")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if not all(isinstance(v, int) and v >= 1 for v in (kv_heads, head_dim)) or heads % kv_heads:
        raise ArchitectureError(
            f"{path}: num_key_value_heads {kv_heads!r} must divide num_attention_heads {heads} "
            f"and head_dim {head_dim!r} must be a positive integer"
        )
    return Architecture(
        name=name,
        hf_architecture=config["architectures"][0],
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def max_position_embeddings(name: str) -> int | None:
    """The context the model's ``config.json`` declares (None when it declares none)."""
    value = json.loads(resolve_config_json(name).read_text()).get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def max_model_len_refusal(max_model_len: int, derived: int) -> str | None:
    """vLLM's start-up refusal of a ``--max-model-len`` beyond the model's declared context
    (``max_position_embeddings``; vLLM would also scale it by a ``rope_scaling`` factor, which
    no modelled architecture has), or None when it fits."""
    if max_model_len <= derived:
        return None
    return (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived "
        f"max_model_len (max_position_embeddings={derived} in model's config.json)."
    )
