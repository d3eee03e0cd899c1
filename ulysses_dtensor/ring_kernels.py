"""Attention kernels for one (query part, key part) pair of a ring step, with their LSE.

Ring attention merges partial results by their log-sum-exp, so every call here
returns ``(out, lse, state)`` and has a backward that takes the FINAL (merged)
``out`` and ``lse`` of its query rows, which gives the exact gradient of the
pair. Layout: q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)`` with ``H % Hkv == 0``
(GQA without repeating kv heads where the kernel allows it); lse ``(B, H, Sq)``.

* CPU: SDPA's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward), which takes GQA k/v and a dense additive mask.
* CUDA, 16-bit, no mask: SDPA's flash kernel (``aten._scaled_dot_product_flash_attention``).
* CUDA, documents on the diagonal pair: FlashAttention varlen with the LSE
  (``torch.ops.torch_attn._varlen_attn``, what ``torch.nn.attention.varlen``
  runs), one sequence per document run of the chunk: no mask.
* CUDA otherwise (float32): SDPA's memory-efficient kernel.

No GPU was lent while this was written: the CUDA calls are checked on meta
tensors only (tests/test_ring.py), i.e. their signatures and shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .documents import cu_seqlens

_aten = torch.ops.aten


def pair_forward(q, k, v, causal: bool, mask: Tensor | None, scale, varlen=None):
    """-> out (B, H, Sq, D), lse (B, H, Sq) float32 (or float64), state for the backward.

    ``mask``: dense additive (B, 1, Sq, Sk) mask (CPU); ``varlen``: the
    diagonal pair's document runs, ``(cu_seqlens, max_len)`` (CUDA).
    """
    if q.device.type == "cuda":
        if varlen is not None:
            return _varlen_forward(q, k, v, causal, scale, varlen)
        return _cuda_forward(q, k, v, causal, scale)
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse, None


def pair_backward(dout, q, k, v, out, lse, causal: bool, mask, scale, state):
    """-> dq (like q), dk, dv (like k, v), for the pair's rows and keys."""
    if q.device.type == "cuda":
        if state[0] == "varlen":
            return _varlen_backward(dout, q, k, v, out, lse, causal, scale, state)
        return _cuda_backward(dout, q, k, v, out, lse, causal, scale, state)
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def varlen_runs(seg_chunk: Tensor) -> tuple[Tensor, int]:
    """(B, C) segment ids of a chunk -> cu_seqlens over the flattened rows and the longest run."""
    cu = cu_seqlens(seg_chunk)
    return cu, int((cu[1:] - cu[:-1]).max().item())


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------


def _cuda_forward(q, k, v, causal, scale):
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, ("flash", cum_q, cum_k, seed, offset)
    # Memory-efficient kernel (any dtype; no GQA: heads repeated).
    kr, vr = _repeat_heads(k, v, q.shape[1])
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, kr, vr, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]], ("efficient", seed, offset)


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, state):
    if state[0] == "flash":
        _, cum_q, cum_k, seed, offset = state
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale,
        )
    _, seed, offset = state
    kr, vr = _repeat_heads(k, v, q.shape[1])
    lse = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel pads LSE rows to 32
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, kr, vr, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, *_sum_repeated(dk, dv, k.shape[1])


def _repeat_heads(k, v, heads: int):
    rep = heads // k.shape[1]
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))


def _sum_repeated(dk, dv, kv_heads: int):
    b, h, s, d = dk.shape
    if h == kv_heads:
        return dk, dv
    return tuple(t.view(b, kv_heads, h // kv_heads, s, d).sum(2) for t in (dk, dv))


def _packed(t: Tensor) -> Tensor:
    """(B, H, S, D) -> (B*S, H, D), varlen's layout."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def _varlen_ops():
    try:  # importing the module registers torch_attn::_varlen_attn and its backward
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError as e:  # pragma: no cover - torch without varlen attention
        raise RuntimeError(
            f"ring attention with packed documents on CUDA needs torch.nn.attention.varlen "
            f"(torch >= 2.10), not in torch {torch.__version__}"
        ) from e
    return torch.ops.torch_attn


def _varlen_forward(q, k, v, causal, scale, varlen):
    cu, max_len = varlen
    b, h, s, d = q.shape
    window = [-1, 0] if causal else [-1, -1]
    out, lse, rng = _varlen_ops()._varlen_attn(
        _packed(q), _packed(k), _packed(v), cu, cu, max_len, max_len, causal, scale, window,
        k.shape[1] != h, None, None, None,
    )
    # out (B*S, H, D), lse (H, B*S) -> the dense layouts the ring merges.
    out = out.view(b, s, h, d).transpose(1, 2)
    lse = lse.view(h, b, s).transpose(0, 1)
    return out, lse, ("varlen", cu, max_len, rng, window)


def _varlen_backward(dout, q, k, v, out, lse, causal, scale, state):
    _, cu, max_len, rng, window = state
    b, h, s, d = q.shape
    dq, dk, dv = _varlen_ops()._varlen_attn_backward(
        _packed(dout), _packed(q), _packed(k), _packed(v), _packed(out),
        lse.transpose(0, 1).reshape(h, b * s).contiguous(), cu, cu, max_len, max_len, causal, rng, scale, window,
    )
    hk = k.shape[1]
    return (
        dq.view(b, s, h, d).transpose(1, 2),
        dk.view(b, s, hk, d).transpose(1, 2),
        dv.view(b, s, hk, d).transpose(1, 2),
    )
