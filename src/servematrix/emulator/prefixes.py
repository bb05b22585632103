"""The emulator's side of automatic prefix caching (``--enable-prefix-caching``): which
prefix-cache segments a prompt's tokens make.

vLLM hashes each full block of a prompt's tokens chained to the hash of the blocks before it,
so two prompts share a cached block exactly when their tokens agree up to its end. This gives
the engine ``Request`` the same chain: one segment per full block, keyed by the chained hash
(``servematrix.engine.kvcache.BlockPool`` caches segments by key), so any two prompts hit
exactly the blocks they share, whichever prompt computed them.
"""

from __future__ import annotations

from collections.abc import Sequence

from servematrix.engine.kvcache import BLOCK_SIZE_TOKENS


def request_fields(
    tokens: Sequence[int | str], block_size: int = BLOCK_SIZE_TOKENS
) -> dict[str, object]:
    """``prefix_chain``, ``prefix_tokens`` and ``prefix_segment_blocks`` of the engine
    ``Request`` for a prompt of ``tokens`` (nothing for a prompt shorter than one block)."""
    chain = []
    previous = 0
    for k in range(len(tokens) // block_size):
        previous = hash((previous, *tokens[k * block_size : (k + 1) * block_size]))
        chain.append(previous)
    if not chain:
        return {}
    return {
        "prefix_chain": tuple(chain),
        "prefix_tokens": len(chain) * block_size,
        "prefix_segment_blocks": 1,
    }
