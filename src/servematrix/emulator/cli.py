"""``servematrix-emulator``: the command line of ``vllm serve`` (and of 0.6's
``python3 -m vllm.entrypoints.openai.api_server --model M``) in front of a wall-clock engine.

``servematrix-emulator serve MODEL [flags]`` or ``servematrix-emulator --model MODEL [flags]``.
Unknown flags fail as in vLLM (argparse, exit 2). Emulator-only flags pick the modelled GPU,
the vLLM generation (``--recipe v0|v1``: API flavour and scheduler), the start-up delay, the
step-time jitter and injected faults; each has a ``SERVEMATRIX_EMULATOR_*`` environment
variable so a recipe's unchanged vLLM command line can run under the emulator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Sequence

from aiohttp import web

from servematrix.emulator import wire
from servematrix.emulator.disagg import connector
from servematrix.emulator.kvconnector import KvConnector, KvTransferError
from servematrix.emulator.models import ModelError, ModelInfo, resolve_model
from servematrix.emulator.pacing import WallClockEngine
from servematrix.emulator.server import Emulator, Faults, ServerSettings
from servematrix.engine.architecture import max_model_len_refusal
from servematrix.engine.kvcache import ModelDoesNotFitError
from servematrix.engine.setup import (
    DEFAULT_GPU,
    DEFAULT_JITTER_CV,
    DEFAULT_STRAGGLER_PROBABILITY,
    EngineFlags,
    EngineSetup,
)
from servematrix.engine.setup import engine_setup as setup_of_flags
from servematrix.recipes import RECIPE_NAMES, recipe_version
from servematrix.workload import TokenCounter

PROG = "servematrix-emulator"
MODELLED_QUANTIZATIONS = ("bf16", "awq", "gptq-int4", "gptq-int8", "fp8")
SHUTDOWN_GRACE_S = 1.0
NODE_GPUS = 8
"""GPUs of the modelled node when ``CUDA_VISIBLE_DEVICES`` is unset (the studies' 8-GPU hosts)."""


class StartupError(RuntimeError):
    """The server cannot start (vLLM exits 1 with its message)."""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SERVEMATRIX_EMULATOR_{name}", default)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _optional(kind):
    return lambda value: None if value is None else kind(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="An OpenAI-compatible stand-in for `vllm serve`, without GPUs."
    )
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model to serve")
    vllm = parser.add_argument_group("vllm serve flags")
    vllm.add_argument("--model", help="model (the 0.6 api_server form)")
    vllm.add_argument("--served-model-name", nargs="+")
    vllm.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (vLLM's default is every interface; servematrix binds loopback "
        "unless told, as its deployments do: --host 0.0.0.0 for every interface)",
    )
    vllm.add_argument("--port", type=int, default=8000)
    vllm.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    vllm.add_argument("--max-model-len", type=int)
    vllm.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    vllm.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    vllm.add_argument("-q", "--quantization")
    vllm.add_argument("--kv-transfer-config", type=_json_object)
    vllm.add_argument("--max-num-seqs", type=int)
    vllm.add_argument("--max-num-batched-tokens", type=int)
    vllm.add_argument("--enforce-eager", action="store_true")
    vllm.add_argument("--kv-offloading-size", type=float)
    vllm.add_argument("--kv-offloading-backend", choices=("native",))
    # The published v0 launches pass these (spec §1.1); logging only, nothing to model.
    vllm.add_argument("--disable-log-stats", action="store_true")
    vllm.add_argument("--disable-log-requests", action="store_true")
    vllm.add_argument("--seed", type=int, default=0)
    emu = parser.add_argument_group("emulator flags (or SERVEMATRIX_EMULATOR_* variables)")
    emu.add_argument("--gpu", default=_env("GPU", DEFAULT_GPU), help="modelled GPU")
    emu.add_argument("--recipe", choices=RECIPE_NAMES, default=_env("RECIPE", "v1"))
    emu.add_argument(
        "--step-time-profile",
        default=_env("STEP_TIME_PROFILE"),
        help="a hardware profile file whose terms give the step times (servematrix calibrate)",
    )
    emu.add_argument(
        "--api-server-apart",
        action=argparse.BooleanOptionalAction,
        help="gpu cpu: the modelled API server on cores of its own (default: as the profile's)",
    )
    emu.add_argument(
        "--architecture",
        default=_env("ARCHITECTURE"),
        help="the model's config.json (or a shipped name, a Hub id) to model, instead of "
        "resolving MODEL; a workflow deployment passes its config's architecture",
    )
    emu.add_argument(
        "--modelled-quantization",
        choices=MODELLED_QUANTIZATIONS,
        default=_env("MODELLED_QUANTIZATION"),
        help="the weights' quantization, with --architecture (default: from --quantization)",
    )
    emu.add_argument("--startup-delay-s", type=float, default=float(_env("STARTUP_DELAY_S", "0")))
    emu.add_argument(
        "--jitter-cv", type=float, default=float(_env("JITTER_CV", str(DEFAULT_JITTER_CV)))
    )
    emu.add_argument(
        "--straggler-probability",
        type=float,
        default=float(_env("STRAGGLER_PROBABILITY", str(DEFAULT_STRAGGLER_PROBABILITY))),
    )
    emu.add_argument(
        "--fail-fraction",
        type=float,
        default=float(_env("FAIL_FRACTION", "0")),
        help="answer this share of requests with HTTP 500",
    )
    emu.add_argument(
        "--drop-after-chunks",
        type=int,
        default=_optional(int)(_env("DROP_AFTER_CHUNKS")),
        help="cut the connection after this many chunks",
    )
    emu.add_argument(
        "--drop-fraction",
        type=float,
        default=float(_env("DROP_FRACTION", "1")),
        help="share of streams --drop-after-chunks applies to",
    )
    emu.add_argument(
        "--die-after-requests",
        type=int,
        default=_optional(int)(_env("DIE_AFTER_REQUESTS")),
        help="exit (status 1) when request N+1 arrives",
    )
    return parser


def _normalize(argv: Sequence[str]) -> list[str]:
    """``--max_model_len`` is ``--max-model-len``, as vLLM's FlexibleArgumentParser allows."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(_normalize(argv))
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
    args.model = args.model_tag or args.model
    if not args.model:
        parser.error("the following arguments are required: MODEL (or --model)")
    if not 0 <= args.fail_fraction <= 1 or not 0 <= args.drop_fraction <= 1:
        parser.error("--fail-fraction and --drop-fraction must be in [0, 1]")
    return args


def check_visible_gpus(tensor_parallel: int, environ=os.environ) -> None:
    """vLLM 0.33 refuses a TP world larger than the visible GPUs (0.6 would wait for Ray
    placement for 30 minutes instead; the emulator fails at once for both)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    count = NODE_GPUS if visible is None else len([d for d in visible.split(",") if d.strip()])
    if tensor_parallel > count:
        raise StartupError(
            f"World size ({tensor_parallel}) is larger than the number of available GPUs "
            f"({count}) in this node. If this is intentional and you are using:\n"
            "- ray, set '--distributed-executor-backend ray'.\n"
            "- multiprocessing, set '--nnodes' appropriately."
        )


def check_kv_transfer_config(config: dict | None, recipe: str, environ=os.environ) -> str | None:
    """Validate ``--kv-transfer-config`` as the recipe's vLLM would; returns the KV role."""
    if config is None:
        return None
    kv = recipe_version(recipe).kv
    unknown = sorted(set(config) - kv.transfer_config_keys)
    if unknown:
        lines = "\n".join(f"{key}\n  Unexpected keyword argument" for key in unknown)
        raise StartupError(f"{len(unknown)} validation error(s) for KVTransferConfig\n{lines}")
    env = kv.config_path_env
    if (
        env is not None
        and config.get("kv_connector") == "MooncakeConnector"
        and not environ.get(env)
    ):
        raise StartupError(
            f"To use MooncakeConnector, you need to pass the ENV: "
            f"'{env}=/path/to/mooncake_config.json'."
        )
    return config.get("kv_role")


def engine_setup(args: argparse.Namespace, model: ModelInfo, max_model_len: int) -> EngineSetup:
    """The engine of this command line: the flags vLLM reads, plus the modelled GPU and jitter
    (`servematrix.engine.setup`, as the simulator builds it for the cell)."""
    try:
        flags = EngineFlags(
            quantization=model.quantization,
            tensor_parallel=args.tensor_parallel_size,
            recipe=args.recipe,
            chunked_prefill=args.enable_chunked_prefill,
            max_model_len=max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            gpu=args.gpu,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            kv_offloading_gib=args.kv_offloading_size,
            enforce_eager=args.enforce_eager,
            prefix_caching=args.enable_prefix_caching,
            jitter_cv=args.jitter_cv,
            straggler_probability=args.straggler_probability,
            model_label=args.model,
            step_time_profile=args.step_time_profile,
            api_server_apart=args.api_server_apart,
        )
        return setup_of_flags(model.arch, flags)
    except (ModelDoesNotFitError, ValueError, KeyError) as error:
        raise StartupError(str(error).strip('"')) from None


def _max_model_len(args: argparse.Namespace, model: ModelInfo) -> int:
    derived = model.max_position_embeddings
    if args.max_model_len is None:
        if derived is None:
            raise StartupError(f"{args.model}: no max_position_embeddings; pass --max-model-len")
        return derived
    refusal = None if derived is None else max_model_len_refusal(args.max_model_len, derived)
    if refusal is not None:
        raise StartupError(refusal)
    return args.max_model_len


def _log(recipe: str, message: str) -> None:
    """A vLLM-formatted log line (0.33 prefixes the process)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    if recipe_version(recipe).server.api_server_log_prefix:
        print(f"(APIServer pid={os.getpid()}) INFO {stamp} [api_server.py] {message}", flush=True)
    else:
        print(f"INFO {stamp} api_server.py] {message}", flush=True)


async def _start_kv_connector(
    args: argparse.Namespace, setup: EngineSetup, engine: WallClockEngine
) -> KvConnector | None:
    """The disaggregated role of ``--kv-transfer-config``, started before the API server
    listens (as vLLM's workers set up their connector while the engine loads)."""
    try:
        kv = connector(
            args.kv_transfer_config,
            args.recipe,
            setup.arch,
            args.tensor_parallel_size,
            args.host,
        )
        if kv is not None:
            kv.attach(engine)
            await kv.start()
    except KvTransferError as error:
        raise StartupError(str(error)) from None
    return kv


async def serve(args: argparse.Namespace, setup: EngineSetup, settings: ServerSettings) -> None:
    engine = WallClockEngine(setup.instance(args.seed, 0))
    engine_task = asyncio.create_task(engine.run())
    await asyncio.sleep(args.startup_delay_s)  # "loading the model": the port stays closed
    kv = await _start_kv_connector(args, setup, engine)
    # On SIGTERM, streams still in flight are cut after a second (the engine is gone) instead
    # of aiohttp's 60 s grace: a stopped deployment must not linger.
    runner = web.AppRunner(
        Emulator(settings, engine, kv).app(),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    await runner.setup()
    host = args.host
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as error:
        raise StartupError(
            f"[Errno {error.errno}] error while attempting to bind on address "
            f"('{host}', {args.port}): {error.strerror}"
        ) from None
    dialect = recipe_version(args.recipe).server
    _log(args.recipe, f"{dialect.startup_banner} on http://{host}:{args.port}")
    print(f"INFO:     Started server process [{os.getpid()}]", flush=True)
    print("INFO:     Waiting for application startup.", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    if dialect.uvicorn_running_line:
        print(
            f"INFO:     Uvicorn running on http://{host}:{args.port} (Press CTRL+C to quit)",
            flush=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({engine_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if engine_task in done:
        engine_task.result()  # the engine died: raise its error
    print("INFO:     Shutting down", flush=True)
    engine_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await engine_task
    await runner.cleanup()
    if kv is not None:
        await kv.stop()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_visible_gpus(args.tensor_parallel_size)
        kv_role = check_kv_transfer_config(args.kv_transfer_config, args.recipe)
        model = resolve_model(
            args.model, args.quantization, args.architecture, args.modelled_quantization
        )
        max_model_len = _max_model_len(args, model)
        setup = engine_setup(args, model, max_model_len)
    except (StartupError, ModelError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(1)
    served = args.served_model_name or [args.model]
    _log(
        args.recipe,
        f"servematrix emulator of vLLM {recipe_version(args.recipe).vllm_version}: {args.model} as "
        f"{setup.arch.name} ({model.quantization}) on {setup.gpu} TP {args.tensor_parallel_size}, "
        f"{setup.kv.num_blocks} KV blocks, step time {setup.step_time_label}",
    )
    settings = ServerSettings(
        recipe=args.recipe,
        served_names=served,
        root=args.model,
        max_model_len=max_model_len,
        fingerprint=wire.system_fingerprint(
            args.recipe, args.tensor_parallel_size, json.dumps(vars(args), default=str)
        ),
        kv_role=kv_role,
        faults=Faults(
            fail_fraction=args.fail_fraction,
            drop_after_chunks=args.drop_after_chunks,
            drop_fraction=args.drop_fraction,
            die_after_requests=args.die_after_requests,
            seed=args.seed,
        ),
        text_counter=TokenCounter.for_model(args.model),
        api_request_ms=setup.host.request_ms,
        request_latency_ms=setup.host.request_latency_ms,
        vocab_size=setup.arch.vocab_size,
    )
    # Start-up objects (the step-time tables, the model) leave the collector's generations: a
    # full collection over them would pause the wall-clock engine mid-run for milliseconds,
    # enough to split two requests sent together into different steps.
    gc.collect()
    gc.freeze()
    try:
        asyncio.run(serve(args, setup, settings))
    except StartupError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        sys.exit(1)
