"""Check that the v1 recipe's command lines parse with vLLM's own `vllm serve` parser.

Run with a Python that has vLLM installed (never a servematrix dependency), e.g. a throwaway
venv:  VLLM_TARGET_DEVICE=cpu PYTHONPATH=src /tmp/vllm-venv/bin/python benchmarks/check_vllm_argv.py

For every model and mode of config/config.yaml, and every topology of the split question in
config/examples/xpyd.yaml (xPyD prefillers and decoders at their own TP; then the same
topologies spread over two nodes, each instance binding its node's address), it builds the
`vllm` backend's argv, parses it with vLLM's `vllm serve` subparser, validates it
(`validate_parsed_serve_args`), turns it into
engine arguments (`AsyncEngineArgs.from_cli_args`, which builds the pydantic KVTransferConfig,
so an unknown key in --kv-transfer-config fails here) and prints a table. The engine config
itself is not built: that needs the model's files. The v0 recipe targets vLLM 0.6, which this
script does not install; its lines are compared with the published ones in the test suite.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from servematrix.deploy.recipes import plan
from servematrix.dryrun import find_cell
from servematrix.spec import config
from servematrix.spec.matrix import MODES


def vllm_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return top


def check(parser, argv: list[str]) -> str:
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
    except ImportError:  # vLLM 0.32 (the CPU build of `make test-vllm`) keeps it here
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    args = parser.parse_args(argv[1:])  # argv[0] is the `vllm` executable
    if args.model_tag is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    kv = engine.kv_transfer_config
    kv_text = f"{kv.kv_connector}/{kv.kv_role}" if kv else "-"
    chunked = engine.enable_chunked_prefill
    return (
        f"tp={engine.tensor_parallel_size} chunked={chunked} "
        f"prefix_cache={engine.enable_prefix_caching} kv={kv_text}"
    )


def main() -> int:
    import vllm

    parser = vllm_parser()
    print(f"vLLM {vllm.__version__}: v1 recipe argv parsed by `vllm serve`")
    print(f"{'model':<32} {'mode':<16} {'process':<9} result")
    failures = sum(check_cell(parser, cell) for cell in named_mode_cells())
    failures += sum(check_cell(parser, cell) for cell in topology_cells())
    print(f"the same topologies over two nodes (deploy.nodes: {list(TWO_NODES)})")
    failures += sum(check_cell(parser, cell) for cell in topology_cells(TWO_NODES))
    print(f"{failures} failure(s)")
    return 1 if failures else 0


def named_mode_cells():
    cfg = config.load_file(Path("config/config.yaml"))
    deploy = config.deploy_settings({**cfg.raw, "backend": "vllm"})
    for model in cfg.models.values():
        for mode in MODES:
            if len(model.gpus) < MODES[mode].instances:
                continue
            cell = find_cell(cfg, model.name, mode, "v1")
            yield dataclasses.replace(cell, recipe="v1", deploy=deploy)


TWO_NODES = ("10.0.0.1", "10.0.0.2")


def topology_cells(nodes: tuple[str, ...] = ()):
    cfg = config.load_file(Path("config/examples/xpyd.yaml"))
    deploy = config.deploy_settings({**cfg.raw, "backend": "vllm"})
    if nodes:
        deploy["nodes"] = list(nodes)
    for study in cfg.studies.values():
        for cell in study.cells:
            yield dataclasses.replace(cell, backend="vllm", deploy=deploy)


def check_cell(parser, cell) -> int:
    """Check every `vllm serve` line of the cell's deployment; the number that failed."""
    failures = 0
    for process in plan(cell, "vllm").processes:
        if process.argv[0] != "vllm":
            continue
        try:
            result = "ok " + check(parser, list(process.argv))
        except (SystemExit, Exception) as error:
            failures += 1
            result = f"FAIL {type(error).__name__}: {error}"
        print(f"{cell.model.name:<32} {cell.mode.name:<16} {process.name:<9} {result}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
