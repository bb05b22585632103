"""The package's house (`benchmarks/house.py`, docs/architecture.md): one package per layer,
no import circle, nothing importing from a layer above its own."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.benchmark_modules import load

(house,) = load("house")


def test_the_package_has_no_circle_and_no_upward_import():
    found = house.survey()
    assert found.circles == ()
    assert found.upward_imports == ()
    assert found.upward_type_only_imports == ()
    names = ("cli", "dryrun", "preflight", "workflow")
    assert found.top_level_modules == tuple(f"servematrix.{n}" for n in names)


def test_every_subpackage_is_a_layer():
    found = house.modules()
    layers = {house.layer(name, found) for name in found if name != "servematrix"}
    assert layers == set(house.LAYERS)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "servematrix" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "servematrix"


def test_a_circle_and_upward_imports_are_found(tmp_path):
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "common/__init__.py": "",
            "common/files.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from servematrix.spec import matrix
                def f():
                    from servematrix.spec.matrix import Cell
            """,
            "spec/__init__.py": "",
            "spec/matrix.py": "from servematrix.spec import slo\n",
            "spec/slo.py": "from . import matrix\n",
            "cli.py": "from servematrix.common import files\n",
        },
    )
    found = house.survey(package)
    assert found.circles == (("servematrix.spec.matrix", "servematrix.spec.slo"),)
    assert found.upward_imports == ("servematrix.common.files -> servematrix.spec.matrix",)
    assert found.upward_type_only_imports == (
        "servematrix.common.files -> servematrix.spec.matrix",
    )
    assert found.top_level_modules == ("servematrix.cli",)
