"""The ``sdpa`` backend: torch SDPA with a dense mask, or explicit scores; and
``cudnn``: SDPA restricted to cuDNN attention.

SDPA takes a boolean mask (documents, a window) and runs fused kernels on CPU
and CUDA with a backward. Soft-capping and sinks act on the scores before the
softmax, which SDPA cannot express; then the scores are computed explicitly
(a (B, H, S, S) float32 tensor: meant for CPU and short sequences, as the
dense document mask is; on CUDA prefer ``flex``).

``cudnn`` enters ``sdpa_kernel([CUDNN_ATTENTION])`` inside the attention call,
so the forward, an activation-checkpoint recompute of it (which re-enters this
call) and the backward (cuDNN's own, recorded by the forward) all run cuDNN,
whatever SDPA's switches are around the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .pattern import Pattern, dense_mask

__all__ = ["cudnn_attention", "sdpa_attention"]

# The SDPA backends ``cudnn`` allows (tests on CPU swap in what a CPU can run).
CUDNN_SDPA = [SDPBackend.CUDNN_ATTENTION]


def _repeat_kv(t: Tensor, n_rep: int) -> Tensor:
    # (B, S, Hkv, D) -> (B, S, Hkv * n_rep, D), kv head h serving q heads h*n_rep ... (h+1)*n_rep-1
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=2)


def sdpa_attention(q, k, v, pattern: Pattern, seg, scale, sinks) -> Tensor:
    mask = dense_mask(seg, pattern, q.shape[1], q.device)
    if pattern.softcap is not None or sinks is not None:
        return _explicit(q, k, v, pattern, mask, scale, sinks)
    hq, hkv = q.shape[2], k.shape[2]
    # enable_gqa avoids materialising repeated kv heads. It works (with backward)
    # on CPU; on CUDA only the flash kernel honours it (16-bit, no mask), otherwise
    # SDPA falls back to the math kernel, so repeat the heads there instead to
    # keep the memory-efficient kernel.
    gqa_native = hq != hkv and (
        q.device.type == "cpu" or (mask is None and q.dtype in (torch.float16, torch.bfloat16))
    )
    if hq != hkv and not gqa_native:
        k, v = _repeat_kv(k, hq // hkv), _repeat_kv(v, hq // hkv)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=pattern.causal and mask is None,
        scale=scale,
        enable_gqa=gqa_native,
    )
    return out.transpose(1, 2)


def _explicit(q, k, v, pattern: Pattern, mask, scale, sinks) -> Tensor:
    """softmax(cap(q k^T * scale) + mask [, sink]) v with float32 scores."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    scores = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale
    if pattern.softcap is not None:
        scores = pattern.softcap * torch.tanh(scores / pattern.softcap)
    if mask is None and pattern.causal:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        # The sink is one more logit per (head, query) in the denominator; its
        # probability is dropped. Causal rows always keep the diagonal, so no
        # row is all -inf.
        sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, s, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs.to(v.dtype), v)


def _pad_to(t: Tensor, multiple: int) -> Tensor:
    d = t.shape[-1]
    width = -(-d // multiple) * multiple
    return t if width == d else F.pad(t, (0, width - d))


def cudnn_attention(q, k, v, pattern: Pattern, seg, scale) -> Tensor:
    """SDPA on cuDNN attention only: q/k and v zero-padded to head dims that are
    multiples of 8 (cuDNN's rule; q/k and v may differ), the scale of the real
    q/k dim, the output cropped to v's. GQA k/v as they are (cuDNN takes them);
    documents and a window as a dense mask."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = d**-0.5 if scale is None else scale
    q, k, v = _pad_to(q, 8), _pad_to(k, 8), _pad_to(v, 8)
    mask = dense_mask(seg, pattern, q.shape[1], q.device)
    with sdpa_kernel(CUDNN_SDPA):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=pattern.causal and mask is None,
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
    return out.transpose(1, 2)[..., :dv]
