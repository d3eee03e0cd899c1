"""State-space scans that restart at document starts (pure torch): Mamba-2 and Mamba.

After the Ulysses exchange a rank holds the whole sequence of its heads (Mamba-2)
or channels (Mamba), so the scan runs here over all of it; packed documents must
not read each other's state. transformers' torch scans run one sequence per row.
These take ``segments`` (per-row document numbers,
:func:`~ulysses_dtensor.attention.documents.segment_ids`) and zero the state at every
document start, exactly as if each document ran alone (their short causal
convolution restarts with :func:`~.gated_delta.causal_conv_documents`).

Mamba-2 (SSD): per head a scalar log-decay ``a_t = dt_t * A`` and a
``(head_dim, state)`` state::

    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t

computed by chunks as transformers' own torch path does: within a chunk the
quadratic form (``C_t . B_s`` times the decay between s and t, zero across a
document start), between chunks the state, carried only by the chunk's last
document and read only by tokens that continue the document it belongs to.

Mamba (selective scan, Jamba): per channel and state a decay ``exp(dt_t A)``;
computed token by token, as transformers' own torch path does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["selective_scan_documents", "ssd_documents"]


def ssd_documents(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, segments: Tensor,
                  chunk_size: int = 64) -> Tensor:
    """The Mamba-2 scan, state zeroed at every document start (no ``D`` skip term).

    ``x``: (batch, seq, heads, head_dim); ``dt``: (batch, seq, heads), already
    biased, softplus-ed and clamped; ``A``: (heads,), negative; ``B``, ``C``:
    (batch, seq, heads, state) (groups expanded to heads); ``segments``: (batch,
    seq). Computed in fp32; returns (batch, seq, heads, head_dim) in fp32.
    """
    batch, seq, heads, _ = x.shape
    # (batch, heads, seq, ...), fp32; u = dt x enters the state.
    u = (x.float() * dt.float().unsqueeze(-1)).transpose(1, 2)
    a = (dt.float() * A.float()).transpose(1, 2)
    B, C = (t.float().transpose(1, 2) for t in (B, C))
    pad = -seq % chunk_size
    if pad:
        # Padding continues the last document with tokens that add nothing and do not decay.
        u, B, C = (F.pad(t, (0, 0, 0, pad)) for t in (u, B, C))
        a = F.pad(a, (0, pad))
        segments = torch.cat([segments, segments[:, -1:].expand(batch, pad)], dim=1)
    chunks = (seq + pad) // chunk_size
    u, B, C = (t.reshape(batch, heads, chunks, chunk_size, t.shape[-1]) for t in (u, B, C))
    a = a.reshape(batch, heads, chunks, chunk_size)
    seg = segments.reshape(batch, 1, chunks, chunk_size)

    cum = a.cumsum(dim=-1)  # log decay from the chunk start, inclusive
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    linked = (seg.unsqueeze(-1) == seg.unsqueeze(-2)) & causal  # [t, s]: s <= t, same document
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~linked, float("-inf")).exp()
    intra = ((C @ B.transpose(-1, -2)) * decay) @ u  # (batch, heads, chunks, L, head_dim)

    # Tokens that continue the document whose state enters their chunk read it, decayed.
    before = torch.cat([seg.new_full((batch, 1, 1), -1), seg[..., :-1, -1]], dim=-1)
    reads_state = cum.exp() * (seg == before.unsqueeze(-1))
    # Into the carried state: the chunk's last document only, decayed to the chunk's end.
    in_last = seg == seg[..., -1:]
    weight = (cum[..., -1:] - cum).masked_fill(~in_last, float("-inf")).exp()
    added = (u * weight.unsqueeze(-1)).transpose(-1, -2) @ B  # (batch, heads, chunks, head_dim, state)
    keep = reads_state[..., -1, None, None]  # the old state survives the chunk only without a restart

    state = u.new_zeros(batch, heads, u.shape[-1], B.shape[-1])
    outs = []
    for i in range(chunks):
        outs.append(intra[:, :, i] + (C[:, :, i] @ state.transpose(-1, -2)) * reads_state[:, :, i, :, None])
        state = state * keep[:, :, i] + added[:, :, i]
    out = torch.stack(outs, dim=2).reshape(batch, heads, chunks * chunk_size, -1)[:, :, :seq]
    return out.transpose(1, 2)


def selective_scan_documents(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, segments: Tensor) -> Tensor:
    """Mamba's selective scan, state zeroed at every document start (no ``D`` term, no gate).

    ``x``, ``dt``: (batch, seq, channels), ``dt`` already biased and softplus-ed;
    ``A``: (channels, state), negative; ``B``, ``C``: (batch, seq, state);
    ``segments``: (batch, seq). fp32; returns (batch, seq, channels) in fp32.
    """
    x, dt, A, B, C = (t.float() for t in (x, dt, A, B, C))
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    keep = (~starts).float()[..., None, None]  # (batch, seq, 1, 1): 0 where a document starts
    decay = torch.exp(dt.unsqueeze(-1) * A)  # (batch, seq, channels, state)
    enter = (dt * x).unsqueeze(-1) * B.unsqueeze(-2)  # (batch, seq, channels, state)
    state = x.new_zeros(x.shape[0], x.shape[2], A.shape[-1])
    outs = []
    for t in range(x.shape[1]):
        state = state * decay[:, t] * keep[:, t] + enter[:, t]
        outs.append((state * C[:, t, None, :]).sum(-1))
    return torch.stack(outs, dim=1)
