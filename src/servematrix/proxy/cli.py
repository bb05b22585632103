"""``python -m servematrix.proxy``: the command line of the proxies."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from servematrix import proxy as package
from servematrix.proxy.disagg_v0 import DisaggV0Proxy
from servematrix.proxy.disagg_v1 import DisaggV1Proxy
from servematrix.proxy.relay import Proxy, serve
from servematrix.proxy.roundrobin import RoundRobinProxy


def _url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http://HOST:PORT URL")
    return text.rstrip("/")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m servematrix.proxy", description=package.__doc__)
    top.formatter_class = argparse.RawDescriptionHelpFormatter
    kinds = top.add_subparsers(dest="kind", required=True)
    rr = kinds.add_parser("round-robin", help="strict cycle over the upstreams")
    rr.add_argument("--upstream", action="append", type=_url, required=True, metavar="URL")
    v0 = kinds.add_parser("disagg-v0", help="prefill (max_tokens 1, awaited), then decode")
    v0.add_argument("--prefill", action="append", type=_url, required=True, metavar="URL")
    v0.add_argument("--decode", action="append", type=_url, required=True, metavar="URL")
    v1 = kinds.add_parser("disagg-v1", help="vLLM 0.33's Mooncake proxy")
    v1.add_argument(
        "--prefill",
        action="append",
        nargs=2,
        required=True,
        metavar=("URL", "BOOTSTRAP_PORT"),
    )
    v1.add_argument("--decode", action="append", type=_url, required=True, metavar="URL")
    for sub in (rr, v0, v1):
        sub.add_argument("--port", type=int, required=True)
        sub.add_argument("--host", default="127.0.0.1")
    return top


def build(args: argparse.Namespace) -> Proxy:
    """The proxy the parsed command line asks for."""
    if args.kind == "round-robin":
        return RoundRobinProxy(args.upstream)
    if args.kind == "disagg-v0":
        return DisaggV0Proxy(args.prefill, args.decode)
    prefill = []
    for url, port in args.prefill:
        try:
            prefill.append((_url(url), int(port)))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise SystemExit(f"proxy: --prefill {url} {port}: {exc}") from None
    return DisaggV1Proxy(prefill, args.decode)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy %(levelname)s %(message)s")
    proxy = build(args)
    try:
        import uvloop  # a C event loop: ~0.1 ms less per hop than asyncio's own

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    print(
        f"servematrix proxy {proxy.kind} on http://{args.host}:{args.port} -> "
        f"{' '.join(proxy.upstreams)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        asyncio.run(serve(proxy, args.host, args.port))
    except OSError as exc:
        print(f"proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
