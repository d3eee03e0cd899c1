"""Gated delta-net token mixing that restarts at document starts (pure torch).

A gated delta-net layer (Qwen3-Next, Qwen3.5) mixes tokens twice: a short
causal depthwise convolution over the q/k/v channels, then the gated delta
rule, a per-head recurrence over a ``(k_head_dim, v_head_dim)`` state::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T        o_t = S_t^T q_t

(q, k L2-normalised, q scaled by ``k_head_dim ** -0.5``). transformers' torch
versions of both run one sequence per row: given packed documents they let a
document read its predecessors' state. The versions here take ``segments``
(per-row document numbers, :func:`~ulysses_dtensor.attention.documents.segment_ids`)
and restart both at every document start, exactly as if each document ran
alone, in one vectorised pass (no host sync, no loop over documents).

The chunked form follows the usual derivation: within a chunk of ``C`` tokens
the updates are condensed by one unit-lower-triangular solve, and only the
state crosses chunk boundaries. Documents enter as masks: pairs of tokens of
different documents do not interact inside a chunk, a token reads the state
carried into its chunk only if no document starts between the chunk start and
itself, and the state carried out holds only the chunk's last document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_conv_documents", "chunk_gated_delta_rule_documents"]


def causal_conv_documents(
    x: Tensor, weight: Tensor, bias: Tensor | None, segments: Tensor, activation=None
) -> Tensor:
    """Depthwise causal convolution of ``x`` (batch, seq, channels) that sees no
    token of an earlier document.

    ``weight`` is (channels, kernel), last tap on the current token (as
    ``nn.Conv1d(groups=channels)`` with ``kernel - 1`` left padding);
    ``activation`` a callable or None. Returns ``x``'s shape and dtype.
    """
    kernel = weight.shape[-1]
    seq = x.shape[1]
    xs = x.to(weight.dtype)
    out = xs * weight[:, kernel - 1]
    for shift in range(1, min(kernel, seq)):
        # Token t - shift contributes to token t only inside the same document.
        same = (segments[:, shift:] == segments[:, :-shift]).unsqueeze(-1)
        earlier = xs[:, :-shift] * same
        out = out + F.pad(earlier, (0, 0, shift, 0)) * weight[:, kernel - 1 - shift]
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = activation(out)
    return out.to(x.dtype)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule_documents(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, segments: Tensor, chunk_size: int = 64
) -> Tensor:
    """The gated delta rule with q/k L2 norm, the state zeroed at every document start.

    ``q, k``: (batch, seq, k_heads, k_dim); ``v``: (batch, seq, v_heads, v_dim)
    with ``v_heads`` a multiple of ``k_heads`` (each q/k head serves
    consecutive v heads); ``g`` (log decay, <= 0) and ``beta``: (batch, seq,
    v_heads); ``segments``: (batch, seq) integers, equal within a document.
    Computed in fp32; returns (batch, seq, v_heads, v_dim) in ``v``'s dtype.
    """
    out_dtype = v.dtype
    batch, seq, k_heads, k_dim = k.shape
    v_heads = v.shape[2]
    if v_heads != k_heads:
        q, k = (t.repeat_interleave(v_heads // k_heads, dim=2) for t in (q, k))
    # (batch, heads, seq, dim), fp32.
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))
    q = _l2norm(q) * k_dim**-0.5
    k = _l2norm(k)

    pad = -seq % chunk_size
    if pad:
        # Padding continues the last document with tokens that change nothing
        # (beta = 0, no decay) and are cut from the output.
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
        segments = torch.cat([segments, segments[:, -1:].expand(batch, pad)], dim=1)
    chunks = (seq + pad) // chunk_size
    q, k, v = (t.reshape(*t.shape[:2], chunks, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(*t.shape[:2], chunks, chunk_size) for t in (g, beta))
    seg = segments.reshape(batch, 1, chunks, chunk_size)

    cum = g.cumsum(dim=-1)  # log decay from the chunk start, inclusive
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    linked = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal  # [i, j]: j <= i, same document
    # exp(cum_i - cum_j): decay between tokens of one document; 0 across documents.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~linked, float("-inf")).exp()

    # Which tokens continue the document whose state is carried into their chunk.
    before = torch.cat([seg.new_full((batch, 1, 1), -1), seg[..., :-1, -1]], dim=-1)
    reads_state = cum.exp() * (seg == before.unsqueeze(-1))

    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # Unit lower-triangular system: delta = solve(I + tril(beta k k^T decay, -1), rhs).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(
        system, k_beta * reads_state.unsqueeze(-1), upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_state = q * reads_state.unsqueeze(-1)
    # Into the carried state: the chunk's last document only, decayed to its end.
    in_last = seg == seg[..., -1:]
    k_out = k * (cum[..., -1:] - cum).masked_fill(~in_last, float("-inf")).exp().unsqueeze(-1)
    keep = reads_state[..., -1, None, None]  # the old state survives the chunk only without a reset

    state = q.new_zeros(batch, v_heads, k_dim, v.shape[-1])
    outs = []
    for i in range(chunks):
        delta = new_values[:, :, i] - state_keys[:, :, i] @ state
        outs.append(q_state[:, :, i] @ state + intra[:, :, i] @ delta)
        state = state * keep[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ delta
    out = torch.stack(outs, dim=2).reshape(batch, v_heads, chunks * chunk_size, -1)[:, :, :seq]
    return out.transpose(1, 2).contiguous().to(out_dtype)
