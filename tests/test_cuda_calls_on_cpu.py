"""The CUDA-only paths, proven as far as a CPU can (no GPU has run them).

* Kernel calls: every route the ring takes on CUDA runs on meta tensors
  against stand-ins that assert the preconditions of torch's CUDA kernels, and
  the varlen ops under torch 2.11's schemas as well as the installed ones
  (``cuda_kernel_shims``); padding and layouts are checked for values by
  running the same calls on CPU kernels in float64.
* Routing: which kernel or backend runs, and what is refused, is decided by
  pure functions, tested here for ``device_type="cuda"``.
* Per-batch work: host syncs of the ring's document bookkeeping and builds of
  flex block masks are counted over several layers; compiled flex and its
  block-mask builder are compiled once and never fall back silently.
"""

from __future__ import annotations

import warnings

import cuda_kernel_shims as shims
import pytest
import torch
from test_attention import docs_from_lengths, make_qkv, reference_attention
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_dtensor.attention import Capabilities, flex, local_attention
from ulysses_dtensor.attention.pattern import Pattern
from ulysses_dtensor.attention.select import kernel_refusal, resolve_backend
from ulysses_dtensor.attention import documents as D
from ulysses_dtensor.parallel import ring as R
from ulysses_dtensor.parallel import ring_kernels as K
from ulysses_dtensor.attention.documents import cu_seqlens_from_document_ids
from ulysses_dtensor.parallel.ring import layout_indices
from ulysses_dtensor.parallel.ring_kernels import PairKernel, kernel_for

BF16, FP32 = torch.bfloat16, torch.float32
CUDA = torch.device("cuda")
H100 = Capabilities.target("H100", "2.11")  # cuDNN 9.15.1: the table gives plain causal to cuDNN

# --------------------------------------------------------------------------- #
# Routing: pure functions, decided for CUDA on any machine
# --------------------------------------------------------------------------- #


def test_ring_routes_each_pair_by_device_dtype_and_head_dim():
    assert kernel_for("cuda", BF16, 64, False) == PairKernel("flash", 64)
    assert kernel_for("cuda", BF16, 64, True) == PairKernel("varlen", 64)
    # FlashAttention is 16-bit only: float32 documents go to the memory-efficient kernel.
    assert kernel_for("cuda", FP32, 64, True) == PairKernel("efficient", 64)
    assert kernel_for("cuda", FP32, 64, False) == PairKernel("efficient", 64)
    # torch's flash API wants head dims that are multiples of 8 (up to 256): padded.
    for d, padded in ((80, 80), (96, 96), (128, 128), (20, 24), (36, 40), (250, 256)):
        assert kernel_for("cuda", BF16, d, True) == PairKernel("varlen", padded), d
    assert kernel_for("cuda", torch.float16, 264, False) == PairKernel("efficient", 264)
    assert kernel_for("cpu", BF16, 20, True) == PairKernel("cpu_flash", 20)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32 tensors; got torch.float64"):
        kernel_for("cuda", torch.float64, 64, False)
    # The plain pairs follow the local kernel table: cuDNN where it gives plain causal attention to it.
    assert kernel_for("cuda", BF16, 64, False, H100) == PairKernel("cudnn", 64)
    assert kernel_for("cuda", torch.float16, 20, False, H100) == PairKernel("cudnn", 24)
    assert kernel_for("cuda", BF16, 64, True, H100) == PairKernel("varlen", 64)  # documents: cu_seqlens
    assert kernel_for("cuda", BF16, 200, False, H100) == PairKernel("flash", 200)  # over cuDNN's 128
    assert kernel_for("cuda", FP32, 64, False, H100) == PairKernel("efficient", 64)
    assert kernel_for("cuda", BF16, 64, False, Capabilities.target("A100")) == PairKernel("flash", 64)
    old = Capabilities.target("H100", cuda="12.8")  # cuDNN 9.10.2: the trap row, FlashAttention-2
    assert kernel_for("cuda", BF16, 64, False, old) == PairKernel("flash", 64)
    # With documents the slices of a document shared across chunks (down to one token) run flash.
    ids = docs_from_lengths([[5, 20, 7], [32]])[:, layout_indices(32, 2)]
    kernels = tuple(kernel_for("cuda", BF16, 64, documents, H100) for documents in (False, True))
    calls = [c for i in range(2) for c in R._calls(i, 0, -i % 2, 2, True, 16, R.ring_documents(ids, 2), kernels)]
    assert {c.kernel.name for c in calls if not c.diagonal} == {"flash"}
    assert {c.kernel.name for c in R._calls(1, 0, 1, 2, True, 16, None, kernels)} == {"cudnn"}

    # The ring's diagonal pairs follow: runs for varlen, a dense mask otherwise.
    ids = docs_from_lengths([[5, 20, 7], [32]])[:, layout_indices(32, 2)]
    docs = R.ring_documents(ids, 2)
    for dtype, kind in ((BF16, "varlen"), (FP32, "efficient")):
        kernels = tuple(kernel_for("cuda", dtype, 64, documents) for documents in (False, True))
        diagonal = [c for c in R._calls(0, 0, 0, 2, True, 16, docs, kernels) if c.diagonal]
        assert [c.kernel.name for c in diagonal] == [kind, kind]
        assert all((c.runs is not None) == (kind == "varlen") and (c.mask is None) == (kind == "varlen")
                   for c in diagonal)


def test_local_backends_refused_or_rerouted_for_tensors_they_cannot_take():
    assert kernel_refusal("varlen", "cuda", BF16, 128) is None
    assert kernel_refusal("sdpa", "cuda", torch.float64, 512) is None
    assert "float16 or bfloat16" in kernel_refusal("varlen", "cuda", FP32, 64)
    assert "up to 256" in kernel_refusal("flash_attn", "cuda", BF16, 288)
    assert "CUDA only" in kernel_refusal("flash_attn", "cpu", BF16, 64)
    # auto moves on to a backend that can; a named backend is refused with the reason.
    assert resolve_backend("auto", frozenset(), CUDA, BF16, 288) == "sdpa"
    assert resolve_backend("auto", frozenset(), CUDA, FP32, 64) == "sdpa"
    with pytest.raises(ValueError, match=r"'varlen' needs float16 or bfloat16 inputs.*got torch.float32"):
        resolve_backend("varlen", frozenset(), CUDA, FP32, 64)
    with pytest.raises(ValueError, match=r"'flash_attn' takes head dims up to 256.*got 288"):
        resolve_backend("flash_attn", frozenset({"window"}), CUDA, BF16, 288)


def test_trainer_refuses_a_backend_before_any_step():
    from ulysses_dtensor.models.llama import llama_args
    from ulysses_dtensor.trainer.config import ConfigError
    from ulysses_dtensor.trainer.config_checks import check_attention_kernel

    args = llama_args("debug")
    check_attention_kernel("auto", args, "cuda", FP32)
    check_attention_kernel("varlen", args, "cuda", BF16)
    with pytest.raises(ConfigError, match=r"model.attn_backend='varlen' \(head dim 8, torch.float32 on cuda.*"
                                          r"mixed_precision_param.*needs float16 or bfloat16"):
        check_attention_kernel("varlen", args, "cuda", FP32)


# --------------------------------------------------------------------------- #
# Kernel calls on meta tensors: preconditions, and torch 2.11's schemas
# --------------------------------------------------------------------------- #


def _meta(*shape, dtype):
    return torch.empty(shape, device="meta", dtype=dtype)


# (dtype, head dim, documents): every route, with head dims the flash API must get padded.
ROUTES = [(BF16, 64, False), (BF16, 20, False), (BF16, 64, True), (BF16, 36, True), (FP32, 64, True),
          (FP32, 20, False), (BF16, 264, False)]


@pytest.mark.parametrize("dtype,d,documents", ROUTES)
def test_every_cuda_route_meets_the_kernel_preconditions(monkeypatch, dtype, d, documents):
    aten = shims.CheckedAten()
    monkeypatch.setattr(K, "_aten", aten)
    monkeypatch.setattr(K, "_varlen_ops", lambda: shims.T211)
    kernel = kernel_for("cuda", dtype, d, documents)
    q, k = _meta(2, 4, 32, d, dtype=dtype), _meta(2, 2, 32, d, dtype=dtype)  # GQA 4:2
    mask = _meta(2, 1, 32, 32, dtype=dtype) if documents and kernel.name == "efficient" else None
    runs = (_meta(5, dtype=torch.int32), 22) if kernel.name == "varlen" else None
    out, lse, state = K.pair_forward(kernel, q, k, k, True, None, mask, runs)
    assert (out.shape, lse.shape) == (q.shape, q.shape[:3])
    # The gradient of out.sum() is an expanded scalar (stride 0): the kernels need a contiguous last dim.
    dout = _meta(dtype=dtype).expand(q.shape)
    grads = K.pair_backward(kernel, dout, q, k, k, out, lse, True, None, state, mask)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert aten.calls or kernel.name == "varlen"


@pytest.mark.parametrize("d,hkv", [(64, 2), (20, 4), (128, 1)], ids=["gqa", "padded", "mqa"])
def test_cudnn_pair_route_meets_the_kernel_preconditions(monkeypatch, d, hkv):
    aten = shims.CheckedAten()
    monkeypatch.setattr(K, "_aten", aten)
    kernel = kernel_for("cuda", BF16, d, False, H100)
    assert kernel.name == "cudnn"
    q, k = _meta(2, 4, 32, d, dtype=BF16), _meta(2, hkv, 32, d, dtype=BF16)
    out, lse, state = K.pair_forward(kernel, q, k, k, True, None)
    assert (out.shape, lse.shape, lse.dtype) == (q.shape, q.shape[:3], torch.float32)  # the merge's layout
    dout = _meta(dtype=BF16).expand(q.shape)  # out.sum()'s gradient: stride 0
    grads = K.pair_backward(kernel, dout, q, k, k, out, lse, True, None, state)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert aten.calls == ["cudnn", "cudnn_backward"]


def test_cudnn_calls_fit_the_schemas_the_ring_is_written_against():
    for name, schema in shims.CUDNN_SCHEMAS.items():
        assert str(getattr(torch.ops.aten, name).default._schema) == schema, name


@pytest.mark.parametrize("ops", ["torch 2.11", "installed"])
def test_varlen_calls_fit_the_torch_2_11_and_installed_schemas(monkeypatch, ops):
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn)

    namespace = shims.T211 if ops == "torch 2.11" else torch.ops.torch_attn
    monkeypatch.setattr(K, "_varlen_ops", lambda: namespace)
    names = [a.name for a in namespace._varlen_attn.default._schema.arguments]
    assert names[:10] == ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
                          "scale", "window_size"]
    assert len(names) == 10 or ops == "installed"
    q, k = _meta(2, 4, 32, 64, dtype=BF16), _meta(2, 2, 32, 64, dtype=BF16)
    kernel, runs = PairKernel("varlen", 64), (_meta(5, dtype=torch.int32), 22)
    out, lse, state = K.pair_forward(kernel, q, k, k, True, 0.125, None, runs)
    grads = K.pair_backward(kernel, out, q, k, k, out, lse, True, 0.125, state)
    assert [g.shape for g in (out, lse, *grads)] == [q.shape, q.shape[:3], q.shape, k.shape, k.shape]


# --------------------------------------------------------------------------- #
# The same calls for values (CPU kernels, float64): padding and layouts exact
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("d", [20, 64])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_cuda_routes_compute_the_cpu_kernels_values(monkeypatch, d, scale):
    monkeypatch.setattr(K, "_aten", shims.CheckedAten(numeric=True))
    monkeypatch.setattr(K, "_varlen_ops", lambda: shims.T211)
    g = torch.Generator().manual_seed(d)
    q, k, v, dout = (torch.randn(2, h, 24, d, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    seg = docs_from_lengths([[5, 12, 7], [24]])
    cu, longest = cu_seqlens_from_document_ids(seg)
    plain = PairKernel("cpu_flash", d)
    for kernel, mask, runs in ((kernel_for("cuda", BF16, d, False), None, None),
                               (kernel_for("cuda", BF16, d, False, H100), None, None),
                               (kernel_for("cuda", BF16, d, True), R._dense_mask(seg, True).double(), (cu, longest))):
        out, lse, state = K.pair_forward(kernel, q, k, v, True, scale, runs=runs)
        want_out, want_lse, _ = K.pair_forward(plain, q, k, v, True, scale, mask)
        torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
        grads = K.pair_backward(kernel, dout, q, k, v, out, lse, True, scale, state)
        want = K.pair_backward(plain, dout, q, k, v, want_out, want_lse, True, scale, None, mask)
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- #
# Once per batch: host syncs, block masks, compiled builders
# --------------------------------------------------------------------------- #


class HostSyncs(TorchDispatchMode):
    """Counts device-to-host reads: .item() (_local_scalar_dense), nonzero, and
    .tolist() (which on CPU dispatches nothing, so it is counted by a patch)."""

    OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        tolist = torch.Tensor.tolist

        def counted(t):
            self.count += 1
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


def test_ring_reads_documents_to_the_host_once_per_batch(monkeypatch):
    ring, s = 2, 16  # ring rank 0's block of a 32-token sequence
    ids = docs_from_lengths([[5, 20, 7], [3, 29]])[:, layout_indices(32, ring)]
    kernels = tuple(kernel_for("cuda", BF16, 64, documents) for documents in (False, True))

    def steps(layers: int) -> int:
        D.DOC_CACHE.clear()
        with HostSyncs(monkeypatch) as syncs:
            for _ in range(layers):  # what each layer does on the host, forward then backward
                docs = R.ring_documents(ids, ring)
                for _ in ("forward", "backward"):
                    for i in range(ring):
                        calls = R._calls(i, 0, -i % ring, ring, True, s, docs, kernels)
        return syncs.count, calls, docs.seg

    one, _, _ = steps(1)
    four, calls, seg = steps(4)
    assert one == four == 3, (one, four)  # the edges' tolist; the runs' nonzero and tolist
    for c in calls:  # the runs are the chunk's documents
        if c.diagonal:
            p = 0 if c.q_rows.start == 0 else 2 * ring - 1
            cu, longest = cu_seqlens_from_document_ids(seg[:, p * 8 : (p + 1) * 8])
            assert c.runs[0].tolist() == cu.tolist() and c.runs[1] == longest


def test_flex_builds_each_block_mask_once_per_batch(monkeypatch):
    # Layers alternating a sliding window and full attention (gpt-oss, Gemma3).
    built = []
    build = flex._build_block_mask
    monkeypatch.setattr(flex, "_build_block_mask", lambda *a: built.append(a[1]) or build(*a))
    D.DOC_CACHE.clear()
    q, k, v = make_qkv(1, 16, 2, 1, 8, requires_grad=False)
    docs = docs_from_lengths([[6, 10]])
    for batch in range(2):
        for layer in range(4):
            window = 4 if layer % 2 else None
            out = local_attention(q, k, v, backend="flex", document_ids=docs, window=window)
            torch.testing.assert_close(out.double(), reference_attention(q, k, v, True, docs, window=window),
                                       atol=1e-5, rtol=1e-5)
        assert len(built) == 2 * (batch + 1), built
        docs = docs.clone()  # the next batch
    D.DOC_CACHE.clear()


def test_cuda_block_masks_come_from_one_compiled_builder(monkeypatch):
    compiled = []

    def fake_compile(fn, *, recompile_limit=None, **kwargs):
        compiled.append((fn.__name__, recompile_limit))
        return lambda *args, **kw: ("block mask", kw)

    monkeypatch.setattr(torch, "compile", fake_compile)
    flex._compiled_create_block_mask.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # create_block_mask(_compile=True) is deprecated
            for s in (128, 256, 128):
                _, kw = flex._build_block_mask(None, Pattern(), None, s, CUDA)
                assert "_compile" not in kw and kw["device"] == CUDA
    finally:
        flex._compiled_create_block_mask.cache_clear()
    assert compiled == [("create_block_mask", flex.FLEX_RECOMPILE_LIMIT)]


def test_compiled_flex_past_its_recompile_limit_fails_instead_of_running_unfused(monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention

    def shapes(fn, wrap=lambda f, *a: f(*a)):
        for s in (16, 32, 48):  # one graph each (static shapes)
            q = torch.randn(1, 1, s, 16)
            wrap(fn, q, q, q)

    torch._dynamo.reset()
    # torch's own fallback: past the limit it silently runs flex eagerly (unfused, S x S scores).
    with torch._dynamo.config.patch(recompile_limit=2):
        shapes(torch.compile(flex_attention, dynamic=False, backend="eager"))
    torch._dynamo.reset()
    monkeypatch.setattr(flex, "FLEX_RECOMPILE_LIMIT", 2)
    with pytest.raises(RuntimeError, match=r"recompile limit.*S x S scores.*FLEX_RECOMPILE_LIMIT"):
        shapes(flex._compile_flex(backend="eager"), flex._run_compiled)
    torch._dynamo.reset()
