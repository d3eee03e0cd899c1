"""The token-mixing ops as the mixers call them: a GPU kernel where one computes the same
result, else the torch code (:mod:`.kernel_choice` decides; each decision is logged once).

* :func:`gated_delta_rule`: the gated delta rule with q/k L2 norm;
* :func:`causal_conv`: the short depthwise causal convolution;
* :func:`ssd_scan`: the Mamba-2 scan plus its ``D`` skip term;
* :func:`selective_scan`: the Mamba selective scan plus its ``D`` skip term.

Each takes ``document_ids`` (batch, seq) of the whole sequence (None: one document per
row) and restarts at every document start, as if each document ran alone, on either path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention.documents import segment_ids
from .fla_kernels import fla_causal_conv, fla_gated_delta_rule
from .gated_delta import causal_conv_documents, chunk_gated_delta_rule_documents
from .kernel_choice import (
    FUSED_ACTIVATIONS,
    KernelChoice,
    choose_conv,
    choose_gated_delta,
    choose_selective_scan,
    choose_ssd,
)
from .mamba_kernels import causal_conv1d_seq_idx, mamba_chunk_scan, mamba_selective_scan
from .ssm_scan import selective_scan_documents, ssd_documents

__all__ = ["causal_conv", "gated_delta_rule", "kernel_for", "selective_scan", "ssd_scan"]

logger = logging.getLogger("ulysses_dtensor.mixers")

_CHOOSE = {"gated_delta": choose_gated_delta, "conv": choose_conv, "ssd": choose_ssd,
           "selective": choose_selective_scan}
_DECIDED: dict[tuple, KernelChoice] = {}


def kernel_for(op: str, device_type: str, *args, compiling: bool = False) -> str:
    """The kernel that runs ``op`` (a key of the ``choose_*`` table) for these arguments,
    decided once per distinct arguments and logged then (INFO, ``ulysses_dtensor.mixers``)."""
    key = (op, device_type, compiling, *args)
    if key not in _DECIDED:
        _DECIDED[key] = choice = _CHOOSE[op](device_type, *args, compiling=compiling)
        logger.info("mixer kernel: %s", choice)
    return _DECIDED[key].kernel


# torch.compile calls it at trace time and keeps the result as a constant (what
# torch.compiler.assume_constant_result marks, without importing torch._dynamo here).
kernel_for._dynamo_marked_constant = True


def _kernel(op: str, device_type: str, *args) -> str:
    return kernel_for(op, device_type, *args, compiling=torch.compiler.is_compiling())


def _segments(document_ids: Tensor | None, batch: int, seq: int, device) -> Tensor:
    if document_ids is None:
        return torch.zeros(batch, seq, dtype=torch.long, device=device)
    return segment_ids(document_ids)


def _same_dtype(*tensors: Tensor) -> torch.dtype | None:
    """The tensors' common dtype; None (no kernel) where they differ."""
    dtypes = {t.dtype for t in tensors}
    return dtypes.pop() if len(dtypes) == 1 else None


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     document_ids: Tensor | None = None) -> Tensor:
    """``q, k``: (batch, seq, k_heads, k_dim); ``v``: (batch, seq, v_heads, v_dim), v_heads
    a multiple of k_heads; ``g`` (log decay) and ``beta`` (after its sigmoid): (batch,
    seq, v_heads). Returns (batch, seq, v_heads, v_dim) in v's dtype."""
    dtype = _same_dtype(q, k, v)
    kernel = _kernel("gated_delta", q.device.type, dtype, k.shape[-1], v.shape[-1])
    if kernel == "fla.chunk_gated_delta_rule":
        return fla_gated_delta_rule(q, k, v, g, beta, document_ids)
    return chunk_gated_delta_rule_documents(q, k, v, g, beta, _segments(document_ids, *q.shape[:2], q.device))


def causal_conv(x: Tensor, weight: Tensor, bias: Tensor | None, document_ids: Tensor | None = None,
                activation: str | Callable | None = None) -> Tensor:
    """Depthwise causal convolution of ``x`` (batch, seq, channels) with ``weight``
    (channels, width; the last tap on the current token). ``activation``: None, ``"silu"``
    / ``"swish"`` (fused into the kernels), or a callable applied to the result. Returns
    ``x``'s shape and dtype."""
    if isinstance(activation, str) and activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"causal_conv activation {activation!r} is not a name the kernels apply; pass one of "
                         f"{FUSED_ACTIVATIONS[1:]} or None, or a callable")
    fused = None if callable(activation) else activation
    after = activation if callable(activation) else None
    kernel = _kernel("conv", x.device.type, x.dtype, x.shape[-1], weight.shape[-1])
    if kernel == "causal_conv1d_fn":
        segments = None if document_ids is None else segment_ids(document_ids)
        out = causal_conv1d_seq_idx(x, weight, bias, segments, fused)
    elif kernel == "fla.causal_conv1d":
        out = fla_causal_conv(x, weight, bias, document_ids, fused)
    else:
        out = causal_conv_documents(x, weight, bias, _segments(document_ids, *x.shape[:2], x.device),
                                    None if fused is None else F.silu)
    return out if after is None else after(out)


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
             D: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
    """The Mamba-2 scan plus ``D * x``. ``x``: (batch, seq, heads, head_dim); ``dt``: (batch,
    seq, heads), already biased, softplus-ed and clamped; ``A``, ``D``: (heads,); ``B``,
    ``C``: (batch, seq, groups, state), heads divisible by groups. Returns x's shape and dtype."""
    dtype = _same_dtype(x, B, C)
    if _kernel("ssd", x.device.type, dtype) == "mamba_chunk_scan_combined":
        segments = None if document_ids is None else segment_ids(document_ids)
        return mamba_chunk_scan(x, dt, A, B, C, chunk_size, D, segments)
    per_group = x.shape[2] // B.shape[2]
    B, C = (t.repeat_interleave(per_group, dim=2) for t in (B, C))
    y = ssd_documents(x, dt, A, B, C, _segments(document_ids, *x.shape[:2], x.device), chunk_size)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def selective_scan(x: Tensor, dt: Tensor, dt_bias: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
    """The Mamba selective scan plus ``D * x``. ``x``: (batch, seq, channels); ``dt``: (batch,
    seq, channels) before its bias and softplus (``softplus(dt + dt_bias)`` is computed in
    float32); ``A``: (channels, state); ``B``, ``C``: (batch, seq, state); ``dt_bias``, ``D``:
    (channels,). Returns x's shape and dtype."""
    dtype = _same_dtype(x, dt, B, C)
    kernel = _kernel("selective", x.device.type, dtype, A.shape[-1], document_ids is not None)
    if kernel == "selective_scan_fn":
        return mamba_selective_scan(x, dt, dt_bias, A, B, C, D)
    delta = F.softplus(dt.float() + dt_bias.float())
    y = selective_scan_documents(x, delta, A, B, C, _segments(document_ids, *x.shape[:2], x.device))
    if D is not None:
        y = y + x.float() * D.float()
    return y.to(x.dtype)
