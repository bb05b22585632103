"""Request bodies, and prompts as the server takes them.

Random prompts are token ids, as vLLM's client sends them. A server that takes only text
(GuideLLM's mock server, many OpenAI stand-ins) refuses ids with a 4xx ("Input should be a
valid string"); then, or from the start with ``prompt_format: text``, each prompt is sent as
the text its ids decode to with the model's tokenizer. The server may count that text as a
different number of tokens (BPE merges across the ids' boundaries): the trace keeps both the
planned ``request_input_len`` and the server's ``prompt_tokens``, and the client metadata says
how far they differ (:func:`input_len_difference`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from servematrix.workload import RequestSpec

PROMPT_FORMATS = ("auto", "ids", "text")
"""auto: ids, and text when the server refuses ids at the warm-up; ids; text."""


class PromptError(ValueError):
    """Prompts that cannot be sent as the server needs them (no tokenizer to decode ids)."""


class _Body(Protocol):
    model: str
    ignore_eos: bool


def encode_body(spec: RequestSpec, settings: _Body) -> bytes:
    """The JSON body of one streaming completion request, as sent on the wire."""
    body = {
        "model": settings.model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": settings.ignore_eos,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def refuses_ids(error: str) -> bool:
    """Whether a 4xx answer says the prompt had to be a string (pydantic's wording)."""
    text = error.lower()
    return "prompt" in text and "valid string" in text


def as_text(requests: Sequence[RequestSpec], tokenizer: str) -> tuple[list[RequestSpec], str]:
    """Every token-id prompt decoded to text with ``tokenizer`` (a tokenizer.json, a model
    directory or a Hugging Face id with a local copy); the tokenizer's description."""
    from servematrix.workload import TokenCounter

    counter = TokenCounter.for_model(tokenizer)
    if not counter.can_decode:
        raise PromptError(
            f"the server takes only text prompts and no tokenizer for {tokenizer!r} is on this "
            "machine to decode the token ids (give --tokenizer)"
        )
    converted = [
        dataclasses.replace(spec, prompt=counter.decode(spec.prompt))
        if isinstance(spec.prompt, list)
        else spec
        for spec in requests
    ]
    return converted, counter.description


class Served(Protocol):
    """What `input_len_difference` reads of a trace row (`servematrix.spec.trace.RequestRecord`)."""

    success: bool
    prompt_tokens: int
    request_input_len: int


def input_len_difference(records: Sequence[Served]) -> dict[str, float]:
    """The server's ``prompt_tokens`` minus the planned length, over the successful rows."""
    diffs = [r.prompt_tokens - r.request_input_len for r in records if r.success]
    if not diffs:
        return {"requests": 0}
    return {
        "requests": len(diffs),
        "mean": sum(diffs) / len(diffs),
        "min": min(diffs),
        "max": max(diffs),
    }
