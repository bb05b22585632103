"""What a vLLM server answers for a request it cannot serve, before or instead of serving it.

Two cases, with vLLM's own words (reference/vllm-openai-server.md §4):

* **Context length** (:func:`granted_max_tokens`): the API server checks the prompt and
  ``max_tokens`` against ``max_model_len`` before the engine sees the request and answers
  400. 0.6 (recipe ``v0``) refuses any prompt + ``max_tokens`` beyond the limit; 0.33 (``v1``)
  refuses only a prompt that is too long alone or a ``max_tokens`` above the limit, and
  otherwise clamps ``max_tokens`` to what the context leaves.
* **KV capacity** (:func:`kv_capacity_message`): V0's block manager gives a prompt that could
  never be allocated, even in an empty cache above the watermark, ``AllocStatus.NEVER``; the
  scheduler logs "Input prompt (N tokens) + lookahead slots (0) is too long and exceeds the
  capacity of block_manager" and finishes the request as ignored, without a token (V0
  ``Scheduler._schedule_prefills``). The client sees a stream that ends without a token. V1
  cannot meet this case: it refuses at start-up a cache that cannot hold ``max_model_len``
  tokens (so does ``servematrix.engine.kvcache.plan_kv_memory``).

The simulator writes these as failed rows and the emulator answers them; both take the texts
from here, so the two backends cannot drift apart.
"""

from __future__ import annotations

from servematrix.recipes import recipe_version

DEFAULT_MAX_TOKENS = 16
"""The OpenAI completions default ``max_tokens`` vLLM applies when a request gives none."""


class ContextLengthError(ValueError):
    """vLLM's 400 for a request beyond ``max_model_len``; ``param`` as in its error body."""

    status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def granted_max_tokens(
    recipe: str, prompt_tokens: int, max_tokens: int | None, max_model_len: int, text: bool
) -> int:
    """The ``max_tokens`` the server serves the request with, or :class:`ContextLengthError`.

    ``text``: the prompt was text, not token ids (0.33 words a too-long text prompt
    differently, as it stops counting past the limit)."""
    if recipe_version(recipe).clamps_max_tokens:
        return _v1_max_tokens(prompt_tokens, max_tokens, max_model_len, text)
    return _v0_max_tokens(prompt_tokens, max_tokens, max_model_len)


def _v1_max_tokens(prompt: int, max_tokens: int | None, limit: int, text: bool) -> int:
    """0.33: errors only when the prompt alone is too long or max_tokens exceeds the limit;
    otherwise max_tokens is clamped to what the context leaves."""
    if max_tokens is not None and max_tokens > limit:
        raise ContextLengthError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request "
            f"fewer output tokens. (parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )
    if prompt > limit:
        if text:
            counted, value = f"at least {limit + 1}", limit + 1
        else:
            counted, value = str(prompt), prompt
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {counted} input tokens, which exceeds this limit even without any output "
            f"tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={value})",
            param="input_tokens",
        )
    wanted = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    granted = min(wanted, limit - prompt)
    if granted < 1:
        raise ContextLengthError(
            f"max_tokens must be at least 1, got {granted}. "
            f"(parameter=max_tokens, value={granted})",
            param="max_tokens",
        )
    return granted


def _v0_max_tokens(prompt: int, max_tokens: int | None, limit: int) -> int:
    """0.6: any prompt + max_tokens beyond the limit is an error; null means "the rest"."""
    if max_tokens is None:
        if prompt >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt} tokens in the messages, Please reduce the length of the messages.",
            )
        return limit - prompt
    if prompt + max_tokens > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
        )
    if max_tokens < 1:
        raise ContextLengthError(f"max_tokens must be at least 1, got {max_tokens}.")
    return max_tokens


def kv_capacity_message(prompt_tokens: int, lookahead_slots: int = 0) -> str:
    """V0's reason for ignoring a prompt that no free cache could hold (a warning in the
    server's log; the client only sees a stream without a token). Lookahead slots are for
    speculative decoding: none here."""
    return (
        f"Input prompt ({prompt_tokens} tokens) + lookahead slots ({lookahead_slots}) is too "
        "long and exceeds the capacity of block_manager"
    )


def http_error(status: int, message: str) -> str:
    """The trace's ``error`` for an HTTP error answer, as the load generator records it."""
    return f"HTTP {status}: {message}"


NO_TOKEN_ERROR = "stream ended without a token"
"""The trace's ``error`` for a 200 stream that carried no token (the load generator's words)."""
