"""The exchange without layout copies: bytes copied around it, and parity with the (B, S/P, H, D) path.

What is proven here (CPU, gloo, float32):

* ``benchmarks/bench_layout_copies.py`` at tiny shapes on sp 2 and sp 4: the bytes copied
  per layer, forward and backward, equal the formulas of its ``expected_bytes``: none for
  our Llama at batch 1 (with kv heads replicated, the replication alone), with head chunks
  too; the (B, S/P, H, D) path and DeepSpeed's ``DistributedAttention`` (when installed) a
  permute copy per tensor each way;
* the send layout changes no number: our Llama's loss and every gradient equal those of
  the (B, S/P, H, D) path within 1e-6 relative, on dp_shard 2 x sp 2, sp 4 (kv heads
  replicated) and ring 2 x ulysses 2, with packed documents, batch 1 and 2, head chunks,
  full activation checkpointing with ``save_attention`` and op-level selective checkpointing
  (compiled blocks: tests/test_parallelize.py and tests/test_save_attention.py run this path);
* the exchange functions on their own (:func:`grouped_attention` between
  :func:`project_to_send` and :func:`project_from_received`) against the style's hooks:
  sinks with a window, MLA's value head dim, biases, ``pack_qkv``, head chunks, batch 2, and
  compiled whole (``fullgraph``) under activation checkpointing with head chunks at batch 1.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from distributed import destroy_subgroups, run_ranks
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from ulysses_dtensor.attention import LocalAttention
from ulysses_dtensor.parallel.head_chunk_plan import valid_head_chunks
from ulysses_dtensor.parallel.mesh import ParallelDims
from ulysses_dtensor.parallel.grouped_exchange import (
    grouped_attention,
    project_from_received,
    project_to_send,
    send_layout,
)
from ulysses_dtensor.parallel.ulysses import UlyssesAttention, kv_replication

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = 1e-6
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------
# Bytes: the benchmark at tiny shapes, one launch of 4 ranks (sp 2 inside dp_shard 2 x sp 2, sp 4)
# ---------------------------------------------------------------------------


def _bytes_worker(rank: int, world: int) -> list[dict]:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_layout_copies as bench

    if HAVE_DEEPSPEED:
        import contextlib

        import deepspeed

        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    records = []
    for dims in (dict(dp_shard=2, sp=2), dict(sp=4)):
        mesh = ParallelDims(**dims).build_mesh("cpu").sp
        for chunks in (1, 2):
            a = bench.parse_args(["--quick", "--head-chunks", str(chunks)])
            for name, shape in a.shapes.items():
                for batch in ((1, 2) if chunks == 1 else (1,)):
                    records.append(bench.run_config(a, name, shape, batch, mesh.get_local_rank(), mesh.size(), mesh,
                                                    HAVE_DEEPSPEED and batch == 1 and chunks == 1))
        destroy_subgroups()
    return records


def test_layout_copy_bytes_equal_the_formulas():
    records = run_ranks(4, _bytes_worker)[0]
    seen = set()
    for rec in records:
        cfg, variants = rec["config"], rec["variants"]
        where = f"{cfg['name']} sp {cfg['sp']} batch {cfg['batch']} chunks {cfg['head_chunks']}"
        assert all(d <= RTOL for d in rec["agreement"].values()), (where, rec["agreement"])
        for name, want in rec["expected"].items():
            if name not in variants or (cfg["head_chunks"] > 1 and name != "ours"):
                continue  # DeepSpeed absent; the formulas of the other paths are for one chunk
            got = {k: variants[name][k] for k in ("forward", "backward")}
            assert got == want, (where, name, got, want, variants[name]["sites"])
            seen.add((name, cfg["batch"]))
        # The rope's rotation writes a new tensor in every variant: compute, listed apart.
        assert variants["ours"]["excluded"], where
    assert {("ours", 1), ("ours", 2), ("ours_4d", 1)} <= seen, seen
    if HAVE_DEEPSPEED:
        assert ("deepspeed", 1) in seen
    # Our Llama at batch 1 copies nothing around the exchange, chunked or not, kv heads split.
    for rec in records:
        cfg = rec["config"]
        if cfg["batch"] == 1 and rec["kv_replication"] == 1:
            assert rec["variants"]["ours"]["total"] == 0, rec["variants"]["ours"]["sites"]


# ---------------------------------------------------------------------------
# Parity: our Llama, send layout against the (B, S/P, H, D) path
# ---------------------------------------------------------------------------


def llama_step(pmesh, args, opts: dict, rows: int, **attention) -> tuple[float, dict]:
    """One forward and backward of our Llama of ``args`` parallelized with ``opts`` on ``pmesh``,
    ``rows`` sequences of the test batch per dp rank: the global loss and every local gradient.
    ``attention``: attributes set on every attention module once parallelized (``grouped_qkv``,
    ``recompute_qk_norm_inputs``)."""
    import test_parallelize as tp

    from ulysses_dtensor.models.llama import Attention, Llama
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import global_loss, sp_cross_entropy

    with torch.device("meta"):
        model = Llama(args)
    parallelize_llama(model, pmesh, **opts)
    for m in model.modules():
        if isinstance(m, Attention):
            for name, value in attention.items():
                setattr(m, name, value)
    model.to_empty(device="cpu")
    model.init_weights(tp.SEED)
    batch = tp.global_batch(0, model.args.vocab_size)
    per = tp.GLOBAL_BATCH // pmesh.dims.dp
    batch = {k: v[pmesh.dp_rank * per:pmesh.dp_rank * per + rows] for k, v in batch.items()}
    local = shard_batch(batch, pmesh.sp)
    logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
    loss = sp_cross_entropy(logits, local["labels"], pmesh.loss)
    loss.backward()
    grads = {tp.canonical(n): p.grad.to_local().clone() for n, p in model.named_parameters()}
    return global_loss(loss.detach(), pmesh.loss).item(), grads


SAVED = {"ac_mode": "full", "save_attention": True}
# mesh -> (flavor, options, rows per rank) cases; "debug" has 8 heads and 4 kv heads, "debug_gqa" 2.
LLAMA_CASES = {
    "dp_shard 2 x sp 2": [("debug", {}, 1), ("debug", {}, 2), ("debug", {"head_chunks": 4, **SAVED}, 1),
                          ("debug", {"ac_mode": "selective"}, 2)],
    "sp 4": [("debug_gqa", {}, 1), ("debug_gqa", {"head_chunks": 2, "ac_mode": "full"}, 2)],
    "ring 2 x ulysses 2": [("debug", {"head_chunks": 2, **SAVED}, 1)],
}
MESHES = {"dp_shard 2 x sp 2": dict(dp_shard=2, sp=2), "sp 4": dict(sp=4), "ring 2 x ulysses 2": dict(sp=4, ring=2)}


def _llama_worker(rank: int, world: int) -> list[dict]:
    from ulysses_dtensor.models.llama import llama_args

    rows = []
    for where, cases in LLAMA_CASES.items():
        pmesh = ParallelDims(**MESHES[where]).build_mesh("cpu")
        for flavor, opts, n in cases:
            loss_4d, grads_4d = llama_step(pmesh, llama_args(flavor), opts, n, grouped_qkv=False)
            loss, grads = llama_step(pmesh, llama_args(flavor), opts, n, grouped_qkv=True)
            worst = max([abs(loss - loss_4d) / abs(loss_4d)] + [_rel(grads[k], g) for k, g in grads_4d.items()])
            rows.append({"mesh": where, "case": f"{flavor} {opts} batch {n}", "rel": worst})
        destroy_subgroups()
    return rows


def test_send_layout_changes_no_number_of_our_llama():
    rows = run_ranks(4, _llama_worker)[0]
    for r in rows:
        print(f"| {r['mesh']} | {r['case']} | {r['rel']:.1e} |")
    assert len(rows) == sum(len(c) for c in LLAMA_CASES.values())
    assert all(r["rel"] <= RTOL for r in rows), [r for r in rows if r["rel"] > RTOL]


# ---------------------------------------------------------------------------
# The exchange functions on their own: sinks, MLA, biases, packing, chunks, batch 2
# ---------------------------------------------------------------------------


class _Layer(nn.Module):
    """Projections around a Ulysses-parallelized LocalAttention, either path."""

    def __init__(self, dim, heads, kv, d, dv, *, bias, window, sinks):
        super().__init__()
        self.heads, self.kv, self.d, self.dv = heads, kv, d, dv
        self.wq = nn.Linear(dim, heads * d, bias=bias)
        self.wk = nn.Linear(dim, kv * d, bias=bias)
        self.wv = nn.Linear(dim, kv * dv, bias=bias)
        self.wo = nn.Linear(heads * dv, dim, bias=bias)
        self.sinks = nn.Parameter(torch.randn(heads)) if sinks else None
        self.inner = LocalAttention("sdpa", window=window)

    def forward(self, x, ids, grouped: bool):
        b, s, _ = x.shape
        extra = {} if self.sinks is None else {"sinks": self.sinks}
        if not grouped:
            q, k, v = (w(x).view(b, s, -1, d) for w, d in ((self.wq, self.d), (self.wk, self.d), (self.wv, self.dv)))
            return self.wo(self.inner(q, k, v, document_ids=ids, **extra).reshape(b, s, -1))
        lay = send_layout(self.inner, b, s, self.heads, self.kv, self.d, self.dv, 4)
        q = project_to_send(x, self.wq, lay.ranks, lay.q_slabs, self.d)
        k = project_to_send(x, self.wk, lay.kv_groups, lay.kv_slabs, self.d)
        v = project_to_send(x, self.wv, lay.kv_groups, lay.kv_slabs, self.dv)
        return project_from_received(grouped_attention(self.inner, lay, q, k, v, document_ids=ids, **extra),
                                     self.wo, lay.q_slabs)


FUNCTION_CASES = {
    # Compiled whole (fullgraph) under activation checkpointing: the chunks' received buffers kept
    # for backward at batch 1, against the (B, S/P, H, D) path run eagerly.
    "compiled, checkpointed, chunks 2, documents": dict(chunks=2, docs=True, compiled=True),
    "sinks + window, bias": dict(sinks=True, window=5, bias=True),
    "MLA v dim 12, documents": dict(dv=12, docs=True),
    "pack_qkv, documents": dict(pack=True, docs=True),
    "chunks 2, sinks, MLA": dict(chunks=2, sinks=True, dv=12),
    "chunks 4, pack, documents": dict(chunks=4, pack=True, docs=True),
    "batch 2, chunks 2": dict(batch=2, chunks=2),
}


def _compiled(layer: _Layer):
    from torch.utils.checkpoint import checkpoint

    def fn(x, ids):
        return checkpoint(layer, x, ids, True, use_reentrant=False)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _function_worker(rank: int, world: int) -> list[dict]:
    rows = []
    for where, dims in (("sp 2", dict(dp_shard=2, sp=2)), ("sp 4", dict(sp=4))):
        mesh = ParallelDims(**dims).build_mesh("cpu").sp
        size, r = mesh.size(), mesh.get_local_rank()
        for name, case in FUNCTION_CASES.items():
            heads, kv, d, dv, b = 8, 2, 8, case.get("dv", 8), case.get("batch", 1)
            chunks = case.get("chunks", 1)
            if case.get("compiled") and where != "sp 2":
                continue  # one compiled mesh: compiling is most of this test's time
            if chunks not in valid_head_chunks(heads // size, kv * kv_replication(heads, kv, size) // size):
                continue  # not a count this mesh allows
            torch.manual_seed(0)
            layer = _Layer(32, heads, kv, d, dv, bias=case.get("bias", False), window=case.get("window"),
                           sinks=case.get("sinks", False))
            style = UlyssesAttention(head_chunks=chunks, pack_qkv=case.get("pack", False))
            parallelize_module(layer.inner, mesh, style)
            seq = 8 * size
            g = torch.Generator().manual_seed(1)
            x = torch.randn(b, seq, 32, generator=g)[:, r * 8:(r + 1) * 8]
            dy = torch.randn(b, seq, 32, generator=g)[:, r * 8:(r + 1) * 8]
            ids = torch.tensor([[0] * 5 + [1] * (seq - 12) + [2] * 7] * b) if case.get("docs") else None
            results = []
            for grouped in (False, True):
                xin = x.clone().requires_grad_()
                layer.zero_grad()
                out = _compiled(layer)(xin, ids) if grouped and case.get("compiled") else layer(xin, ids, grouped)
                out.backward(dy)
                results.append([out.detach(), xin.grad] + [p.grad.clone() for p in layer.parameters()])
            rows.append({"mesh": where, "case": name,
                         "rel": max(_rel(a, b_) for a, b_ in zip(results[1], results[0]))})
        destroy_subgroups()
    return rows


def test_exchange_functions_match_the_hooks():
    rows = run_ranks(4, _function_worker)[0]
    for r in rows:
        print(f"| {r['mesh']} | {r['case']} | {r['rel']:.1e} |")
    assert {r["mesh"] for r in rows} == {"sp 2", "sp 4"}
    assert len(rows) >= 10, rows
    assert all(r["rel"] <= RTOL for r in rows), [r for r in rows if r["rel"] > RTOL]
