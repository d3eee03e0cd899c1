"""The package read as source (``ast``, nothing imported), for the tests of its layout,
its quick tier and its docs: its modules and their files, parsed trees, and the
module a relative import names."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ulysses_dtensor"


@functools.cache
def modules() -> dict[str, Path]:
    """``ulysses_dtensor.x.y`` -> its file (a package: its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def source(module: str) -> Path | None:
    """The file of ``module`` (None: not a module of the package)."""
    return modules().get(module)


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def package_of(module: str) -> str:
    """The package ``module``'s relative imports start from: itself for a package."""
    return module if source(module).name == "__init__.py" else module.rpartition(".")[0]


def imported_module(module: str, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` names, for that statement in ``module``'s file."""
    if not node.level:
        return node.module or ""
    package = package_of(module).split(".")
    return ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
