"""The recipe versions: one module per version, one line each in :data:`RECIPE_VERSIONS`.

Adding a version is a new module beside ``v0.py`` / ``v1.py`` (a :class:`RecipeVersion`) and a
line below, plus its name in ``config/schema.yaml`` and its ``envs/vllm-<name>.yaml``; a new KV
connector also needs its player in the emulator and, for a third kind of handoff, the simulator
(docs/architecture.md, "Adding a recipe version").
"""

from __future__ import annotations

from collections.abc import Callable

from servematrix.recipes.base import RecipeVersion
from servematrix.recipes.v0 import V0
from servematrix.recipes.v1 import V1

RECIPE_VERSIONS: dict[str, RecipeVersion] = {"v0": V0, "v1": V1}
RECIPE_NAMES = tuple(RECIPE_VERSIONS)


class UnknownRecipeError(ValueError):
    """A recipe name no module defines."""


def recipe_version(name: str) -> RecipeVersion:
    """The version called ``name``, or one line saying which names exist."""
    try:
        return RECIPE_VERSIONS[name]
    except KeyError:
        known = ", ".join(RECIPE_NAMES)
        raise UnknownRecipeError(f"unknown recipe {name!r} (known: {known})") from None


def recipes_that(holds: Callable[[RecipeVersion], bool]) -> str:
    """The names of the versions for which ``holds``, for messages ("needs recipe v1")."""
    return ", ".join(name for name, version in RECIPE_VERSIONS.items() if holds(version))
