"""runtime/regions.py: the library's profiler regions.

* with no profiler a region is the shared no-op (nothing is recorded, nothing allocated);
* under a profiler it is a ``record_function`` named ``ud.<name>``, and forward code
  re-run in backward by activation checkpointing is named ``ud.<name>.recompute``;
* a transformer block with its regions compiles with ``fullgraph=True``, and turning the
  profiler on does not recompile it (no guard on the profiler's state);
* every region the package marks is listed, with its meaning, in ``REGIONS``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from ulysses_dtensor.models.llama import TransformerBlock, llama_args
from ulysses_dtensor.runtime import regions
from ulysses_dtensor.runtime.regions import REGIONS, in_region, region, split_region_name

PACKAGE = Path(regions.__file__).resolve().parents[1]


def _marked_names(events) -> list[str]:
    return [e.name for e in events if split_region_name(e.name) is not None]


@in_region("mlp")
def _mlp(x: torch.Tensor) -> torch.Tensor:
    with region("proj.o"):
        y = x @ x
    return torch.relu(y)


def test_without_a_profiler_a_region_is_the_shared_no_op():
    assert region("mlp") is regions._NO_REGION
    assert region("attention") is region("mlp")
    with region("mlp") as ctx:
        assert ctx is None


def test_regions_are_recorded_and_recompute_is_told_apart():
    x = torch.randn(8, 8, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _mlp(x).sum().backward()
    assert _marked_names(prof.events()) == ["ud.mlp", "ud.proj.o"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        checkpoint(_mlp, x, use_reentrant=False).sum().backward()
    assert _marked_names(prof.events()) == ["ud.mlp", "ud.proj.o", "ud.mlp.recompute", "ud.proj.o.recompute"]
    assert split_region_name("ud.mlp.recompute") == ("mlp", True)
    assert split_region_name("ud.ulysses.layout") == ("ulysses.layout", False)
    assert split_region_name("aten::mm") is None


def test_a_block_with_regions_compiles_whole_and_the_profiler_does_not_recompile_it():
    import torch._dynamo

    torch._dynamo.reset()
    args = llama_args("debug", qk_norm=True)
    block = TransformerBlock(0, args)
    x = torch.randn(1, 16, args.dim)
    cos = sin = torch.ones(1, 16, args.head_dim // 2)
    explained = torch._dynamo.explain(block)(x, cos, sin)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, backend=count, fullgraph=True)
    compiled(x, cos, sin)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x, cos, sin)
    assert len(graphs) == 1  # no guard on the profiler flag, so no second graph
    assert not _marked_names(prof.events())  # compiled code carries no region of ours
    torch._dynamo.reset()


def _marked_in_package() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("region", "in_region") \
                    and node.args and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value)
    return found


def test_every_marked_region_is_listed_and_every_listed_one_is_marked():
    assert _marked_in_package() == set(REGIONS)
