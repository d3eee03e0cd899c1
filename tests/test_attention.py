"""Local attention backends against a naive float64 reference.

CPU tests cover sdpa fully (forward + backward, GQA/MQA, packed documents) and the
error paths of the CUDA-only backends; flex is forward-only on CPU in torch 2.13.
GPU tests run every backend in bf16 against the same reference where CUDA exists.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ulysses_dtensor import attention as A
from ulysses_dtensor.attention import (
    BACKENDS,
    LocalAttention,
    check_backend,
    cu_seqlens_from_document_ids,
    default_backend,
    document_ids_from_position_ids,
    local_attention,
)
from ulysses_dtensor.attention import select as S
from ulysses_dtensor.attention import documents as D

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- #
# Reference and helpers
# --------------------------------------------------------------------------- #


def reference_attention(q, k, v, causal=True, document_ids=None, scale=None, window=None, softcap=None, sinks=None):
    """softmax(cap(Q K^T * scale) + mask [, sink]) V in float64, kv heads repeated; (B, S, H, D) layout.

    Written from transformers' eager paths: window W keeps keys j with i - j < W
    (``sliding_window_overlay``), soft-capping after scaling (Gemma2), a sink
    logit per head joining the softmax and then dropped (gpt-oss).
    """
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    q64, k64, v64 = q.double(), k.double(), v.double()
    k64 = k64.repeat_interleave(rep, dim=2)
    v64 = v64.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bihd,bjhd->bhij", q64, k64) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.ones(b, 1, s, s, dtype=torch.bool, device=q.device)
    i = torch.arange(s, device=q.device)
    if causal:
        allowed &= i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    if document_ids is not None:
        allowed &= (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, hq, 1, 1).expand(b, hq, s, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v64)


def make_qkv(b, s, hq, hkv, d, dtype=torch.float32, device="cpu", seed=0, requires_grad=True, dv=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [(b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d if dv is None else dv)]
    ts = [torch.randn(sh, generator=g).to(device=device, dtype=dtype) for sh in shapes]
    for t in ts:
        t.requires_grad_(requires_grad)
    return ts


def docs_from_lengths(rows):
    """[[5, 11, 16], [20, 12]] -> (B, S) int64 document ids, one row per list."""
    out = []
    for lengths in rows:
        out.append(torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)]))
    return torch.stack(out)


# Two rows with different layouts; doc 0 of row 0 spans 5 tokens, etc.
DOC_LENGTHS = [[5, 11, 16], [20, 1, 3, 8]]


def grads_vs_reference(q, k, v, out, ref, atol, rtol, extra=(), atol_of_max=0.0):
    """Backprop the same random cotangent through both and compare q/k/v (and ``extra``) grads.

    ``atol_of_max``: an absolute tolerance of at least this share of the largest
    reference gradient, for 16-bit kernels whose rounding scales with the tensor.
    """
    g = torch.Generator(device="cpu").manual_seed(123)
    cot = torch.randn(out.shape, generator=g).to(out.device)
    inputs = (q, k, v, *extra)
    got = torch.autograd.grad((out.float() * cot).sum(), inputs)
    want = torch.autograd.grad((ref * cot.double()).sum(), inputs)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        tol = max(atol, atol_of_max * b.abs().max().item())
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


# --------------------------------------------------------------------------- #
# sdpa on CPU: outputs and gradients
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_matches_reference(causal, hq, hkv):
    q, k, v = make_qkv(2, 24, hq, hkv, 16)
    out = local_attention(q, k, v, backend="sdpa", causal=causal)
    ref = reference_attention(q, k, v, causal=causal)
    assert out.shape == (2, 24, hq, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grads_vs_reference(q, k, v, out, ref, atol=1e-5, rtol=1e-5)


def test_sdpa_custom_scale_and_module():
    q, k, v = make_qkv(1, 16, 4, 2, 8)
    out = LocalAttention("sdpa", causal=True, scale=0.3)(q, k, v)
    ref = reference_attention(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_sdpa_documents_match_reference(causal, hq, hkv):
    docs = docs_from_lengths(DOC_LENGTHS)
    q, k, v = make_qkv(2, 32, hq, hkv, 16, seed=1)
    out = local_attention(q, k, v, backend="sdpa", causal=causal, document_ids=docs)
    ref = reference_attention(q, k, v, causal=causal, document_ids=docs)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grads_vs_reference(q, k, v, out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sdpa_no_cross_document_attention(causal):
    docs = docs_from_lengths(DOC_LENGTHS)
    q, k, v = make_qkv(2, 32, 4, 2, 16, seed=2, requires_grad=False)
    out = local_attention(q, k, v, causal=causal, document_ids=docs)

    # Scramble every q/k/v entry of document 0 in both rows.
    in_doc0 = docs == 0
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[in_doc0] = torch.randn_like(t[in_doc0]) * 10
    out2 = local_attention(q2, k2, v2, causal=causal, document_ids=docs)

    in_doc1 = docs == 1
    assert torch.equal(out[in_doc1], out2[in_doc1])
    # ...while document 0 itself did change (the perturbation was real).
    assert not torch.allclose(out[in_doc0], out2[in_doc0])


def test_document_ids_are_runs_not_values():
    # An id value that reappears later in the row is a new document: all backends
    # cut at id changes, so the dense mask must too.
    docs = torch.tensor([[0, 0, 0, 1, 1, 0, 0, 0]])
    runs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    q, k, v = make_qkv(1, 8, 2, 2, 4, requires_grad=False)
    out = local_attention(q, k, v, causal=False, document_ids=docs)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, False, runs))
    cu, _ = cu_seqlens_from_document_ids(docs)
    assert cu.tolist() == [0, 3, 5, 8]


def test_half_precision_output_dtype():
    q, k, v = make_qkv(1, 16, 4, 2, 8, dtype=torch.bfloat16, requires_grad=False)
    out = local_attention(q, k, v, document_ids=docs_from_lengths([[6, 10]]))
    assert out.dtype == torch.bfloat16


# --------------------------------------------------------------------------- #
# Document bookkeeping
# --------------------------------------------------------------------------- #


def test_document_ids_from_position_ids():
    pos = torch.tensor(
        [
            [0, 1, 2, 0, 1, 0, 1, 2, 3, 4],
            # starts mid-document; a jump (7 after 2) and a repeat (4 after 4) also cut
            [5, 6, 7, 0, 1, 2, 7, 8, 4, 4],
        ]
    )
    expect = torch.tensor(
        [
            [0, 0, 0, 1, 1, 2, 2, 2, 2, 2],
            [0, 0, 0, 1, 1, 1, 2, 2, 3, 4],
        ]
    )
    got = document_ids_from_position_ids(pos)
    assert got.dtype == torch.int64
    assert torch.equal(got, expect)
    # Global positions of an unpacked row are a single document.
    assert torch.equal(
        document_ids_from_position_ids(torch.arange(6).expand(2, 6)), torch.zeros(2, 6, dtype=torch.long)
    )


def test_cu_seqlens_from_document_ids():
    docs = torch.tensor(
        [
            [0, 0, 0, 1, 1, 2, 2, 2],
            [0, 1, 1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0, 0, 0],
        ]
    )
    cu, max_len = cu_seqlens_from_document_ids(docs)
    assert cu.dtype == torch.int32
    # Row boundaries end documents: row 0 -> 3, 2, 3; row 1 -> 1, 7; row 2 -> 8.
    assert cu.tolist() == [0, 3, 5, 8, 9, 16, 24]
    assert max_len == 8
    assert isinstance(max_len, int)

    # Round trip from position ids (same id value in consecutive rows stays split).
    pos = torch.tensor([[0, 1, 0, 1, 2, 3], [2, 3, 4, 0, 1, 2]])
    cu, max_len = cu_seqlens_from_document_ids(document_ids_from_position_ids(pos))
    assert cu.tolist() == [0, 2, 6, 9, 12] and max_len == 4


# --------------------------------------------------------------------------- #
# flex on CPU: forward only
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_docs", [False, True], ids=["nodocs", "docs"])
def test_flex_forward_on_cpu_matches_sdpa(causal, with_docs):
    # torch 2.13 CPU: eager flex forward works (unfused); backward is not implemented.
    docs = docs_from_lengths(DOC_LENGTHS) if with_docs else None
    q, k, v = make_qkv(2, 32, 8, 2, 16, seed=3, requires_grad=False)
    out = local_attention(q, k, v, backend="flex", causal=causal, document_ids=docs)
    ref_sdpa = local_attention(q, k, v, backend="sdpa", causal=causal, document_ids=docs)
    torch.testing.assert_close(out, ref_sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal, docs), atol=1e-5, rtol=1e-5)


def test_flex_on_cpu_with_grad_raises_clear_error():
    q, k, v = make_qkv(1, 16, 2, 2, 8)
    with pytest.raises(RuntimeError, match=r"'flex' has no backward on CPU.*'sdpa'"):
        local_attention(q, k, v, backend="flex")


def test_flex_on_cpu_under_no_grad_accepts_trainable_inputs():
    # torch itself refuses CPU flex for inputs that require grad even under
    # no_grad (e.g. evaluation with parameters upstream); we detach there.
    q, k, v = make_qkv(1, 16, 2, 2, 8)
    with torch.no_grad():
        out = local_attention(q, k, v, backend="flex")
    torch.testing.assert_close(out.double(), reference_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_flex_block_mask_cache_tracks_document_ids():
    q, k, v = make_qkv(1, 16, 2, 2, 8, requires_grad=False)
    docs = docs_from_lengths([[4, 12]])
    out1 = local_attention(q, k, v, backend="flex", document_ids=docs)
    # In-place edit bumps the version counter: the cached mask must not be reused.
    docs[0, 4:8] = 0
    out2 = local_attention(q, k, v, backend="flex", document_ids=docs)
    torch.testing.assert_close(out2.double(), reference_attention(q, k, v, True, docs), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out1, out2)


# --------------------------------------------------------------------------- #
# CUDA-only backends on CPU, lazy import, names
# --------------------------------------------------------------------------- #


def test_varlen_on_cpu_raises_clear_error():
    q, k, v = make_qkv(1, 16, 2, 2, 8, dtype=torch.bfloat16, requires_grad=False)
    with pytest.raises(ValueError, match=r"'varlen' runs on CUDA only.*device 'cpu'.*'sdpa'"):
        local_attention(q, k, v, backend="varlen")


def test_flash_attn_on_cpu_raises_device_error():
    q, k, v = make_qkv(1, 16, 2, 2, 8, dtype=torch.bfloat16, requires_grad=False)
    with pytest.raises(ValueError, match=r"'flash_attn' runs on CUDA only.*device 'cpu'.*'sdpa'"):
        local_attention(q, k, v, backend="flash_attn", document_ids=torch.zeros(1, 16, dtype=torch.long))


def test_flash_attn_missing_names_the_extra(monkeypatch):
    # A None entry in sys.modules makes `import flash_attn` raise ImportError,
    # whether or not the package is installed.
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ImportError, match=r"pip install 'ulysses-dtensor\[flash\]'"):
        A._import_flash_attn()
    # Without flash-attn, CUDA in 16-bit on a GPU the table does not give to cuDNN (here: no
    # CUDA, a GPU of unknown capability; tests/test_kernel_table.py has every GPU's rows) falls
    # to torch's varlen (this torch has it) ...
    assert default_backend("cuda") == "varlen"
    assert default_backend(torch.device("cuda", 0), torch.bfloat16) == "varlen"
    # ... and to sdpa when neither FlashAttention entry point exists.
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)
    assert default_backend("cuda", torch.float16) == "sdpa"


def test_default_backend_cpu_and_fp32():
    assert default_backend("cpu") == "sdpa"
    assert default_backend(torch.device("cpu"), torch.bfloat16) == "sdpa"
    # The FlashAttention kernels are 16-bit only: fp32 on CUDA stays on sdpa.
    assert default_backend("cuda", torch.float32) == "sdpa"


def test_auto_backend_runs_sdpa_on_cpu():
    # 'auto' is the default everywhere and resolves per call: on CPU it is
    # exactly sdpa, forward and backward, with and without documents.
    assert LocalAttention().backend == "auto"
    docs = docs_from_lengths([[5, 11], [16]])
    for document_ids in (None, docs):
        q, k, v = make_qkv(2, 16, 4, 2, 8, seed=3)
        ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = LocalAttention()(q, k, v, document_ids=document_ids)
        ref = local_attention(*ref_in, backend="sdpa", document_ids=document_ids)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        out.sum().backward()
        ref.sum().backward()
        for got, want in zip((q, k, v), ref_in):
            torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0)


def test_module_import_does_not_import_flash_attn():
    # A meta-path hook fails loudly on any attempt to import flash_attn, which also
    # catches a guarded try/except import that would leave no trace when absent.
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "flash_attn" or name.startswith("flash_attn."):
                    raise AssertionError("flash_attn import attempted: " + name)
                return None
        sys.meta_path.insert(0, Block())
        import torch
        import ulysses_dtensor.attention as A
        import ulysses_dtensor.trainer.loop
        # torch._dynamo costs every process ~1.5 s to import: only compiling imports it.
        assert "torch._dynamo" not in sys.modules, "importing the trainer imported torch._dynamo"
        assert A.default_backend("cpu") == "sdpa"
        A.LocalAttention("flash_attn")
        assert "flash_attn" not in sys.modules
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_constant_marker_is_what_torch_compiler_sets():
    # select.py marks its backend lookup constant to torch.compile without importing
    # torch._dynamo; torch's own decorator must mark a function the same way.
    from ulysses_dtensor.attention.select import _constant_to_compile, _machine_refusal, _named_refusal, _resolved_auto

    def theirs():
        return 0

    def ours():
        return 0

    torch.compiler.assume_constant_result(theirs)
    _constant_to_compile(ours)
    assert theirs.__dict__ == ours.__dict__ == {"_dynamo_marked_constant": True}
    assert _resolved_auto._dynamo_marked_constant and _machine_refusal._dynamo_marked_constant
    assert _named_refusal._dynamo_marked_constant


def test_varlen_signature_probe_is_a_compile_time_constant():
    # Compiled blocks ask which keywords torch's varlen_attn takes: dynamo must call
    # that probe at trace time, not trace a cached function (a warning on torch 2.11).
    import warnings

    from ulysses_dtensor.attention.packed import _varlen_accepts

    def scaled(x):
        return x * 2 if _varlen_accepts("scale") else x - 1

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(scaled, fullgraph=True, backend="eager")(torch.ones(3))
    assert [str(w.message) for w in caught if "lru_cache" in str(w.message)] == []
    assert torch.equal(out, scaled(torch.ones(3)))
    assert _varlen_accepts._dynamo_marked_constant and not _varlen_accepts("no_such_keyword")


def test_check_backend_suggests_nearest():
    for name in BACKENDS:
        assert check_backend(name) == name
    with pytest.raises(ValueError) as e:
        check_backend("sdpaa")
    msg = str(e.value)
    assert "'sdpaa'" in msg and "auto, sdpa, flex, varlen, flash_attn" in msg and "did you mean 'sdpa'?" in msg
    with pytest.raises(ValueError, match="did you mean 'flash_attn'"):
        LocalAttention("flash-attn")
    with pytest.raises(ValueError, match="unknown attention backend 'xyz'"):
        local_attention(*make_qkv(1, 4, 1, 1, 4, requires_grad=False), backend="xyz")


@pytest.mark.parametrize(
    "shapes,doc_shape,match",
    [
        (((2, 8, 4, 16), (2, 8, 4), (2, 8, 4)), None, "4-D q, k, v"),
        (((2, 8, 4, 16), (2, 8, 3, 16), (2, 8, 3, 16)), None, r"query heads \(4\) .* key/value heads \(3\)"),
        (((2, 8, 4, 16), (2, 9, 2, 16), (2, 9, 2, 16)), None, "batch, seq and head_dim"),
        (((2, 8, 4, 16), (2, 8, 2, 8), (2, 8, 2, 8)), None, "batch, seq and head_dim"),
        (((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 1, 16)), None, "k and v must agree in batch, seq and heads"),
        (((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)), (2, 7), r"document_ids must have shape \(batch, seq\) = \(2, 8\); got \(2, 7\)"),
    ],
)
def test_shape_errors(shapes, doc_shape, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    docs = None if doc_shape is None else torch.zeros(doc_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        local_attention(q, k, v, document_ids=docs)


def test_repeat_kv_grouping_matches_sdpa_gqa():
    # Query head i must read kv head i // (Hq // Hkv), SDPA's enable_gqa grouping;
    # the repeat path is what CUDA uses with a mask, so pin it against enable_gqa.
    q, k, v = make_qkv(1, 8, 8, 2, 4, requires_grad=False)
    kr, vr = A._repeat_kv(k, 4), A._repeat_kv(v, 4)
    for i in range(8):
        assert torch.equal(kr[:, :, i], k[:, :, i // 4])
    tq, tk, tv = (t.transpose(1, 2) for t in (q, k, v))
    native = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        tq, kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True
    )
    torch.testing.assert_close(native, repeated)


# --------------------------------------------------------------------------- #
# Glue of the CUDA-only backends, run on CPU against fake kernels
# --------------------------------------------------------------------------- #
# The real kernels need CUDA. These fakes implement their documented contracts
# (packed (T, H, D) tensors cut by int32 cu_seqlens) with the reference, so the
# flattening, document cuts, causal flag and GQA handling around them are tested.


def _per_segment_reference(q, k, v, cu, max_len, causal, scale, window_size=(-1, -1), softcap=None):
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == q.shape[0]
    # The real kernels take one head dim for q, k and v.
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, k.shape, v.shape)
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert max(lengths) <= max_len
    # FlashAttention's (left, right) window: key j visible to query i iff
    # i - left <= j <= i + right (-1: unbounded). Causal kernels use right = 0.
    left, right = window_size
    assert right in (-1, 0) and (right == -1 or causal or left == -1)
    window = None if left < 0 else left + 1
    pieces = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        pieces.append(reference_attention(q[None, a:b], k[None, a:b], v[None, a:b], causal, None, scale,
                                          window=window, softcap=softcap)[0])
    return torch.cat(pieces).to(q.dtype)


def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                     block_table=None, num_splits=None):
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    # torch's flash API (no SDPA dispatcher in front to pad) takes head dims that are multiples of 8.
    assert query.shape[-1] % 8 == 0, query.shape
    assert enable_gqa or query.shape[1] == key.shape[1]
    causal = tuple(window_size)[1] == 0
    return _per_segment_reference(query, key, value, cu_seq_q, max_q, causal, scale, tuple(window_size))


def _fake_flash_module():
    import types

    mod = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0):
        assert dropout_p == 0.0
        b = q.shape[0]
        cu = torch.arange(0, (b + 1) * q.shape[1], q.shape[1], dtype=torch.int32)
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out = _per_segment_reference(*flat, cu, q.shape[1], causal, softmax_scale, window_size, softcap or None)
        return out.reshape(*q.shape[:3], -1)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0):
        assert torch.equal(cu_q, cu_k) and max_q == max_k and dropout_p == 0.0
        return _per_segment_reference(q, k, v, cu_q, max_q, causal, softmax_scale, window_size, softcap or None)

    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


@pytest.fixture
def cuda_checks_off(monkeypatch):
    monkeypatch.setattr(S, "kernel_refusal", lambda *args, **kwargs: None)
    import torch.nn.attention.varlen as varlen_mod

    monkeypatch.setattr(varlen_mod, "varlen_attn", fake_varlen_attn)
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module())
    D.DOC_CACHE.clear()
    yield
    D.DOC_CACHE.clear()


@pytest.mark.parametrize("backend", ["varlen", "flash_attn"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_docs", [False, True], ids=["nodocs", "docs"])
def test_packed_backends_glue_with_fake_kernels(cuda_checks_off, backend, causal, with_docs):
    docs = docs_from_lengths(DOC_LENGTHS) if with_docs else None
    q, k, v = make_qkv(2, 32, 8, 2, 16, seed=7)
    out = local_attention(q, k, v, backend=backend, causal=causal, document_ids=docs, scale=0.2)
    ref = reference_attention(q, k, v, causal, docs, scale=0.2)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    grads_vs_reference(q, k, v, out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- #
# GPU: every backend against the reference in bf16
# --------------------------------------------------------------------------- #

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# bf16 kernels round P and dS to bf16 before their products, so gradient errors
# scale with the gradient: on an H200 (torch 2.11) varlen's dq with a 0.3 scale
# and a 128-wide v (|dq| up to 15) missed an elementwise 5e-2; a CPU model of
# that rounding (bf16 P and dS, fp32 sums) misses it on 9 of 327,680 elements
# by up to 0.076, 0.5 % of the largest.
BF16_GRAD_OF_MAX = 1e-2


def _skip_if_unavailable(backend, head_dim=64, v_head_dim=None):
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    if backend == "varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    if backend in ("cudnn", "fa4"):  # not on this GPU / torch / cuDNN, or the package is absent: skipped, saying why
        why = S.backend_refusal(backend, torch.device("cuda"), torch.bfloat16, head_dim, v_head_dim)
        if why:
            pytest.skip(f"{backend}: {why}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_docs", [False, True], ids=["nodocs", "docs"])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_gpu_backends_match_reference_bf16(backend, causal, with_docs, hq, hkv):
    _skip_if_unavailable(backend)
    # 320 tokens: not a multiple of flex's 128 block, documents straddle blocks.
    s = 320
    docs = docs_from_lengths([[5, 11, 100, 204], [200, 1, 119]]).cuda() if with_docs else None
    q, k, v = make_qkv(2, s, hq, hkv, 64, dtype=torch.bfloat16, device="cuda", seed=5)
    out = local_attention(q, k, v, backend=backend, causal=causal, document_ids=docs)
    ref = reference_attention(q, k, v, causal=causal, document_ids=docs)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    grads_vs_reference(q, k, v, out, ref, atol=5e-2, rtol=5e-2, atol_of_max=BF16_GRAD_OF_MAX)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_backends_no_cross_document_attention(backend):
    _skip_if_unavailable(backend)
    docs = docs_from_lengths([[64, 192]]).cuda()
    q, k, v = make_qkv(1, 256, 4, 2, 64, dtype=torch.bfloat16, device="cuda", seed=6, requires_grad=False)
    out = local_attention(q, k, v, backend=backend, document_ids=docs)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :64] = torch.randn_like(t[:, :64]) * 10
    out2 = local_attention(q2, k2, v2, backend=backend, document_ids=docs)
    torch.testing.assert_close(out[:, 64:], out2[:, 64:], atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_default_backend():
    # The probe reads this GPU, and auto's plain causal kernel is the table's rule for it:
    # cuDNN on Hopper / sm100 with a cuDNN above 9.15.0, else FlashAttention.
    from ulysses_dtensor.attention import Capabilities

    caps = Capabilities.read("cuda")
    assert caps.sm == torch.cuda.get_device_capability() and caps.cudnn == torch.backends.cudnn.version()
    cudnn = (caps.sm[0] in (9, 10) and (caps.cudnn or 0) > 91500 and caps.torch_version >= (2, 10)
             and torch.backends.cuda.cudnn_sdp_enabled() and not caps.cudnn_deprioritized)
    expect = "cudnn" if cudnn else "fa4" if caps.fa4 and caps.sm[0] in (9, 10) else "flash_attn"
    if expect == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            expect = "varlen" if A._has_varlen() else "sdpa"
    assert default_backend("cuda", torch.bfloat16) == expect
    assert default_backend("cuda", torch.float32) == "sdpa"


@pytest.mark.gpu
@needs_cuda
def test_gpu_cudnn_runs_cudnn_kernels_in_forward_recompute_and_backward():
    # The restriction is entered inside the attention call: a checkpointed block's recompute
    # (in backward) runs cuDNN too, and no FlashAttention kernel runs.
    _skip_if_unavailable("cudnn", 128)
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint

    q, k, v = make_qkv(1, 1024, 8, 2, 128, dtype=torch.bfloat16, device="cuda", seed=2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = checkpoint(lambda q, k, v: local_attention(q, k, v, backend="cudnn"), q, k, v, use_reentrant=False)
        out.sum().backward()
        torch.cuda.synchronize()
    kernels = [e.name.lower() for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("cudnn" in n for n in kernels) >= 3, kernels  # forward, recompute, backward
    assert not any("flash" in n and "cudnn" not in n for n in kernels), kernels  # torch's FA2: pytorch_flash::
    ref = reference_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
