"""What a ``MODEL`` argument names: a model of ``config/config.yaml`` (by its name or its
``hf_id``), or whatever ``engine.architecture`` resolves (a shipped architecture, a local
directory or ``config.json``, a Hugging Face id whose ``config.json`` is cached or fetched)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from servematrix.engine.architecture import (
    Architecture,
    ArchitectureError,
    load_architecture,
    load_architecture_file,
    resolve_config_json,
    shipped,
)

CONFIG_PATH = Path(__file__).resolve().parents[3] / "config" / "config.yaml"

QUANTIZATION_METHODS = {
    # vLLM --quantization value or quant_method -> servematrix quantization
    "awq": "awq",
    "awq_marlin": "awq",
    "fp8": "fp8",
    "gptq": "gptq-int4",  # vLLM reads the bits from the checkpoint; 4 is the common one
    "gptq_marlin": "gptq-int4",
}


class ModelError(ValueError):
    """The model argument names nothing the emulator can model."""


@dataclass(frozen=True)
class ModelInfo:
    arch: Architecture
    quantization: str
    max_position_embeddings: int | None


def resolve_model(
    model: str,
    quantization_flag: str | None,
    architecture: str | None = None,
    quantization: str | None = None,
) -> ModelInfo:
    """The architecture and quantization ``model`` stands for. ``architecture`` (the
    ``--architecture`` a workflow deployment passes: its config's model, as the simulator reads
    it) wins over the model id; else a model of ``config/config.yaml`` named by its name or
    ``hf_id``; else whatever the id resolves to. A model's own quantization (``quantization``,
    the config.yaml entry, a ``quantization_config``) wins over ``--quantization``."""
    if architecture is not None:
        return _described(architecture, quantization or _flag_quantization(quantization_flag))
    for name, spec in _config_models().items():
        if model in (name, spec.get("hf_id")):
            return _described(spec["architecture"], spec["quantization"])
    try:
        path = resolve_config_json(model)
        config = json.loads(path.read_text())
        arch = _shipped_equivalent(load_architecture_file(path, model))
    except (ArchitectureError, OSError, ValueError) as error:
        known = ", ".join(spec["hf_id"] for spec in _config_models().values())
        raise ModelError(
            f"unknown model {model!r}: {error} (config.yaml models: {known})"
        ) from None
    quantization = _config_quantization(config) or _flag_quantization(quantization_flag)
    return ModelInfo(arch, quantization, config.get("max_position_embeddings"))


def _described(architecture: str, quantization: str) -> ModelInfo:
    """A model given by its architecture (a shipped name, a config.json, a Hub id), loaded
    exactly as the simulator loads a config's ``architecture``."""
    try:
        config = json.loads(resolve_config_json(architecture).read_text())
        return ModelInfo(
            load_architecture(architecture), quantization, config.get("max_position_embeddings")
        )
    except (ArchitectureError, OSError, ValueError) as error:
        raise ModelError(f"--architecture {architecture!r}: {error}") from None


def _shipped_equivalent(arch: Architecture) -> Architecture:
    """The shipped architecture with the same dimensions, if any (the emulator then names it
    as the simulator does), else ``arch`` itself."""
    for name in shipped():
        candidate = load_architecture(name)
        if vars(candidate) | {"name": ""} == vars(arch) | {"name": ""}:
            return candidate
    return arch


def _config_quantization(config: dict) -> str | None:
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "gptq":
        return f"gptq-int{quant.get('bits', 4)}"
    return QUANTIZATION_METHODS.get(method, method)


def _flag_quantization(flag: str | None) -> str:
    if flag is None:
        return "bf16"
    if flag in QUANTIZATION_METHODS:
        return QUANTIZATION_METHODS[flag]
    raise ModelError(
        f"--quantization {flag!r} is not modelled (known: {', '.join(QUANTIZATION_METHODS)})"
    )


def _config_models() -> dict[str, dict]:
    if not CONFIG_PATH.is_file():  # a non-editable install ships no config
        return {}
    return dict(yaml.safe_load(CONFIG_PATH.read_text()).get("models", {}))
