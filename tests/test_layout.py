"""The package layout docs/layout.md describes: imports flow one way, no circles, one name per file.

Read from the source (``ast``), lazy imports inside functions included: a circle
closed by a lazy import is still two modules that cannot be read alone.
"""

from __future__ import annotations

import ast
import functools
from collections import Counter, defaultdict

from package_source import imported_module, modules, parse

# Lowest first: a module may import its own layer and the layers below it, never above.
LAYERS = (
    {"parallel", "memory", "attention", "mixers", "data", "models", "runtime", "precision"},  # the building blocks
    {"integrations"},  # other libraries' models on top of the blocks
    {"torchtitan"},  # integrations/torchtitan: a plug-in on top of integrations
    {"trainer", "estimate", "evaluation", "export", "train", "eval", "prepare_data"},  # what a user runs
)


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, lazy imports included."""
    edges = defaultdict(set)
    library = modules()
    for name, path in library.items():
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom):
                target = imported_module(name, node)
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            edges[name].update(c for c in candidates if c in library and c != name)
    return edges


def _layer(module: str) -> int | None:
    parts = module.split(".")[1:]
    if not parts:
        return None  # the package's own __init__: public names, loaded lazily
    key = "torchtitan" if parts[:2] == ["integrations", "torchtitan"] else parts[0]
    return next(i for i, names in enumerate(LAYERS) if key in names)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


# The building blocks among themselves, lowest first (docs/layout.md): a block imports its own
# package and the blocks below it. attention/ holds the packed documents' ids every block reads.
BLOCKS = (
    {"runtime"},
    {"attention"},
    {"parallel"},
    {"memory", "mixers", "data", "precision"},
    {"models"},
)


def _block(module: str) -> int | None:
    parts = module.split(".")[1:]
    return next((i for i, names in enumerate(BLOCKS) if parts and parts[0] in names), None)


def test_every_module_belongs_to_a_layer():
    unknown = [m for m in modules() if m != "ulysses_dtensor" and _layer(m) is None]
    assert not unknown, f"modules outside every layer of tests/test_layout.py LAYERS: {unknown}"


def test_imports_flow_one_way():
    upward = [f"{m} imports {t}" for m, targets in _imports().items() for t in sorted(targets)
              if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m)]
    assert not upward, "imports against the layering of docs/layout.md:\n" + "\n".join(upward)


def test_building_blocks_stack_in_order():
    upward = [f"{m} imports {t}" for m, targets in _imports().items() for t in sorted(targets)
              if _block(m) is not None and _block(t) is not None and _block(t) > _block(m)]
    assert not upward, "building blocks importing a block above them (docs/layout.md):\n" + "\n".join(upward)


def test_no_import_circles():
    circles = _circles(_imports())
    assert not circles, f"modules that import each other (directly or around a circle): {circles}"


def test_one_name_per_file():
    names = Counter(p.name for p in modules().values() if p.name not in ("__init__.py", "__main__.py"))
    twice = sorted(n for n, k in names.items() if k > 1)
    assert not twice, f"file names used by more than one module: {twice}"


def test_the_checks_catch_a_circle_and_an_upward_import():
    # The helpers themselves: a circle of three is found, an upward edge is ranked above.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(edges) == [["a", "b", "c"]]
    assert _layer("ulysses_dtensor.parallel.mesh") < _layer("ulysses_dtensor.integrations.hf")
    assert _layer("ulysses_dtensor.integrations.hf") < _layer("ulysses_dtensor.integrations.torchtitan.trainer")
    assert _layer("ulysses_dtensor.integrations.torchtitan.trainer") < _layer("ulysses_dtensor.trainer.loop")
