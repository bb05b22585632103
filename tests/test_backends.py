"""The backends' one seam: every backend module has the interface, the registry is the one
list of names, and the config check names the field and the choices for any other name."""

from __future__ import annotations

import inspect
import pkgutil

import pytest

from servematrix import backends
from servematrix.backends import BACKENDS, Backend
from servematrix.spec.matrix import ConfigError
from servematrix.workflow import check_config
from tests.conftest import ROOT

SHARED = {"run", "served", "cell", "identity", "prefixstats"}
"""The package's modules that are not backends: what a run hands back, what servers share,
running one cell, its identity, the prefix-cache hits it reports."""


def _members() -> set[str]:
    """The interface's members (constants and methods), as a module must spell them."""
    methods = {name for name, _ in inspect.getmembers(Backend, inspect.isfunction)}
    return set(Backend.__annotations__) | {m for m in methods if not m.startswith("_")}


def test_every_backend_module_is_registered_once_under_its_own_name():
    modules = {m.name for m in pkgutil.iter_modules(backends.__path__)} - SHARED
    assert sorted(modules) == sorted(BACKENDS)
    assert all(name == module.NAME for name, module in BACKENDS.items())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_has_the_whole_interface(name):
    module = BACKENDS[name]
    assert isinstance(module, Backend)
    assert {m for m in _members() if not hasattr(module, m)} == set()
    for member in ("run", "identity", "caveat"):
        assert callable(getattr(module, member))
    flags = ("MEASURED", "ENGINE_MODEL", "DEPLOYS", "REAL_HARDWARE", "SETS_FLAGS")
    assert all(isinstance(getattr(module, flag), bool) for flag in flags)
    assert isinstance(backends.conda_env(name, "v1"), str)


def test_the_virtual_time_backends_deploy_nothing():
    """A prediction starts no processes and needs no hardware of the node."""
    virtual = backends.names(MEASURED=False)
    assert virtual == ["simulator"]
    assert not any(BACKENDS[n].DEPLOYS or BACKENDS[n].REAL_HARDWARE for n in virtual)


def test_the_schema_leaves_the_choice_of_backend_to_the_registry(small_config):
    """One line naming the field and the registry's choices, for a backend nobody has."""
    small_config["backend"] = "tgi"
    with pytest.raises(ConfigError) as raised:
        check_config(small_config)
    message = str(raised.value)
    assert "\n" not in message
    assert message == f"config error at backend: 'tgi' is not one of {list(BACKENDS)}"


def test_every_registered_backend_passes_the_config_check(small_config):
    for name in BACKENDS:
        raw = {**small_config, "backend": name}
        if name == "external":
            raw["base_url"] = "http://127.0.0.1:1/v1"
        assert check_config(raw).backend == name


def test_a_backends_own_preflight_names_its_key(small_config):
    """External starts nothing: the config must say where its server is."""
    with pytest.raises(ConfigError, match=r"^config error at base_url: backend external needs"):
        check_config({**small_config, "backend": "external"})


def test_the_deployments_a_recipe_builds_are_the_backends_that_deploy():
    """deploy/ sits below the backends: its own list of the two deployments must agree."""
    from servematrix.deploy.recipes import DEPLOYED_BACKENDS

    assert sorted(DEPLOYED_BACKENDS) == sorted(backends.names(DEPLOYS=True))


def test_the_architecture_page_lists_every_module_of_the_package():
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("\nbackends/\n", 1)[1].split("\nresults/\n", 1)[0]
    listed = {
        line.split()[0] for line in block.splitlines() if line.startswith("  ") and line[2] != " "
    }
    assert listed == {m.name for m in pkgutil.iter_modules(backends.__path__)} | {"__init__"}
