"""The quick tier covers every module: a file of the tier imports it by name, or
tests/quick_tier.py THROUGH names the quick test that runs it.

Imports are read from the source (``ast``); ``from package import name`` counts for
the module that defines ``name``. A package ``__init__`` without code and a
``__main__`` that only calls its package's ``main`` need no test of their own.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from package_source import imported_module, modules, package_of, parse, source
from quick_tier import TESTS, THROUGH, WHOLE_FILES

TESTS_DIR = Path(__file__).resolve().parent


def _docstring_only(path: Path) -> bool:
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in parse(path).body)


@functools.cache
def _library() -> frozenset[str]:
    """The modules that need a quick test: not a ``__main__``, not a docstring-only package."""
    return frozenset(m for m, path in modules().items()
                     if path.name != "__main__.py" and not (path.name == "__init__.py" and _docstring_only(path)))


def _defining_module(module: str, name: str, library: frozenset[str]) -> str:
    """The module ``from module import name`` reaches: a submodule, or the module that
    ``module`` re-exports ``name`` from (an import, or a lazy ``_EXPORTS`` table), read, not run."""
    if f"{module}.{name}" in library:
        return f"{module}.{name}"
    path = source(module)
    if path is None:
        return module
    for node in parse(path).body:
        if isinstance(node, ast.ImportFrom) and node.level and any(a.name == name for a in node.names):
            return _defining_module(imported_module(module, node), name, library)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            table = ast.literal_eval(node.value)
            if name in table:
                return _defining_module(f"{package_of(module)}.{table[name].lstrip('.')}", name, library)
    return module


@functools.cache
def _imported_by_the_tier(library: frozenset[str]) -> frozenset[str]:
    found = set()
    for name in sorted(WHOLE_FILES | TESTS.keys()):
        for node in ast.walk(parse(TESTS_DIR / name)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ulysses_dtensor"):
                found.add(node.module)
                found.update(_defining_module(node.module, a.name, library) for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ulysses_dtensor"))
    return frozenset(found)


def _in_the_tier(entry: str) -> bool:
    name, _, test = entry.partition("::")
    if not (TESTS_DIR / name).is_file():
        return False
    if name in WHOLE_FILES:
        return not test or any(isinstance(n, ast.FunctionDef) and n.name == test
                               for n in parse(TESTS_DIR / name).body)
    return bool(test) and test in TESTS.get(name, ())


def test_every_module_runs_in_the_quick_tier():
    library = _library()
    missing = sorted(library - _imported_by_the_tier(library) - THROUGH.keys())
    assert not missing, (f"modules no quick test runs: {missing}; import them in a quick test, or name the "
                         f"quick test that runs them in tests/quick_tier.py THROUGH")


def test_through_names_quick_tests_of_existing_modules():
    library = _library()
    wrong = [f"{m}: {t}" for m, t in THROUGH.items() if m not in library or not _in_the_tier(t)]
    assert not wrong, f"tests/quick_tier.py THROUGH entries naming no module or no quick test: {wrong}"
    # Entries a direct import already covers would hide a stale claim: none.
    direct = sorted(THROUGH.keys() & _imported_by_the_tier(library))
    assert not direct, f"THROUGH entries the tier imports by name anyway (remove them): {direct}"


def test_a_new_module_without_a_quick_test_is_found():
    # The check itself: a module nobody imports is reported, a docstring-only package is not,
    # and a name imported from a package counts for the module that defines it.
    assert _defining_module("ulysses_dtensor", "shard_batch", _library()) == "ulysses_dtensor.parallel.batch"
    assert _defining_module("ulysses_dtensor.attention", "local_attention", _library()) == "ulysses_dtensor.attention.local"
    library = _library() | frozenset({"ulysses_dtensor.nowhere"})
    assert "ulysses_dtensor.nowhere" in library - _imported_by_the_tier(library) - THROUGH.keys()
    assert "ulysses_dtensor.memory" not in _library()  # its __init__ is a docstring
