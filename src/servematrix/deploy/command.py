"""``deploy.server_command`` checked before any job: an executable that does not exist, is
not executable, or (a Python with ``-m MODULE``) cannot find that module's package is one line
naming the setting, in ``servematrix check`` and the workflow alike, not a failed cell."""

from __future__ import annotations

import os
import subprocess
from typing import Any

from servematrix.deploy.supervise import DeployError, launch_argv
from servematrix.spec.matrix import ConfigError

KEY = "deploy.server_command"


def check(raw: dict[str, Any]) -> None:
    """Raise ConfigError for a ``deploy.server_command`` that cannot start (backend vllm's
    preflight: the emulator takes the recipe's command line, not this one)."""
    command = (raw.get("deploy") or {}).get("server_command")
    if not command:
        return
    command = [os.path.expanduser(command[0]), *command[1:]]
    try:
        argv = launch_argv(tuple(command))
    except DeployError as error:
        raise ConfigError(KEY, str(error)) from None
    executable = argv[0]
    if not os.path.isfile(executable) or not os.access(executable, os.X_OK):
        raise ConfigError(KEY, f"{executable} is not an executable file")
    if "-m" in argv[1:-1]:
        module = argv[argv.index("-m", 1) + 1]
        _check_module(executable, module)


def _check_module(python: str, module: str) -> None:
    """The module's top-level package must be importable by that interpreter (found, not
    imported: vLLM takes seconds to import)."""
    package = module.split(".", 1)[0]
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ConfigError(KEY, f"{python} does not run: {error}") from None
    if found.returncode != 0:
        raise ConfigError(KEY, f"{python} cannot import {package!r} (for -m {module})")
