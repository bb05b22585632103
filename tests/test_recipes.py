"""The recipe-version registry: one module per version, the only place that names one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from servematrix.deploy.recipes import RECIPES
from servematrix.emulator import disagg
from servematrix.recipes import RECIPE_NAMES, RECIPE_VERSIONS, UnknownRecipeError, recipe_version
from servematrix.spec.config import SCHEMA_PATH

SRC = Path(__file__).resolve().parents[1] / "src" / "servematrix"
COMPARISON = re.compile(r"""recipe\w*\s*[!=]=\s*["']|["']v[0-9]+["']\s*[!=]=\s*\w*recipe""")


def test_each_version_is_registered_under_its_own_name() -> None:
    for name, version in RECIPE_VERSIONS.items():
        assert version.name == version.commands.name == name
        assert RECIPES[name] is version.commands


def test_unknown_recipe_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(UnknownRecipeError) as raised:
        recipe_version("v9")
    assert str(raised.value) == f"unknown recipe 'v9' (known: {', '.join(RECIPE_NAMES)})"


def test_the_config_schema_accepts_exactly_the_registered_versions() -> None:
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    model = schema["properties"]["models"]["additionalProperties"]["properties"]["recipe"]
    study = schema["properties"]["studies"]["additionalProperties"]["properties"]["recipe"]
    assert model["enum"] == study["enum"] == list(RECIPE_NAMES)


def test_the_emulator_plays_every_versions_connector() -> None:
    for version in RECIPE_VERSIONS.values():
        assert version.kv.name in disagg._CONNECTORS


def test_no_module_outside_the_registry_compares_a_recipe_name() -> None:
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in SRC.rglob("*.py")
        if path.parent.name != "recipes"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARISON.search(line)
    ]
    assert not found, "\n".join(found)
