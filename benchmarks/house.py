"""The package's house: its layers, the modules left at the top level, import circles and
imports that go up the layer order (docs/architecture.md).

    .venv/bin/python benchmarks/house.py

Every ``import`` and ``from ... import`` counts, also those inside functions (they run when
the function does); those under ``if TYPE_CHECKING:`` never run and count apart, as type-only.
A layer may import from its own package and from the layers before it in `LAYERS`.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "src" / "servematrix"

LAYERS = (
    "common",
    "workload",
    "recipes",
    "spec",
    "engine",
    "simulate",
    "emulator",
    "proxy",
    "client",
    "calibration",
    "vllmcpu",
    "deploy",
    "backends",
    "results",
    "capacity",
    "reporting",
    "",  # the application at the top level: cli, workflow, preflight, dryrun
)
"""Lowest first. ``data`` holds files, not modules."""


@dataclass(frozen=True)
class House:
    """What `survey` found: module names are dotted, under ``servematrix``."""

    top_level_modules: tuple[str, ...]
    circles: tuple[tuple[str, ...], ...]
    upward_imports: tuple[str, ...]
    upward_type_only_imports: tuple[str, ...]
    modules: int


def modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer(name: str, found: dict[str, Path]) -> str:
    """The layer a module belongs to: its subpackage, or "" at the top level."""
    parts = name.split(".")
    if len(parts) == 2 and found[name].name != "__init__.py":
        return ""
    return parts[1] if len(parts) > 1 else ""


def imports(name: str, path: Path, found: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """The package's modules ``name`` imports, each with whether it is type-only."""
    tree = ast.parse(path.read_text())
    type_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in found else base for t in targets]
        for target in targets:
            while target not in found and "." in target:
                target = target.rsplit(".", 1)[0]
            # The root package holds only ``__version__``: every layer may read it.
            if target in found and target not in (name, "servematrix"):
                yield target, id(node) in type_only


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def survey(package_dir: Path = PACKAGE_DIR) -> House:
    found = modules(package_dir)
    graph: dict[str, set[str]] = {name: set() for name in found}
    upward: set[str] = set()
    upward_type_only: set[str] = set()
    for name, path in found.items():
        for target, type_only in imports(name, path, found):
            if not type_only:
                graph[name].add(target)
            here, there = layer(name, found), layer(target, found)
            if here != there and LAYERS.index(there) > LAYERS.index(here):
                (upward_type_only if type_only else upward).add(f"{name} -> {target}")
    top = tuple(sorted(n for n in found if n != "servematrix" and layer(n, found) == ""))
    return House(
        top_level_modules=top,
        circles=tuple(circles(graph)),
        upward_imports=tuple(sorted(upward)),
        upward_type_only_imports=tuple(sorted(upward_type_only)),
        modules=len(found),
    )


def main() -> None:
    house = survey()
    found = modules()
    print(f"{'layer':<14}{'modules':>8}")
    for name in LAYERS:
        count = sum(1 for m in found if m != "servematrix" and layer(m, found) == name)
        print(f"{name or '(top level)':<14}{count:>8}")
    print(f"\nmodules: {house.modules}")
    print(f"top-level modules: {len(house.top_level_modules)} {list(house.top_level_modules)}")
    print(f"import circles: {len(house.circles)} {list(house.circles)}")
    print(f"upward imports: {len(house.upward_imports)} {list(house.upward_imports)}")
    print(
        f"upward type-only imports: {len(house.upward_type_only_imports)} "
        f"{list(house.upward_type_only_imports)}"
    )


if __name__ == "__main__":
    main()
