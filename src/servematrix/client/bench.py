"""``servematrix bench``: one workload against any running OpenAI-compatible server, as a trace.

The same workload (``servematrix.workload``) and client (``servematrix.client.loadgen``) as a cell
of the workflow, outside it: the trace has backend ``external`` and is read by
``servematrix metrics``. ``DESCRIPTION`` is what ``bench -h`` tells a user, in plain text; the
vocabulary size behind random prompts is ``vocab_size_for``'s, text prompts are counted by
``workload.TokenCounter``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import socket
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from servematrix import __version__
from servematrix.common.files import unwritable
from servematrix.engine.architecture import architecture_dir, shipped
from servematrix.spec import trace
from servematrix.spec.matrix import Workload
from servematrix.spec.trace import CellIdentity
from servematrix.workload import TokenCounter, WorkloadError, build_requests
from servematrix.workload.datasets import DATASETS as BY_NAME
from servematrix.workload.datasets import dataset_of

EXIT_OK = 0
EXIT_FAILED = 1
"""Nothing measured: bad flags, no server, every request failed (no trace), or the server
stopped answering during the run."""
EXIT_PARTLY_FAILED = 3
"""The trace is written, but some requests failed (their rows say why)."""
EXIT_INTERRUPTED = 130

CONFIG_PATH = Path(__file__).resolve().parents[3] / "config" / "config.yaml"
DEFAULT_VOCAB_SIZE = 32000  # Llama-2's; Qwen2.5 (151k+) and Command R (256k) have more
DATASETS = tuple(name for name, d in BY_NAME.items() if not d.REPLAYS_TRACE)
"""The datasets the standalone client offers (a trace replay needs a study's settings)."""
REFUSED_TIMEOUT_S = 30.0


class BenchError(ValueError):
    """A flag that makes no sense, named."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every flag's default (where it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


DESCRIPTION = f"""\
Measure one workload against a running OpenAI-compatible server (vLLM or any other) and write
it as a trace, the same client and workload a cell of the workflow uses; read the trace with
"servematrix metrics TRACE". Flags, the dataset file and the URL are checked before the server
is contacted, and nothing is written unless the run ends.

Random prompts are token ids below the model's vocabulary size: --vocab-size, else the model's
when servematrix knows it (a model of config/config.yaml by name or hf_id, an architecture
shipped with servematrix, or a local directory with a config.json), else {DEFAULT_VOCAB_SIZE}
(every tokenizer of the models studied here has more ids). Text prompts (sonnet, jsonl) are
counted with the model's tokenizer when it is on this machine (--tokenizer, the model's
directory or the Hugging Face cache), else approximated (one token per word, digit or other
sign: close on plain English, short on rare words).
"""

EPILOG = f"""\
Defaults are vLLM's benchmark client's (vllm bench serve: 1000 prompts of 1024 input and 128
output tokens). The workflow's cells use the config's defaults instead (200 prompts of 6 output
tokens, config/config.yaml); pass --num-prompts 200 --output-len 6 to measure the same workload.

Exit status: {EXIT_OK} every request succeeded; {EXIT_PARTLY_FAILED} the trace is written but some
requests failed (the last line says how many); {EXIT_FAILED} nothing was measured: a bad flag, an
output it cannot write, no server, every request failed (no trace), or the server stopped
answering during the run (the trace is written); 2 a flag it does not take; {EXIT_INTERRUPTED}
interrupted (no trace).

Timeouts: vllm bench serve has none per request (its session allows 6 hours); here a request
fails after --request-timeout-s, or --first-byte-timeout-s without any answer, and a warm-up
that times out stops the run with one line.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench",
        help="measure a running OpenAI-compatible server and write a trace",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
    )
    bench.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (/v1 added)")
    bench.add_argument("--model", required=True, help="model name as the server serves it")
    bench.add_argument("-o", "--output", required=True, type=Path, help="trace (.parquet)")
    bench.add_argument("--qps", type=float, default=math.inf, help="request rate; inf: all at 0")
    bench.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random)")
    bench.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    bench.add_argument("--num-prompts", type=int, default=1000, help="measured requests")
    bench.add_argument("--max-concurrency", type=int, help="at most N requests in flight")
    bench.add_argument("--dataset", choices=DATASETS, default="random", help="prompt source")
    bench.add_argument("--dataset-path", help="sonnet text file or jsonl file")
    bench.add_argument("--prefix-len", type=int, default=0, help="sonnet shared prefix (tokens)")
    bench.add_argument("--range-ratio", type=float, default=0.0, help="random length spread")
    bench.add_argument("--seed", type=int, default=0, help="arrivals and prompts")
    bench.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; inf: constant")
    bench.add_argument(
        "--warmup-requests", type=int, default=1, help="unmeasured, one at a time, first"
    )
    bench.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every request generates its max_tokens",
    )
    bench.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="a request not complete this long after it is sent fails",
    )
    bench.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=600.0,
        help="a request whose answer has not begun this long after it is sent fails (a hung "
        "warm-up stops the run)",
    )
    bench.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="longest wait for the server to answer GET /health (or /v1/models)",
    )
    bench.add_argument(
        "--refused-timeout-s",
        type=float,
        default=REFUSED_TIMEOUT_S,
        help="give up sooner when its port refuses every connection this long",
    )
    bench.add_argument(
        "--client",
        choices=("aiohttp", "openai"),
        default="aiohttp",
        help="HTTP client: servematrix's own, or the openai package's (slower per request)",
    )
    bench.add_argument("--vocab-size", type=int, help="random token ids are below this")
    bench.add_argument("--tokenizer", help="tokenizer.json or model directory for text prompts")
    bench.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="random prompts as token ids, or as text decoded with the tokenizer (auto: text "
        "when the server refuses ids)",
    )
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servematrix.client import loadgen  # here: openai and aiohttp take a while to import
    from servematrix.client.loadgen import ClientSettings, LoadgenError

    try:
        _check_output(args.output)
        workload = _workload(args)
        settings = ClientSettings(
            base_url=args.base_url,
            model=args.model,
            max_concurrency=args.max_concurrency,
            request_timeout_s=args.request_timeout_s,
            first_byte_timeout_s=args.first_byte_timeout_s,
            ready_timeout_s=args.ready_timeout_s,
            ignore_eos=args.ignore_eos,
            client=args.client,
            refused_timeout_s=args.refused_timeout_s,
            prompt_format=args.prompt_format,
            tokenizer=args.tokenizer,
        )
        vocab_size, vocab_source = vocab_size_for(args.model, args.vocab_size)
        counter = None
        if dataset_of(workload.dataset).TOKENIZED:
            counter = TokenCounter.for_model(args.tokenizer or args.model)
        requests = build_requests(workload, vocab_size, counter)
        if not logging.getLogger().handlers:  # progress lines when stderr is not a terminal
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        started = datetime.now(UTC)
        result = loadgen.run(settings, requests, loadgen.Progress(workload.num_prompts))
        failure = loadgen.failure(result.records, settings.completions_url)
        if failure is not None:  # nothing to measure: no trace, as for a server never ready
            raise BenchError(f"{failure}; no trace written")
        metadata = {
            "bench": {"argv": sys.argv, "vocab_size": vocab_size, "vocab_source": vocab_source},
            "settings": asdict(settings),
            "workload": asdict(workload),
            "tokenizer": counter.description if counter else None,
            "versions": _versions(),
            "host": {"hostname": socket.gethostname(), "platform": platform.platform()},
            "started_utc": started.isoformat(timespec="seconds"),
            **result.metadata(),
        }
        try:
            trace.write(args.output, _identity(args, workload), result.records, metadata)
        except OSError as error:
            raise BenchError(f"cannot write the trace {args.output}: {error}") from None
    except (BenchError, LoadgenError, WorkloadError) as error:
        print(f"servematrix bench: {error}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("servematrix bench: interrupted; no trace written", file=sys.stderr)
        return EXIT_INTERRUPTED
    line, status = outcome(args.output, result.records, settings.server_root)
    print(line, file=sys.stderr)
    return status


def outcome(output: Path, records: list, server_root: str) -> tuple[str, int]:
    """The last line and exit status of a run with a trace (some request succeeded; see EPILOG)."""
    measured = [r for r in records if not r.warmup]
    failed = [r for r in measured if not r.success]
    summary = f"{output}: {len(measured)} requests, {len(failed)} failed"
    if not failed:
        return summary, EXIT_OK
    first = f"first error: {failed[0].error}"
    if not _answers(f"{server_root}/health"):
        return f"{summary}; the server at {server_root} stopped answering ({first})", EXIT_FAILED
    return f"{summary}: the run partly failed ({first})", EXIT_PARTLY_FAILED


def _answers(url: str) -> bool:
    """Whether anything answers HTTP at ``url`` (any status: only a dead server does not)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _check_output(output: Path) -> None:
    """Fail before the run, not after it, when the trace cannot be written where asked."""
    problem = unwritable(output)
    if problem is not None:
        raise BenchError(f"-o {problem}")


def _workload(args: argparse.Namespace) -> Workload:
    def at_least(flag: str, value: float, minimum: float) -> None:
        if not value >= minimum:
            raise BenchError(f"--{flag} must be >= {minimum:g}, got {value:g}")

    at_least("num-prompts", args.num_prompts, 1)
    at_least("input-len", args.input_len, 1)
    at_least("output-len", args.output_len, 1)
    at_least("warmup-requests", args.warmup_requests, 0)
    at_least("prefix-len", args.prefix_len, 0)
    if args.max_concurrency is not None:
        at_least("max-concurrency", args.max_concurrency, 1)
    if not args.qps > 0:
        raise BenchError(f"--qps must be > 0 (or inf), got {args.qps:g}")
    if not args.burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {args.burstiness:g}")
    if not 0 <= args.range_ratio < 1:
        raise BenchError(f"--range-ratio must be in [0, 1), got {args.range_ratio:g}")
    if args.vocab_size is not None:
        at_least("vocab-size", args.vocab_size, 1)
    if dataset_of(args.dataset).READS_FILE and not args.dataset_path:
        raise BenchError(f"--dataset {args.dataset} needs --dataset-path")
    return Workload(
        qps=args.qps,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        seed=args.seed,
        dataset=args.dataset,
        burstiness=args.burstiness,
        warmup_requests=args.warmup_requests,
        max_concurrency=args.max_concurrency,
        range_ratio=args.range_ratio,
        dataset_path=args.dataset_path,
        prefix_len=args.prefix_len,
        ignore_eos=args.ignore_eos,
    )


def vocab_size_for(model: str, given: int | None) -> tuple[int, str]:
    """(vocabulary size, where it came from); never downloads anything."""
    if given is not None:
        return given, "--vocab-size"
    architecture = _config_architectures().get(model, model)
    local = Path(model).expanduser()
    candidates = [local if local.suffix == ".json" else local / "config.json"]
    if architecture in shipped():
        candidates.insert(0, architecture_dir(architecture) / "config.json")
    for config_json in candidates:
        if config_json.is_file():
            try:
                vocab_size = int(json.loads(config_json.read_text())["vocab_size"])
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise BenchError(f"{config_json}: no readable vocab_size ({error!r})") from None
            return vocab_size, str(config_json)
    return DEFAULT_VOCAB_SIZE, "default (model not known to servematrix; see --vocab-size)"


def _config_architectures() -> dict[str, str]:
    """Model name and hf_id -> architecture, from the repository's config (when there is one)."""
    try:
        models = yaml.safe_load(CONFIG_PATH.read_text()).get("models", {})
    except (OSError, yaml.YAMLError, AttributeError):
        return {}
    out = {}
    for name, spec in models.items():
        if isinstance(spec, dict) and "architecture" in spec:
            out[name] = spec["architecture"]
            if "hf_id" in spec:
                out[spec["hf_id"]] = spec["architecture"]
    return out


def _identity(args: argparse.Namespace, workload: Workload) -> CellIdentity:
    return CellIdentity(
        backend="external",
        recipe="external",
        model=args.model,
        mode="external",
        dataset=workload.dataset,
        qps=workload.qps,
        input_len=workload.input_len,
        output_len=workload.output_len,
        num_prompts=workload.num_prompts,
        seed=workload.seed,
    )


def _versions() -> dict[str, Any]:
    """servematrix and Python; the client's packages are in the ``client`` entry."""
    return {"servematrix": __version__, "python": sys.version.split()[0]}
