"""Rotary position embeddings, computed on the fly from position ids.

There is no ``max_seq_len`` table: sequences reach millions of tokens. Angles are
formed in float64, so the angle of position 10^6 is still exact to float32, and
applied on the local slice of the sequence; with global position ids that equals
rope on the full sequence.

Two layouts of the rotated pairs within a head: ``"interleaved"`` pairs
``(2i, 2i+1)`` (Meta's original checkpoints, our flavors) and ``"half"`` pairs
``(i, i + head_dim/2)`` (the rotate-half layout Hugging Face checkpoints store).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .llama import LlamaArgs

__all__ = ["ROPE_LAYOUTS", "apply_rope", "rope_cos_sin", "rope_frequencies"]

ROPE_LAYOUTS = ("interleaved", "half")


def rope_frequencies(args: LlamaArgs, device=None) -> Tensor:
    """Inverse frequencies ``(head_dim/2,)`` in float64, Llama-3.1 scaled if enabled.

    Wavelengths shorter than ``original_max_len / high_freq_factor`` are kept,
    longer than ``original_max_len / low_freq_factor`` are divided by
    ``rope_scaling_factor``, and those in between are interpolated smoothly.
    """
    hd = args.head_dim
    inv_freq = args.rope_theta ** (
        -torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd
    )
    if not args.rope_scaling:
        return inv_freq
    factor = args.rope_scaling_factor
    low, high, orig = args.rope_low_freq_factor, args.rope_high_freq_factor, args.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    smooth = ((orig / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # smooth = 1 for short wavelens (kept), 0 for long ones (divided by factor).
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(position_ids: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, S)`` positions -> float32 ``cos, sin`` of shape ``(B, S, head_dim/2)``.

    Angles are formed in float64: at position 10^6 a float32 product would be
    off by up to 0.06 rad.
    """
    angles = position_ids.to(torch.float64)[..., None] * inv_freq.to(position_ids.device)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """Rotate pairs of dims of ``x: (B, S, H, D)`` by the angles of ``cos, sin``.

    ``"interleaved"``: pairs ``(x[2i], x[2i+1])`` (Meta's layout);
    ``"half"``: pairs ``(x[i], x[i + D/2])`` (Hugging Face's rotate-half layout).
    """
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.float()
    if layout == "half":
        x0, x1 = xf.chunk(2, dim=-1)
        return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).type_as(x)
    xf = xf.unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    return out.type_as(x)
