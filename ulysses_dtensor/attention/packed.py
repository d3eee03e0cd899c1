"""The FlashAttention backends on packed sequences: torch's ``varlen``, the
flash-attn package's ``flash_attn``, and ``fa4`` (torch's varlen path with its
flash kernels routed to the flash-attn-4 package). CUDA and 16-bit only
(refused otherwise by :func:`~.select.resolve_backend` before they run).

Documents become ``cu_seqlens`` over the flattened batch, so masked blocks are
skipped rather than computed. A sliding window of W keys is the kernels'
``window_size=(W - 1, 0)`` (left, right; the query itself counted in W, as in
transformers' flash path); flash-attn also takes ``softcap``. The kernels want
one head dim for q, k and v, and torch's (``varlen``) a multiple of 8: q, k
and v are zero-padded to it (a different value head dim (MLA) to the larger
one), which changes neither the scores (the scale of the real head dim is
passed) nor the kept output columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .documents import (
    cached_for_documents,
    cu_seqlens,
    cu_seqlens_from_document_ids,
)
from .capabilities import varlen_keywords
from .dense import _repeat_kv
from .pattern import Pattern
from .select import FLASH_HEAD_DIM_MULTIPLE, _constant_to_compile, _import_flash_attn

__all__ = ["fa4_backend", "flash_attn_backend", "varlen_backend"]


def _packed_lengths(seg, document_ids, b, s, device):
    """cu_seqlens and max_seqlen for flattening (B, S) into one packed sequence."""
    if seg is None:
        # One document per row: no data-dependent lengths, no host sync.
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
        return cu, s
    if torch.compiler.is_compiling():
        # Avoid a graph break on .item(): S is a valid upper bound on any
        # document length (the kernel launches some empty blocks).
        return cu_seqlens(seg), s
    return cached_for_documents(
        "cu_seqlens", document_ids, (device, b, s), lambda: cu_seqlens_from_document_ids(seg)
    )


def _window_size(pattern: Pattern) -> tuple[int, int]:
    left = -1 if pattern.window is None else pattern.window - 1
    return (left, 0) if pattern.causal else (-1, -1)


def _one_head_dim(q, k, v, scale, multiple: int):
    """Zero-pad q, k, v to one head dim, a multiple of ``multiple``; returns q, k,
    v, the scale to pass (the real q/k head dim's) and v's own dim (to crop to)."""
    d, dv = q.shape[-1], v.shape[-1]
    width = -(-max(d, dv) // multiple) * multiple
    if d == dv == width:
        return q, k, v, scale, dv
    scale = d**-0.5 if scale is None else scale  # the padded dim must not change it
    q, k, v = (t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    return q, k, v, scale, dv


@_constant_to_compile
def _varlen_accepts(name: str) -> bool:
    """Whether this torch's ``varlen_attn`` takes keyword ``name`` (its signature
    changed from 2.10 to 2.12). A constant to torch.compile, which calls it at
    trace time: traced, the cached signature lookup drew dynamo's lru_cache
    warning on torch 2.11 (H200, 2026-11-26)."""
    return name in varlen_keywords()


def varlen_backend(q, k, v, pattern: Pattern, seg, scale, document_ids, name: str = "varlen") -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    b, s, hq, _ = q.shape
    hkv = k.shape[2]
    q, k, v, scale, dv = _one_head_dim(q, k, v, scale, FLASH_HEAD_DIM_MULTIPLE)
    d = q.shape[-1]
    cu, max_len = _packed_lengths(seg, document_ids, b, s, q.device)

    kwargs = {}
    # The causal flag moved: torch 2.10 takes is_causal, later versions express
    # it (and a sliding window) as a (left, right) window.
    if _varlen_accepts("window_size"):
        kwargs["window_size"] = _window_size(pattern)
    elif pattern.window is not None:
        raise ValueError(
            f"attention backend {name!r} cannot apply a sliding window (window={pattern.window}) in this "
            f"torch ({torch.__version__}): its varlen_attn has no window_size; backends that can: sdpa, flex, "
            "flash_attn"
        )
    else:
        kwargs["is_causal"] = pattern.causal
    if hq != hkv:
        if _varlen_accepts("enable_gqa"):
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, hq // hkv), _repeat_kv(v, hq // hkv)
    if scale is not None:
        if _varlen_accepts("scale"):
            kwargs["scale"] = scale
        else:
            # Same logits as a custom scale under the kernel's default 1/sqrt(d).
            q = q * (scale * math.sqrt(d))

    out = varlen_attn(*_tokens_major(q, k, v), cu, cu, max_len, max_len, **kwargs)
    return out.reshape(b, s, hq, d)[..., :dv]


@_constant_to_compile
def _fa4_active() -> bool:
    """Route torch's flash kernels to FlashAttention-4 (process-wide, once).
    A constant to torch.compile: the switch happens at trace time, never in a graph.

    torch's FA4 route replaces the CUDA kernels of ``aten._flash_attention_forward``
    / ``_backward`` (what ``varlen`` runs) and of SDPA's flash backend for the whole
    process: after a ``fa4`` call, ``varlen``, SDPA's flash kernel and the ring's
    flash pairs run FlashAttention-4 too."""
    from torch.nn.attention import (
        activate_flash_attention_impl,
        current_flash_attention_impl,
    )

    if current_flash_attention_impl() != "FA4":
        activate_flash_attention_impl("FA4")
    return True


def fa4_backend(q, k, v, pattern: Pattern, seg, scale, document_ids) -> Tensor:
    _fa4_active()
    return varlen_backend(q, k, v, pattern, seg, scale, document_ids, name="fa4")


def _tokens_major(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(B, S, H, D) -> (B*S, H, D): the varlen kernels' layout, documents delimited by cu_seqlens."""
    return tuple(t.reshape(-1, *t.shape[2:]) for t in (q, k, v))


def flash_attn_backend(q, k, v, pattern: Pattern, seg, scale, document_ids) -> Tensor:
    fa = _import_flash_attn()
    q, k, v, scale, dv = _one_head_dim(q, k, v, scale, 1)  # flash-attn pads to its multiple itself
    # Only non-default options are passed, so older flash-attn versions work
    # whenever the pattern does not need them.
    extra = {}
    if pattern.window is not None:
        extra["window_size"] = _window_size(pattern)
    if pattern.softcap is not None:
        extra["softcap"] = pattern.softcap
    # flash-attn takes (B, S, H, D) directly and handles GQA (Hq % Hkv == 0) natively.
    if seg is None:
        out = fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=pattern.causal, **extra)
        return out[..., :dv]
    b, s, hq, d = q.shape
    cu, max_len = _packed_lengths(seg, document_ids, b, s, q.device)
    out = fa.flash_attn_varlen_func(
        *_tokens_major(q, k, v),
        cu,
        cu,
        max_len,
        max_len,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=pattern.causal,
        **extra,
    )
    return out.reshape(b, s, hq, d)[..., :dv]
