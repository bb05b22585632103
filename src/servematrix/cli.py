"""servematrix: check a config, print a trace's metrics, print a deployment's commands,
measure a running server, or calibrate a step-time profile on it, without running the
workflow."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from servematrix import __version__
from servematrix import dryrun as deploy_dryrun
from servematrix.calibration import cli as calibrate_cli
from servematrix.client import bench
from servematrix.results import metrics
from servematrix.spec import configcheck, trace
from servematrix.spec.matrix import ConfigError, gpus_needed

LATENCY_ROWS = (
    ("Time to First Token", "ttft"),
    ("Time per Output Token (excl. 1st token)", "tpot"),
    ("Inter-token Latency", "itl"),
    ("End-to-end Latency", "e2el"),
)


def _check(args: argparse.Namespace) -> int:
    from servematrix.preflight import warn_step_time_fallbacks
    from servematrix.workflow import (  # the workflow's own check, not a copy
        parse_overrides,
        workflow_config,
    )

    cfg = workflow_config([args.config], parse_overrides(args.overrides))
    for name, study in cfg.studies.items():
        print(f"{name}: {len(study.cells)} cells ({study.recipe}, x = {study.x})")
    print(f"{len(cfg.all_cells())} distinct cells on backend {cfg.backend}")
    gpus = gpus_needed(cfg)
    pinned = ", ".join(map(str, gpus)) or "none"
    if cfg.raw.get("node", {}).get("kind") == "cpu":
        print(f"CPU cores pinned: {pinned}")
    else:
        node = cfg.raw.get("node", {}).get("gpus", configcheck.DEFAULT_NODE_GPUS)
        print(f"GPU ids pinned: {pinned} (of {node} on the node)")
    warnings = logging.StreamHandler(sys.stderr)
    warnings.setFormatter(logging.Formatter("servematrix: warning: %(message)s"))
    warnings.setLevel(logging.WARNING)
    logging.getLogger("servematrix").addHandler(warnings)
    try:
        warn_step_time_fallbacks(cfg)
    finally:
        logging.getLogger("servematrix").removeHandler(warnings)
    return 0


def add_overrides(command: argparse.ArgumentParser, file_form: str) -> None:
    """``--config KEY=VALUE ...``, as Snakemake's ``--config``; a config file is ``file_form``."""

    def key_value(text: str) -> str:
        if "=" not in text:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not KEY=VALUE (as snakemake --config); a config file is "
                f"{file_form.replace('FILE', text)}"
            )
        return text

    command.add_argument(
        "--config",
        dest="overrides",
        nargs="+",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="override top-level keys as snakemake --config does (backend=emulator)",
    )


def _metrics(args: argparse.Namespace) -> int:
    """Print a trace's metrics in the layout of vLLM's benchmark summary."""
    slo_ms = dict(args.slo)
    result = metrics.compute(trace.read(args.trace), slo_ms, source=args.trace)
    print(f"{'Successful requests:':<40}{result.completed:<10}")
    print(f"{'Failed requests:':<40}{result.failed:<10}")
    print(f"{'Benchmark duration (s):':<40}{result.duration_s:<10.2f}")
    print(f"{'Total input tokens:':<40}{result.total_input_tokens:<10}")
    print(f"{'Total generated tokens:':<40}{result.total_output_tokens:<10}")
    print(f"{'Request throughput (req/s):':<40}{result.request_throughput:<10.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{result.output_throughput:<10.2f}")
    print(f"{'Total Token throughput (tok/s):':<40}{result.total_token_throughput:<10.2f}")
    if slo_ms:
        print(f"{'Request goodput (req/s):':<40}{result.request_goodput:<10.2f}")
    for title, key in LATENCY_ROWS:
        print(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            print(f"{label:<40}{getattr(result, f'{stat}_{key}_ms'):<10.2f}")
    return 0


def _slo(text: str) -> tuple[str, float]:
    key, _, value = text.partition("=")
    if key not in metrics.SLO_KEYS or not value:
        raise argparse.ArgumentTypeError(f"expected KEY=MS with KEY in {metrics.SLO_KEYS}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of ms") from None
    if not 0 < ms < math.inf:
        raise argparse.ArgumentTypeError(f"{key}={value}: an SLO must be a positive number of ms")
    return key, ms


class _Parser(argparse.ArgumentParser):
    """A flag a command does not take is reported by that command, with its usage (argparse
    reports it as the top level's, ``servematrix: error: unrecognized arguments``)."""

    def parse_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self


def _version() -> str:
    """The installed package's version; the source's when run from a checkout (``--sdm conda``
    imports the workflow's src/ without installing it)."""
    try:
        return importlib.metadata.version("servematrix")
    except importlib.metadata.PackageNotFoundError:
        return __version__


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="servematrix", description=__doc__)
    top.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = top.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a config and count its cells")
    check.add_argument("config", type=Path, metavar="FILE")
    add_overrides(check, "servematrix check FILE")
    check.set_defaults(run=_check)
    show = commands.add_parser("metrics", help="print the metrics of one trace")
    show.add_argument("trace", type=Path)
    show.add_argument(
        "--slo",
        action="append",
        type=_slo,
        default=[],
        metavar="KEY=MS",
        help="goodput SLO, e.g. ttft=2000",
    )
    show.set_defaults(run=_metrics)
    add_overrides(deploy_dryrun.add_parser(commands), "--configfile FILE")
    bench.add_parser(commands)
    calibrate_cli.add_parser(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, trace.TraceError, metrics.MetricsError) as error:
        print(f"servematrix: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`servematrix metrics t.parquet | head`): not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
