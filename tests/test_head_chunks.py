"""Head chunks: the exchange and the attention kernel chunk by chunk over a rank's heads.

What is proven here (CPU, gloo, float32):

* the plan follows the kv groups (k/v exchanged once where a rank holds one kv
  head), and a count that does not is refused by name -- by the style, by
  ``parallelize_llama``, by the trainer's config and by ``UlyssesArguments``;
  the automatic count and the banner's words;
* each split kernel (forward and backward apart) equals the kernel under autograd;
* chunks change no number: output (or loss) and every gradient equal the
  unchunked run within 1e-6 relative, on dp_shard 2 x sp 2, sp 4 and ring 2 x
  ulysses 2, for packed documents, a window, sinks, soft-capping and MLA's value
  head dim, at the attention and for whole models (our Llama; transformers'
  Gemma2, gpt-oss, DeepSeek-V3), with full activation checkpointing with and
  without ``save_attention`` (whose kernel then runs once per chunk per step)
  and with offload; compiled (``fullgraph``, a checkpointed chunked exchange in
  one graph) and eager;
* overlap: chunk c+1's all-to-all is issued before chunk c's kernel and waited
  after it, in forward and in backward (the dispatched ops, in order).

The planner's ground truth for chunks is in tests/test_estimate.py (a planned step
against a real one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import destroy_subgroups, run_ranks
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_dtensor.attention import AttentionCall, LocalAttention, local_attention
from ulysses_dtensor.parallel.head_chunk_kernels import PairSplit, RecomputeSplit, split_kernel
from ulysses_dtensor.parallel.head_chunk_plan import AUTO_MIN_BYTES, Chunk, auto_head_chunks, chunk_plan, valid_head_chunks
from ulysses_dtensor.parallel.mesh import ParallelDims
from ulysses_dtensor.parallel.ulysses import UlyssesAttention, describe_head_chunks

RTOL = 1e-6  # chunked against unchunked, float32 (the bound)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------
# The plan, the refusals, the automatic count (one process)
# ---------------------------------------------------------------------------


def test_chunks_follow_the_kv_groups():
    # Llama-3-8B on sp 8: 4 query heads and 1 kv head per rank.
    assert valid_head_chunks(4, 1) == [1, 2, 4]
    assert chunk_plan(4, 4, 1) == tuple(Chunk((c, c + 1), (0, 1), c == 0, c == 3) for c in range(4))
    # 8 query heads, 2 kv heads: whole groups (1, 2) or a group's heads split (4, 8).
    assert valid_head_chunks(8, 2) == [1, 2, 4, 8]
    assert chunk_plan(2, 8, 2) == (Chunk((0, 4), (0, 1)), Chunk((4, 8), (1, 2)))
    assert [(c.q, c.kv, c.kv_first, c.kv_last) for c in chunk_plan(4, 8, 2)] == [
        ((0, 2), (0, 1), True, False), ((2, 4), (0, 1), False, True),
        ((4, 6), (1, 2), True, False), ((6, 8), (1, 2), False, True)]
    assert valid_head_chunks(6, 3) == [1, 3, 6]  # 2 chunks would split the middle group's kv head


def test_bad_chunk_counts_are_refused_by_name():
    from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import UlyssesArguments
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.trainer.config import ConfigError, load_config, validate_config

    with pytest.raises(ValueError, match=r"head_chunks=3: a rank holds 4 query and 1 kv heads .* valid: \[1, 2, 4\]"):
        chunk_plan(3, 4, 1)
    with pytest.raises(ValueError, match=r"head_chunks=0 must be a positive integer \(1: no chunks\) or None"):
        UlyssesAttention(head_chunks=0)
    model = Llama(llama_args("debug_gqa"))  # 8 heads, 2 kv heads: 4 and 1 per rank on sp 2
    pmesh = type("P", (), {"dims": ParallelDims(sp=2, world_size=2)})()
    with pytest.raises(ValueError, match=r"parallelize_llama: head_chunks=3: .* valid: \[1, 2, 4\]"):
        parallelize_llama(model, pmesh, head_chunks=3)
    assert model.sp_mesh is None  # nothing was applied
    cfg = load_config(["--model.flavor", "debug_gqa", "--parallelism.sp", "2", "--memory.head_chunks", "3"])
    with pytest.raises(ConfigError, match=r"memory.head_chunks=3: a rank holds 4 query and 1 kv heads"):
        validate_config(cfg, 2, weights=False)
    with pytest.raises(ConfigError, match=r"memory.head_chunks"):
        load_config(["--memory.head_chunks", "-1"])
    with pytest.raises(ValueError, match=r"UlyssesArguments.head_chunks=-2 must be >= 1, or 0 / None"):
        UlyssesArguments(head_chunks=-2)


def test_auto_count_from_the_shapes_and_the_banner():
    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import _head_chunks_banner

    # One layer's q, k, v, output and their gradients for the rank's heads: 2 * S * e * (hq + hk) * (D + Dv).
    per_token = 2 * 2 * (4 + 1) * (128 + 128)
    at = -(-AUTO_MIN_BYTES // per_token)
    assert auto_head_chunks(1, at, 4, 1, 128, 128, 2) == 4
    assert auto_head_chunks(1, at - 1, 4, 1, 128, 128, 2) == 1
    # Llama-3-8B on sp 8 at its planned length: 4 chunks, k/v exchanged once.
    text = describe_head_chunks(None, 7_000_000, 32, 8, 128, 128, 8, 2)
    assert text.startswith("head chunks: 4 (4 query heads per rank, 7,000,000 tokens; auto:") and "once" in text
    assert describe_head_chunks(2, 8192, 32, 8, 128, 128, 8, 2).startswith("head chunks: 2 (") 
    assert describe_head_chunks(None, 8192, 32, 8, 128, 128, 1, 2) == "head chunks: none (no exchange, sp 1)"
    cfg = load_config(["--model.flavor", "debug_gqa", "--parallelism.sp", "2", "--memory.head_chunks", "2"])
    dims = ParallelDims(sp=2, world_size=2)
    assert _head_chunks_banner(cfg, 512, dims).startswith("head chunks: 2 (4 query heads per rank")


def test_split_kernels_equal_the_kernel_under_autograd():
    """The CPU flash kernel split in two (documents and a window as its mask, MLA's v padded),
    and the recompute of any call (soft-cap, sinks), against local_attention's autograd."""
    from test_attention import docs_from_lengths, make_qkv

    ids = docs_from_lengths([[5, 11, 16], [20, 1, 3, 8]])
    cases = [dict(), dict(document_ids=ids), dict(window=6), dict(document_ids=ids, dv=12), dict(dv=4),
             dict(softcap=2.0), dict(sinks=True)]
    for case in cases:
        q, k, v = make_qkv(2, 32, 4, 2, 8, dtype=torch.float64, dv=case.get("dv"))
        sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if case.get("sinks") else None
        call = AttentionCall("sdpa", True, None, case.get("window"), case.get("softcap"), case.get("document_ids"))
        kwargs = dict(backend="sdpa", document_ids=call.document_ids, window=call.window, softcap=call.softcap,
                      sinks=sinks)
        want = local_attention(q, k, v, **kwargs)
        dout = torch.randn_like(want)
        wants = torch.autograd.grad(want, [q, k, v] + ([sinks] if sinks is not None else []), dout)
        qh, kh, vh = (t.detach().transpose(1, 2) for t in (q, k, v))
        kernel = split_kernel(call, None, qh, vh, sinks is not None)
        assert isinstance(kernel, RecomputeSplit if case.get("softcap") or case.get("sinks") else PairSplit), case
        out, kept, meta = kernel.forward(qh, kh, vh, sinks)
        out = out[..., :v.shape[-1]]
        grads = kernel.backward(dout.transpose(1, 2), qh, kh, vh, out, kept, meta, sinks)
        torch.testing.assert_close(out.transpose(1, 2), want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case}: {m}")
        got = [g.transpose(1, 2) for g in grads[:3]] + ([grads[3]] if sinks is not None else [])
        for g, w in zip(got, wants):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m: f"{case}: {m}")


def test_cuda_split_kernels_compute_the_cpu_kernels_values(monkeypatch):
    """The CUDA kernels a chunk runs split (torch's flash, cuDNN, varlen on documents'
    cu_seqlens), through the stand-ins that check their preconditions and compute with the CPU
    kernel (tests/cuda_kernel_shims.py): MLA's v padded to the q/k head dim, q/k padded to a
    multiple of 8, outputs and gradients cropped -- the CPU kernel's values."""
    import cuda_kernel_shims as shims
    from test_attention import docs_from_lengths

    from ulysses_dtensor.attention import Capabilities
    from ulysses_dtensor.attention.documents import cu_seqlens_from_document_ids, segment_ids
    from ulysses_dtensor.attention.pattern import Pattern
    from ulysses_dtensor.parallel import ring_kernels as K
    from ulysses_dtensor.parallel.ring_kernels import PairKernel, kernel_for

    monkeypatch.setattr(K, "_aten", shims.CheckedAten(numeric=True))
    monkeypatch.setattr(K, "_varlen_ops", lambda: shims.T211)
    seg = segment_ids(docs_from_lengths([[5, 12, 7], [24]]))
    runs = cu_seqlens_from_document_ids(seg)
    h100 = Capabilities.target("H100", "2.11")
    for d, dv in ((20, 20), (24, 16), (16, 24)):
        g = torch.Generator().manual_seed(d + dv)
        q, k, v, dout = (torch.randn(2, h, 24, e, generator=g, dtype=torch.float64)
                         for h, e in ((4, d), (2, d), (2, dv), (4, dv)))
        width = max(d, dv)
        for kernel, documents in ((kernel_for("cuda", torch.bfloat16, width, False), False),
                                  (kernel_for("cuda", torch.bfloat16, width, False, h100), False),
                                  (kernel_for("cuda", torch.bfloat16, width, True), True)):
            pattern, docs = Pattern(causal=True), seg if documents else None
            split = PairSplit(kernel, pattern, None, docs, runs if kernel.name == "varlen" else None)
            plain = PairSplit(PairKernel("cpu_flash", width), pattern, None, docs)
            outs, grads = [], []
            for kern in (split, plain):
                out, kept, meta = kern.forward(q, k, v, None)
                outs.append(out[..., :dv])
                grads.append(kern.backward(dout, q, k, v, out[..., :dv], kept, meta, None)[:3])
            where = f"{kernel.name} d={d} dv={dv}"
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12, msg=lambda m: f"{where}: {m}")
            for a, b in zip(*grads):
                assert a.shape == b.shape, where
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{where}: {m}")


# ---------------------------------------------------------------------------
# Parity on the meshes: one launch of 4 ranks runs every mesh and case
# ---------------------------------------------------------------------------

B, D = 2, 8


def _attention_case(mesh, case: dict, chunks: int, ring_mesh=None) -> list[torch.Tensor]:
    """Output and gradients of q, k, v (and sinks) of one exchange over ``mesh``."""
    heads, kv, dv = case.get("heads", 8), case.get("kv", 2), case.get("dv", D)
    size = mesh.size() * (ring_mesh.size() if ring_mesh is not None else 1)
    seq = 8 * size
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, seq, h, d, generator=g) for h, d in ((heads, D), (kv, D), (kv, dv)))
    dout = torch.randn(B, seq, heads, dv, generator=g)
    sinks = torch.randn(heads, generator=g).requires_grad_() if case.get("sinks") else None
    ids = torch.tensor([[0] * 5 + [1] * (seq - 12) + [2] * 7, [0] * (seq // 2) + [1] * (seq // 2)]) \
        if case.get("docs") else None
    if ring_mesh is None:
        inner = LocalAttention("sdpa", window=case.get("window"), softcap=case.get("softcap"))
    else:  # transformers' core: ring attention per chunk, MLA's v padded to the q/k head dim
        from ulysses_dtensor.integrations.hf.attention_function import UlyssesCore

        inner = UlyssesCore("sdpa", "test", mesh.size(), ring_mesh)
    inner = parallelize_module(inner, mesh, UlyssesAttention(head_chunks=chunks, pack_qkv=case.get("pack", False)))
    rank = dist.get_rank() % size  # this rank's place in the sequence (ulysses innermost)
    s = seq // size
    local = [t[:, rank * s:(rank + 1) * s].clone().requires_grad_() for t in (q, k, v)]
    out = inner(*local, document_ids=ids, **({} if sinks is None else {"sinks": sinks}))
    grads = torch.autograd.grad(out, local + ([sinks] if sinks is not None else []),
                                dout[:, rank * s:(rank + 1) * s])
    return [out.detach(), *grads]


# name -> the case (8 query heads, 2 kv heads, head dim 8 unless said), on every Ulysses mesh.
ATTENTION_CASES = {
    "documents": dict(docs=True, pack=True),
    "window": dict(window=5),
    "sinks + window": dict(sinks=True, window=5),
    "soft-cap": dict(softcap=3.0, docs=True),
    "MLA v dim 12": dict(dv=12, docs=True),
    "MQA": dict(kv=1),
    "MHA": dict(kv=8),
}


def _attention_rows(mesh, where: str, ring_mesh=None, names=None) -> list[dict]:
    """Every chunk count of every case against one chunk, on this mesh."""
    rows = []
    size = mesh.size()
    for name in names or ATTENTION_CASES:
        case = ATTENTION_CASES[name]
        hq, kv = case.get("heads", 8) // size, case.get("kv", 2)
        hk = max(kv, size) // size if kv % size == 0 or size % kv == 0 else None
        ref = _attention_case(mesh, case, 1, ring_mesh)
        for chunks in valid_head_chunks(hq, hk)[1:]:
            got = _attention_case(mesh, case, chunks, ring_mesh)
            worst = max(_rel(a, b) for a, b in zip(got, ref))
            rows.append({"mesh": where, "case": f"attention, {name}", "chunks": chunks, "rel": worst})
    return rows


def _llama_step(pmesh, opts: dict) -> tuple[float, dict, dict]:
    """One step of the debug Llama (8 heads, 2 kv heads) on packed documents: the loss, this
    rank's gradient shards, and how often the attention kernel ran."""
    import test_parallelize as tp
    from test_save_attention import KernelCounter

    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import global_loss, sp_cross_entropy

    with torch.device("meta"):
        model = Llama(llama_args("debug_gqa"))
    parallelize_llama(model, pmesh, **opts)
    model.to_empty(device="cpu")
    model.init_weights(tp.SEED)
    batch = tp.global_batch(0, model.args.vocab_size)
    per = tp.GLOBAL_BATCH // pmesh.dims.dp
    batch = {k: v[pmesh.dp_rank * per:(pmesh.dp_rank + 1) * per] for k, v in batch.items()}
    local = shard_batch(batch, pmesh.sp)
    with KernelCounter() as counter:
        logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
        loss = sp_cross_entropy(logits, local["labels"], pmesh.loss)
        loss.backward()
    grads = {tp.canonical(n): p.grad.to_local().clone() for n, p in model.named_parameters()}
    return global_loss(loss.detach(), pmesh.loss).item(), grads, {"kernels": counter.kernels}


def _llama_rows(pmesh, where: str, cases: list[tuple[str, dict, int]]) -> list[dict]:
    rows = []
    for name, opts, chunks in cases:
        loss_1, grads_1, info_1 = _llama_step(pmesh, {**opts, "head_chunks": 1})
        loss_c, grads_c, info_c = _llama_step(pmesh, {**opts, "head_chunks": chunks})
        worst = max([abs(loss_c - loss_1) / abs(loss_1)] + [_rel(grads_c[n], g) for n, g in grads_1.items()])
        rows.append({"mesh": where, "case": f"Llama, {name}", "chunks": chunks, "rel": worst,
                     "kernels": (info_1["kernels"], info_c["kernels"])})
    return rows


def _hf_rows(pmesh, where: str, cases: list[tuple[str, dict, int]]) -> list[dict]:
    import test_hf_memory as hm
    from test_hf_integration import registry_restored

    rows = []
    with registry_restored():
        for family, opts, chunks in cases:
            loss_1, grads_1, _ = hm._run(family, pmesh, {**opts, "head_chunks": 1})
            loss_c, grads_c, _ = hm._run(family, pmesh, {**opts, "head_chunks": chunks})
            worst = max([abs(loss_c - loss_1) / abs(loss_1)] + [_rel(grads_c[n], g) for n, g in grads_1.items()])
            rows.append({"mesh": where, "case": f"transformers {family}", "chunks": chunks, "rel": worst})
    return rows


FULL = {"ac_mode": "full"}
SAVED = {"ac_mode": "full", "save_attention": True}


def _parity_worker(rank: int, world: int) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    # dp_shard 2 x sp 2: transformers families with a window and soft-capping (Gemma2), sinks
    # (gpt-oss) and MLA (DeepSeek-V3: 4 kv heads, 2 per rank, a chunk each); our Llama with
    # full AC and save_attention offloaded with the layer inputs.
    pmesh = ParallelDims(1, 2, 2).build_mesh("cpu")
    rows += _attention_rows(pmesh.sp, "dp_shard 2 x sp 2", names=["documents", "sinks + window"])
    rows += _llama_rows(pmesh, "dp_shard 2 x sp 2", [
        ("documents, full AC + save_attention + offload", {**SAVED, "offload_activations": True}, 4),
    ])
    rows += _hf_rows(pmesh, "dp_shard 2 x sp 2", [
        ("gemma2", FULL, 2), ("gpt_oss", {}, 2), ("deepseek_v3", SAVED, 2)])
    destroy_subgroups()
    # sp 4: every attention case; our Llama with full AC, eager and compiled (kv heads replicated).
    pmesh = ParallelDims(sp=4).build_mesh("cpu")
    rows += _attention_rows(pmesh.sp, "sp 4")
    rows += _llama_rows(pmesh, "sp 4", [("documents, full AC", FULL, 2)])
    destroy_subgroups()
    # ring 2 x ulysses 2: ring attention per chunk; our Llama with save_attention.
    pmesh = ParallelDims(sp=4, ring=2).build_mesh("cpu")
    rows += _attention_rows(pmesh.ulysses, "ring 2 x ulysses 2", pmesh.ring, names=["documents", "MLA v dim 12"])
    rows += _llama_rows(pmesh, "ring 2 x ulysses 2", [("documents, full AC + save_attention", SAVED, 4)])
    return rows


def test_chunks_change_no_number_on_every_mesh():
    rows = run_ranks(4, _parity_worker)[0]
    print("\n| mesh | case | chunks | worst relative difference (loss, outputs, gradients) |")
    for r in rows:
        print(f"| {r['mesh']} | {r['case']} | {r['chunks']} | {r['rel']:.1e} |")
    assert all(r["rel"] <= RTOL for r in rows), [r for r in rows if r["rel"] > RTOL]
    meshes = {r["mesh"] for r in rows}
    assert meshes == {"dp_shard 2 x sp 2", "sp 4", "ring 2 x ulysses 2"}
    for r in rows:
        if "kernels" in r:
            # Each chunk runs the kernel calls of the whole, on its heads: with save_attention only
            # in forward (kept, the recompute skips them), else in forward and in the recompute.
            unchunked, chunked = r["kernels"]
            assert chunked == r["chunks"] * unchunked, r
            if "save_attention" in r["case"] and "ring" not in r["mesh"]:
                assert unchunked == 2, r  # one kernel per layer, two layers


# ---------------------------------------------------------------------------
# Overlap: the next chunk's exchange in flight while this chunk's kernel runs
# ---------------------------------------------------------------------------


class _OpLog(TorchDispatchMode):
    """The all-to-alls issued, the waits and the attention kernels, in dispatch order."""

    KERNELS = {"aten::_scaled_dot_product_flash_attention_for_cpu": "kernel",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "kernel_bwd"}

    def __init__(self):
        super().__init__()
        self.events = []
        self.alive = []  # the exchanged tensors, kept so that no id is reused within the log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name == "_c10d_functional::all_to_all_single":
            self.alive.append(out)
            self.events.append(("issue", id(out)))
        elif name == "_c10d_functional::wait_tensor":
            self.events.append(("wait", id(args[0])))
        elif name in self.KERNELS:
            self.events.append((self.KERNELS[name], None))
        return out


def _overlapped(events: list, kernel: str) -> int:
    """Kernels of kind ``kernel`` during which an all-to-all issued before them was still
    unwaited; the check that every one but the last had one."""
    kernels = [i for i, (kind, _) in enumerate(events) if kind == kernel]
    issued = {}
    overlapped = 0
    for i, (kind, key) in enumerate(events):
        if kind == "issue":
            issued[key] = i
    waited = {key: i for i, (kind, key) in enumerate(events) if kind == "wait"}
    for k in kernels[:-1]:
        if any(start < k < waited.get(key, -1) for key, start in issued.items()):
            overlapped += 1
    assert len(kernels) >= 2, events
    return overlapped, len(kernels)


def _checkpointed(inner, compiled: bool):
    """``inner`` under non-reentrant activation checkpointing (full AC's), compiled whole
    (``fullgraph``: the exchange, the chunk loop and the checkpoint in one graph) or not."""
    from torch.utils.checkpoint import checkpoint

    def fn(q, k, v, ids):
        return checkpoint(inner, q, k, v, document_ids=ids, use_reentrant=False)

    return torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn


def _two_ranks_worker(rank: int, world: int) -> dict:
    mesh = ParallelDims(sp=world).build_mesh("cpu").sp
    inner = parallelize_module(LocalAttention("sdpa"), mesh, UlyssesAttention(head_chunks=4))
    q, k, v = (torch.randn(1, 8, h, 8, requires_grad=True) for h in (8, 2, 2))
    with _OpLog() as fwd:
        out = inner(q, k, v)
    with _OpLog() as bwd:
        out.sum().backward()
    result = {"forward": _overlapped(fwd.events, "kernel"), "backward": _overlapped(bwd.events, "kernel_bwd")}
    # The bytes sent: the exchange's (q, k and v once, the output; their gradients), and the
    # output again in backward; every all-to-all of a chunk carries its share.
    from ulysses_dtensor.parallel.comm_stats import CollectiveCounter
    from ulysses_dtensor.parallel.ulysses import exchange_bytes_per_rank

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with CollectiveCounter() as counter:
        inner(q, k, v).sum().backward()
    sent = sum(r.sent_bytes for r in counter.records)
    result["bytes"] = (sent, exchange_bytes_per_rank(1, 8 * world, 8, 2, 8, world, 4, head_chunks=4))
    # Compiled: a checkpointed chunked exchange traced into one graph, against eager without chunks.
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 8 + [1] * 8])
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 8, h, 8, generator=g) for h in (8, 2, 2)]
    runs = []
    for chunks, compiled in ((1, False), (4, True)):
        fn = _checkpointed(parallelize_module(LocalAttention("sdpa"), mesh, UlyssesAttention(head_chunks=chunks)),
                           compiled)
        local = [t.clone().requires_grad_() for t in inputs]
        out = fn(*local, ids)
        runs.append([out.detach(), *torch.autograd.grad(out, local, torch.cos(out.detach()))])
    result["compiled_rel"] = max(_rel(a, b) for a, b in zip(runs[1], runs[0]))
    return result


def test_next_chunks_exchange_is_in_flight_while_this_chunks_kernel_runs_and_compiles():
    result = run_ranks(2, _two_ranks_worker)[0]
    print(result)
    # 4 chunks: chunks 0-2 each had the next chunk's all-to-all issued before and waited after them.
    assert (result["forward"], result["backward"]) == ((3, 4), (3, 4)), result
    assert result["bytes"][0] == result["bytes"][1], result
    assert result["compiled_rel"] <= RTOL, result
