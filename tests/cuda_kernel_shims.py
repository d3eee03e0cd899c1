"""torch's CUDA attention kernels, as far as a CPU can stand in for them.

The ring (``ring_kernels``) calls torch's CUDA kernels directly, past SDPA's
dispatcher, so nothing pads or checks for it. Three stand-ins let CPU tests
reach those calls:

* :class:`CheckedAten`: the aten ops the ring calls, which first assert the
  preconditions torch's CUDA kernels enforce (16-bit FlashAttention, head dims
  a multiple of 8 up to 256, last dims contiguous -- dout included --, the
  memory-efficient kernel's equal head counts and 16-aligned bias rows; cuDNN's
  16-bit, head dims a multiple of 8 up to 128, dout laid out as out, its
  (B, H, Sq, 1) float32 log-sum-exp given back to its backward), then
  run the real op: its meta kernel on meta tensors (shapes), or with
  ``numeric=True`` SDPA's CPU flash kernel (values, in any float dtype:
  padding, cropping and layouts checked exactly).
* :data:`CUDNN_SCHEMAS`: the cuDNN attention ops' schemas the ring is written
  against (the installed torch 2.13's, pinned by a test). Torch 2.11's are taken
  to be the same -- the arguments have not changed since the op gained
  ``attn_bias`` (torch 2.5), and torch's own ring (``_context_parallel``) calls
  them so -- which a GPU run with torch 2.11 confirms (the ring rows of
  ``scripts/gpu_attention_matrix.py``).
* :data:`T211`: the ``torch_attn`` varlen ops with torch 2.11.0's schemas
  (``torch/nn/attention/varlen.py`` of 2.11: ten forward arguments, ending
  at ``window_size``; the installed torch may have more), registered under
  the test namespace ``ulysses_test_t211`` with the same preconditions and a
  meta kernel, plus a CPU kernel that attends per document (values).
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _check_flash(*tensors, half: bool = True) -> None:
    d = tensors[0].shape[-1]
    for t in tensors:
        assert t.stride(-1) == 1, f"FlashAttention needs a contiguous last dim, got stride {t.stride()}"
        assert t.shape[-1] == d, "FlashAttention takes one head dim for q, k, v (and dout, out)"
        assert not half or t.dtype in FLASH_DTYPES, f"FlashAttention takes fp16/bf16 only, got {t.dtype}"
    assert d % 8 == 0 and d <= 256, f"FlashAttention needs a head dim that is a multiple of 8, <= 256; got {d}"


def _check_cudnn(q, k, v, half: bool = True) -> None:
    for t in (q, k, v):
        assert t.stride(-1) == 1, f"cuDNN attention needs a contiguous last dim, got stride {t.stride()}"
        assert not half or t.dtype in FLASH_DTYPES, f"cuDNN attention takes fp16/bf16 only, got {t.dtype}"
    for d in (q.shape[-1], v.shape[-1]):
        assert d % 8 == 0 and d <= 128, f"cuDNN attention needs head dims that are multiples of 8, <= 128; got {d}"
    _check_gqa(q.shape[1], k.shape[1])


def _check_gqa(q_heads: int, kv_heads: int) -> None:
    assert q_heads % kv_heads == 0, (q_heads, kv_heads)


def _check_efficient(q, k, v, bias, *more) -> None:
    for t in (q, k, v, *more):
        assert t.stride(-1) == 1, f"memory-efficient attention needs a contiguous last dim, got {t.stride()}"
        assert t.dtype in (torch.float32, *FLASH_DTYPES), t.dtype
    assert q.shape[1] == k.shape[1] == v.shape[1], "memory-efficient attention takes no GQA: equal head counts"
    if bias is not None:
        b, h, m, _ = q.shape
        assert bias.dtype == q.dtype, f"bias dtype {bias.dtype} must be the query's {q.dtype}"
        assert tuple(bias.shape) == (b, h, m, k.shape[2]), f"bias {tuple(bias.shape)} must be (B, H, Sq, Sk)"
        assert bias.stride(-1) == 1 and all(st % 16 == 0 for st in bias.stride()[:-1]), (
            f"bias rows must be 16-element aligned, got strides {bias.stride()}"
        )


class CheckedAten:
    """Stand-in for ``torch.ops.aten`` in ``ring_kernels`` (monkeypatch ``_aten``)."""

    def __init__(self, numeric: bool = False):
        self.numeric = numeric
        self.half = not numeric  # numeric runs (float64) leave the dtype contract to meta runs
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(_aten, name)

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, causal, debug, *, scale=None):
        self.calls.append("flash")
        _check_flash(q, k, v, half=self.half)
        _check_gqa(q.shape[1], k.shape[1])
        if not self.numeric:
            return _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, causal, debug, scale=scale)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, causal, scale=scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cq, ck, mq, mk, p, causal,
                                                     seed, offset, *, scale=None):
        self.calls.append("flash_backward")
        _check_flash(dout, q, k, v, out, half=self.half)
        if not self.numeric:
            return _aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, mq, mk, p, causal, seed, offset, scale=scale)
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, p, causal,
                                                                           scale=scale)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, lse, p, causal, debug, *, scale=None):
        self.calls.append("cudnn")
        _check_cudnn(q, k, v, half=self.half)
        assert bias is None and lse and p == 0.0 and not debug, (bias, lse, p, debug)
        if not self.numeric:
            return _aten._scaled_dot_product_cudnn_attention(q, k, v, bias, lse, p, causal, debug, scale=scale)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, p, causal, scale=scale)
        seed = torch.zeros((), dtype=torch.long)
        return out, lse[..., None], None, None, q.shape[2], k.shape[2], seed, seed, None

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, lse, seed, offset, bias, cq, ck,
                                                     mq, mk, p, causal, *, scale=None):
        self.calls.append("cudnn_backward")
        _check_cudnn(q, k, v, half=self.half)
        _check_cudnn(q, dout, out, half=self.half)
        assert dout.stride() == out.stride(), f"cuDNN reads dout with out's strides: {dout.stride()} {out.stride()}"
        assert lse.dtype == torch.float32 or self.numeric, lse.dtype
        assert tuple(lse.shape) == (*q.shape[:3], 1), f"cuDNN's log-sum-exp is (B, H, Sq, 1), got {lse.shape}"
        assert (mq, mk) == (q.shape[2], k.shape[2]) and cq is None and ck is None and bias is None
        if not self.numeric:
            return _aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, p, causal, scale=scale)
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse[..., 0], p,
                                                                           causal, scale=scale)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, lse, p, causal, *, scale=None):
        self.calls.append("efficient")
        _check_efficient(q, k, v, bias)
        return _aten._scaled_dot_product_efficient_attention(q, k, v, bias, lse, p, causal, scale=scale)

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, seed, offset, p,
                                                         mask, causal, *, scale=None):
        self.calls.append("efficient_backward")
        _check_efficient(q, k, v, bias, dout, out)
        return _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, seed, offset, p, mask, causal, scale=scale)


CUDNN_SCHEMAS = {
    "_scaled_dot_product_cudnn_attention": (
        "aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, "
        "bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool return_debug_mask=False, *, "
        "float? scale=None) -> (Tensor output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, "
        "SymInt max_k, Tensor philox_seed, Tensor philox_offset, Tensor debug_attn_mask)"
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        "aten::_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, "
        "Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, Tensor attn_bias, "
        "Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, float dropout_p, bool is_causal, *, "
        "float? scale=None) -> (Tensor, Tensor, Tensor)"
    ),
}


# --------------------------------------------------------------------------- #
# torch 2.11's varlen ops, under a test namespace
# --------------------------------------------------------------------------- #

NAMESPACE = "ulysses_test_t211"
VARLEN_SCHEMA_2_11 = (
    "_varlen_attn(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, "
    "SymInt max_k, bool is_causal=False, float? scale=None, SymInt[]? window_size=None) -> (Tensor, Tensor, Tensor)"
)
VARLEN_BACKWARD_SCHEMA_2_11 = (
    "_varlen_attn_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
    "Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k, bool is_causal, Tensor rng_state, "
    "float? scale=None, SymInt[]? window_size=None) -> (Tensor, Tensor, Tensor)"
)


def _check_varlen(q, k, v, cu, *more, half=True):
    _check_flash(q, k, v, *more, half=half)
    _check_gqa(q.shape[1], k.shape[1])
    assert cu.dtype == torch.int32 and cu.dim() == 1, cu


def _varlen_meta(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None):
    _check_varlen(q, k, v, cu_q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    return torch.empty_like(q), lse, torch.empty(2, dtype=torch.uint64, device=q.device)


def _varlen_backward_meta(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale=None,
                          window_size=None):
    _check_varlen(q, k, v, cu_q, dout, out)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _documents(cu):
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _varlen_cpu(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None):
    """Per document, SDPA's CPU flash kernel: out (T, H, D), lse (H, T)."""
    _check_varlen(q, k, v, cu_q, half=False)  # numerics in any dtype; meta runs check it
    assert max(b - a for a, b in _documents(cu_q)) <= max_q
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=q.dtype)
    for a, b in _documents(cu_q):
        o, m = _aten._scaled_dot_product_flash_attention_for_cpu(
            *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), 0.0, is_causal, scale=scale)
        out[a:b], lse[:, a:b] = o[0].transpose(0, 1), m[0]
    return out, lse, torch.zeros(2, dtype=torch.int64)


def _varlen_backward_cpu(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale=None,
                         window_size=None):
    _check_varlen(q, k, v, cu_q, dout, out, half=False)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for a, b in _documents(cu_q):
        parts = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t[a:b].transpose(0, 1)[None] for t in (dout, q, k, v, out)), lse[None, :, a:b], 0.0, is_causal,
            scale=scale)
        for g, part in zip(grads, parts):
            g[a:b] = part[0].transpose(0, 1)
    return tuple(grads)


def _register():
    lib = torch.library.Library(NAMESPACE, "DEF")
    lib.define(VARLEN_SCHEMA_2_11)
    lib.define(VARLEN_BACKWARD_SCHEMA_2_11)
    for name, meta, cpu in (("_varlen_attn", _varlen_meta, _varlen_cpu),
                            ("_varlen_attn_backward", _varlen_backward_meta, _varlen_backward_cpu)):
        lib.impl(name, meta, "Meta")
        lib.impl(name, cpu, "CPU")
    return lib


_LIB = _register()  # kept alive for the process: dropping it would unregister the ops
T211 = getattr(torch.ops, NAMESPACE)
