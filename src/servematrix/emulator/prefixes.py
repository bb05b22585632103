"""Which earlier prompt a new one shares full KV blocks with: the emulator's side of automatic
prefix caching (``--enable-prefix-caching``).

vLLM hashes each full block of a prompt's tokens chained to the hash of the blocks before it,
so two prompts share a cached block exactly when their tokens agree up to its end. The engine
models the cache per *prefix group* (``servematrix.engine.scheduler.Request``); this index turns
prompt tokens into a group and the length of the prefix the request shares with it:

* a prompt whose first block was never seen founds a group covering all its full blocks (the
  engine caches them once computed), so repeating it hits every full block;
* a prompt that agrees with an earlier group's chain for k blocks joins that group with a
  k-block prefix (sonnet prompts: the common preamble). Its own blocks past the k are not
  indexed: a later prompt sharing them hits only the k blocks (fewer hits than vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

from servematrix.engine.kvcache import BLOCK_SIZE_TOKENS


class PrefixIndex:
    def __init__(self, block_size: int = BLOCK_SIZE_TOKENS):
        self.block_size = block_size
        self._group_of: dict[int, int] = {}  # hash of a chain of full blocks -> prefix group
        self._groups = 0

    def clear(self) -> None:
        """Forget every prompt (the engine's cache was reset); new groups keep new numbers, so
        none is taken for a group the engine may still hold blocks of."""
        self._group_of.clear()

    def request_fields(self, tokens: Sequence[int | str]) -> dict[str, int]:
        """``prefix_group`` and ``prefix_tokens`` of the engine ``Request`` for a prompt of
        ``tokens`` (nothing for a prompt shorter than one block)."""
        size = self.block_size
        chain = [0]
        for k in range(len(tokens) // size):
            chain.append(hash((chain[-1], *tokens[k * size : (k + 1) * size])))
        chain = chain[1:]
        if not chain:
            return {}
        shared = 0
        while shared < len(chain) and chain[shared] in self._group_of:
            shared += 1
        if shared:
            group = self._group_of[chain[shared - 1]]
            return {"prefix_group": group, "prefix_tokens": shared * size}
        group = self._groups
        self._groups += 1
        self._group_of.update(dict.fromkeys(chain, group))
        return {"prefix_group": group, "prefix_tokens": len(chain) * size}
