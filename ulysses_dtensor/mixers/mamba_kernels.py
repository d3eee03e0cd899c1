"""Calls into the Mamba kernels: causal-conv1d's convolution, mamba-ssm's Mamba-2 and Mamba scans.

Their conventions, read in causal-conv1d 1.6 (``causal_conv1d_interface.py``,
``csrc/causal_conv1d.cpp``) and mamba-ssm 2.3.2 (``ops/triton/ssd_combined.py``,
``ops/selective_scan_interface.py``, ``csrc/selective_scan/selective_scan.cpp``):

* ``causal_conv1d_fn(x, weight, bias, seq_idx=..., activation=...)``: x (batch, channels,
  seq) in the channel-last memory layout (the transpose of a contiguous (batch, seq,
  channels)), which ``seq_idx`` requires, with channels divisible by 8 and widths 2-4;
  ``seq_idx`` int32 (batch, seq), equal within a document: no tap crosses a change of it;
* ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=..., seq_idx=...)``: x
  (batch, seq, heads, head_dim), dt (batch, seq, heads) taken as it is (no bias, no
  softplus: ours are applied before), A (heads,), B and C (batch, seq, groups, state)
  with heads divisible by groups, D (heads,) added as ``D * x``; the state restarts where
  ``seq_idx`` changes; the result in x's dtype;
* ``selective_scan_fn(u, delta, A, B, C, D=..., delta_bias=..., delta_softplus=True)``:
  u, delta (batch, channels, seq) of one dtype, A (channels, state) float32, B and C
  (batch, state, seq) in u's dtype, D and delta_bias (channels,) float32; it computes
  ``softplus(delta + delta_bias)`` in float32 (ours: the same), and has no documents.

Neither package installs without CUDA: their signature checks in
``tests/test_mixer_kernels.py`` skip here and run where they are installed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernel_choice import load_kernel

__all__ = ["causal_conv1d_seq_idx", "mamba_chunk_scan", "mamba_selective_scan"]


def causal_conv1d_seq_idx(x: Tensor, weight: Tensor, bias: Tensor | None, segments: Tensor | None,
                          activation: str | None) -> Tensor:
    """The depthwise causal convolution of ``x`` (batch, seq, channels) on causal-conv1d,
    restarting where ``segments`` (batch, seq: per-row document numbers; None: one
    document per row) changes; ``activation`` None, ``"silu"`` or ``"swish"``."""
    kernel = load_kernel("causal_conv1d_fn")
    seq_idx = None if segments is None else segments.to(torch.int32).contiguous()
    out = kernel(x=x.contiguous().transpose(1, 2), weight=weight.contiguous(), bias=bias, seq_idx=seq_idx,
                 activation=activation)
    return out.transpose(1, 2)


def mamba_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int, D: Tensor | None,
                     segments: Tensor | None) -> Tensor:
    """The Mamba-2 scan plus ``D * x`` on mamba-ssm's chunked kernel (shapes of
    :func:`~.dispatch.ssd_scan`); the result in x's dtype."""
    kernel = load_kernel("mamba_chunk_scan_combined")
    seq_idx = None if segments is None else segments.to(torch.int32).contiguous()
    return kernel(x=x, dt=dt, A=A.float(), B=B, C=C, chunk_size=chunk_size,
                  D=None if D is None else D.float(), seq_idx=seq_idx)


def mamba_selective_scan(x: Tensor, dt: Tensor, dt_bias: Tensor, A: Tensor, B: Tensor, C: Tensor,
                         D: Tensor | None) -> Tensor:
    """The Mamba selective scan plus ``D * x`` on mamba-ssm's kernel, one document per row
    (shapes of :func:`~.dispatch.selective_scan`); the result in x's dtype."""
    kernel = load_kernel("selective_scan_fn")
    out = kernel(u=x.transpose(1, 2), delta=dt.transpose(1, 2), A=A.float().contiguous(), B=B.transpose(1, 2),
                 C=C.transpose(1, 2), D=None if D is None else D.float().contiguous(),
                 delta_bias=dt_bias.float().contiguous(), delta_softplus=True)
    return out.transpose(1, 2)
