"""``round-robin``: vLLM's ``round_robin_proxy.py``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from servematrix.proxy.http import ClientRequest
from servematrix.proxy.relay import ClientConnection, Proxy


class RoundRobinProxy(Proxy):
    """Strict cycle over the upstreams (``servematrix.proxy`` says how it differs from vLLM's)."""

    kind = "round-robin"

    def __init__(self, upstreams: Sequence[str]):
        super().__init__(upstreams)
        self._cycle = itertools.cycle(self.upstreams)

    async def handle(self, request: ClientRequest, client: ClientConnection) -> None:
        base = next(self._cycle) if request.method == b"POST" else self.upstreams[0]
        await client.forward(
            self.pool(base), request, request.method, request.target, request.forward
        )
