"""Attention kernels for one (query part, key part) pair of a ring step, with their LSE.

Ring attention merges partial results by their log-sum-exp, so every call here
returns ``(out, lse, state)`` and has a backward that takes the FINAL (merged)
``out`` and ``lse`` of its query rows, which gives the exact gradient of the
pair. Layout: q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)`` with ``H % Hkv == 0``
(GQA without repeating kv heads where the kernel allows it); lse ``(B, H, Sq)``.

Which kernel runs a pair is :func:`kernel_for`'s decision, from the device type,
dtype, head dim and the machine's :class:`~ulysses_dtensor.attention.capabilities.Capabilities`
(so it is tested for CUDA on any machine, the capabilities mocked):

* CPU: SDPA's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward), which takes GQA k/v and a dense additive mask.
* CUDA, 16-bit, no mask, where the kernel table gives plain causal attention to
  ``cudnn`` (Hopper / sm100, cuDNN above 9.15.0; :mod:`~ulysses_dtensor.attention.kernel_table`):
  cuDNN attention (``aten._scaled_dot_product_cudnn_attention`` with its
  log-sum-exp, and its backward), GQA k/v as they are.
* CUDA, 16-bit, no mask, elsewhere: SDPA's flash kernel (``aten._scaled_dot_product_flash_attention``).
* CUDA, 16-bit, documents on the diagonal pair: FlashAttention varlen with the
  LSE (``torch.ops.torch_attn._varlen_attn``, what ``torch.nn.attention.varlen``
  runs), one sequence per document run of the chunk: no mask.
* CUDA otherwise (float32, or a head dim over 256): SDPA's memory-efficient
  kernel, documents as an additive bias.

torch's flash kernels and cuDNN take head dims that are a multiple of 8 (only
SDPA's dispatcher pads): q, k, v (and dout, out in backward) are zero-padded up
to one, with the softmax scale of the real head dim, and the results cropped --
exact, the padded columns add nothing to the scores and stay zero.

LSE layouts: flash returns (B, H, Sq); cuDNN (B, H, Sq, 1) in the torch versions
read (2.11, 2.13; torch's meta kernel says so), so its forward drops the last
dim and its backward restores the shape its forward returned.

No GPU was lent while this was written: the CUDA calls are checked on meta
tensors only (tests/test_cuda_calls_on_cpu.py), against the kernels'
preconditions and the schemas of torch 2.11 and of the installed torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.capabilities import Capabilities
from ..attention.kernel_table import Case, auto_choice
from ..attention.select import FLASH_DTYPES, FLASH_MAX_HEAD_DIM, flash_head_dim

__all__ = ["PairKernel", "kernel_for", "pair_backward", "pair_forward"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class PairKernel:
    """The kernel that runs a pair, and the head dim it runs at (q, k, v zero-padded up to it)."""

    name: str  # "cpu_flash", "cudnn", "flash", "varlen" or "efficient"
    head_dim: int


def kernel_for(
    device_type: str, dtype: torch.dtype, head_dim: int, documents: bool, caps: Capabilities | None = None
) -> PairKernel:
    """The kernel for a pair of tensors of this device type, dtype and head dim.

    ``documents``: the pair is a chunk against itself with packed documents (its
    document runs need a mask or varlen); every other pair is plain attention,
    which runs what the kernel table gives plain causal attention on ``caps``
    (None: a GPU of unknown capability) when that is cuDNN.
    """
    if device_type != "cuda":
        return PairKernel("cpu_flash", head_dim)
    padded = flash_head_dim(head_dim)
    if not documents and caps is not None and auto_choice(Case(dtype, head_dim), caps).backend == "cudnn":
        return PairKernel("cudnn", padded)
    if dtype in FLASH_DTYPES and padded <= FLASH_MAX_HEAD_DIM:
        return PairKernel("varlen" if documents else "flash", padded)
    if dtype in (torch.float32, *FLASH_DTYPES):
        return PairKernel("efficient", head_dim)
    raise ValueError(f"ring attention on CUDA runs float16, bfloat16 or float32 tensors; got {dtype}")


def pair_forward(kernel: PairKernel, q, k, v, causal: bool, scale, mask: Tensor | None = None, runs=None,
                 window: int | None = None):
    """-> out (B, H, Sq, D), lse (B, H, Sq) float32 (or float64), state for the backward.

    ``mask``: dense additive (B, 1, Sq, Sk) mask (``cpu_flash``, ``efficient``);
    ``runs``: the diagonal pair's document runs, ``(cu_seqlens, max_len)`` (``varlen``);
    ``window``: a sliding window of that many keys (``varlen`` only; the others take it in ``mask``).
    """
    if kernel.name == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse, None
    if kernel.name == "efficient":
        return _efficient_forward(q, k, v, causal, scale, mask)
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale  # of the real head dim, not the padded one
    q, k, v = (_pad(t, kernel.head_dim) for t in (q, k, v))
    if kernel.name == "varlen":
        out, lse, state = _varlen_forward(q, k, v, causal, scale, runs, window)
    elif kernel.name == "cudnn":
        out, lse, state = _cudnn_forward(q, k, v, causal, scale)
    else:
        out, lse, state = _cuda_forward(q, k, v, causal, scale)
    return out[..., :d], lse, state


def pair_backward(kernel: PairKernel, dout, q, k, v, out, lse, causal: bool, scale, state, mask=None):
    """-> dq (like q), dk, dv (like k, v), for the pair's rows and keys."""
    if kernel.name == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )
    # torch's CUDA kernels want dout's last dim contiguous; a .sum()'s gradient has stride 0.
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    if kernel.name == "efficient":
        return _efficient_backward(dout, q, k, v, out, lse, causal, scale, state, mask)
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    dout, q, k, v, out = (_pad(t, kernel.head_dim) for t in (dout, q, k, v, out))
    backward = {"varlen": _varlen_backward, "cudnn": _cudnn_backward}.get(kernel.name, _cuda_backward)
    return tuple(g[..., :d] for g in backward(dout, q, k, v, out, lse, causal, scale, state))


def _pad(t: Tensor, head_dim: int) -> Tensor:
    return t if t.shape[-1] == head_dim else F.pad(t, (0, head_dim - t.shape[-1]))


# ---------------------------------------------------------------------------
# CUDA: SDPA's flash and memory-efficient kernels
# ---------------------------------------------------------------------------


def _cuda_forward(q, k, v, causal, scale):
    """SDPA's flash kernel: 16-bit, head dim a multiple of 8 up to 256, GQA k/v."""
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, ("flash", cum_q, cum_k, seed, offset)


def _cuda_backward(dout, q, k, v, out, lse, causal, scale, state):
    _, cum_q, cum_k, seed, offset = state
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale,
    )


def _cudnn_forward(q, k, v, causal, scale):
    """cuDNN attention with its log-sum-exp: 16-bit, head dim a multiple of 8 (up to
    128 here: the kernel table's rule), GQA k/v."""
    out, lse, _, _, _, _, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    # (B, H, Sq, 1) -> (B, H, Sq) for the merge; the backward gets the shape back.
    return out, lse.reshape(q.shape[:3]), ("cudnn", seed, offset, tuple(lse.shape[3:]))


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale, state):
    _, seed, offset, lse_tail = state
    # cuDNN's backward reads dout with out's strides (and copies one with a zero
    # stride): both in the contiguous (B, H, Sq, D) layout.
    dout, out = dout.contiguous(), out.contiguous()
    lse = lse.contiguous().view(*lse.shape, *lse_tail)
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )


def _efficient_forward(q, k, v, causal, scale, mask):
    """Memory-efficient kernel (any of fp16/bf16/fp32, any head dim; no GQA: heads repeated)."""
    kr, vr = _repeat_heads(k, v, q.shape[1])
    bias = None if mask is None else _aligned_bias(mask, q.shape[1])
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
        q, kr, vr, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]], ("efficient", seed, offset)


def _efficient_backward(dout, q, k, v, out, lse, causal, scale, state, mask):
    _, seed, offset = state
    kr, vr = _repeat_heads(k, v, q.shape[1])
    bias = None if mask is None else _aligned_bias(mask, q.shape[1])
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel pads LSE rows to 32
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, kr, vr, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, *_sum_repeated(dk, dv, k.shape[1])


# The memory-efficient kernel reads its bias at 16-element-aligned row strides
# (SDPA's dispatcher pads the mask so; called directly, we do).
_BIAS_ALIGNMENT = 16


def _aligned_bias(mask: Tensor, heads: int) -> Tensor:
    """(B, 1, Sq, Sk) additive mask -> the (B, H, Sq, Sk) bias view the kernel takes:
    rows in a buffer padded to a multiple of 16 columns, heads broadcast (stride 0)."""
    b, _, sq, sk = mask.shape
    buf = mask.new_zeros(b, 1, sq, -(-sk // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT)
    buf[..., :sk] = mask
    return buf[..., :sk].expand(b, heads, sq, sk)


def _repeat_heads(k, v, heads: int):
    rep = heads // k.shape[1]
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))


def _sum_repeated(dk, dv, kv_heads: int):
    b, h, s, d = dk.shape
    if h == kv_heads:
        return dk, dv
    return tuple(t.view(b, kv_heads, h // kv_heads, s, d).sum(2) for t in (dk, dv))


# ---------------------------------------------------------------------------
# CUDA: FlashAttention varlen (torch.nn.attention.varlen's ops)
# ---------------------------------------------------------------------------


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


# The ops' schemas grow between torch versions (2.13 added enable_gqa, seqused_k,
# block_table, num_splits after window_size; 2.11 stops at window_size), so the
# calls pass the leading tensors and sizes by position and the rest by the names
# every version has. No window (is_causal makes the kernel causal); no GQA flag
# (the flash path takes GQA k/v as they are; only the public wrapper checks).


def _window_kwargs(window: int | None) -> dict:
    # The kernels' (left, right) window: W keys, the query itself included (attention/packed.py).
    return {} if window is None else {"window_size": [window - 1, 0]}


def _varlen_forward(q, k, v, causal, scale, runs, window=None):
    cu, max_len = runs
    b, h, s, d = q.shape
    out, lse, rng = _varlen_ops()._varlen_attn(
        _packed(q), _packed(k), _packed(v), cu, cu, max_len, max_len, is_causal=causal, scale=scale,
        **_window_kwargs(window),
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
        lse.transpose(0, 1).reshape(h, b * s).contiguous(), cu, cu, max_len, max_len, causal, rng, scale=scale,
        **_window_kwargs(window),
    )
    hk = k.shape[1]
    return (
        dq.view(b, s, h, d).transpose(1, 2),
        dk.view(b, s, hk, d).transpose(1, 2),
        dv.view(b, s, hk, d).transpose(1, 2),
    )
