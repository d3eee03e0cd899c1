"""RMSNorm that keeps only its input for backward.

The plain autograd version, ``(x.float() * rsqrt(mean(x.float()^2) + eps)).type_as(x) * w``,
saves the float32 upcast of ``x`` and the float32 normalised tensor: with bf16
activations that is 3-4 copies of ``x`` per norm, two norms per block, alive
while the block runs backward -- at long context the largest part of a block's
backward memory after the MLP and logits are tiled. Here backward recomputes the
normalised tensor from the saved ``x`` and a per-token float32 ``rstd``, and both
directions walk the tokens in chunks, so the float32 temporaries are bounded by
one chunk instead of the whole sequence.

Forward values are bitwise those of the plain version; gradients agree to float32
rounding (the weight gradient is accumulated in float32).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RMSNorm", "rms_norm"]

# Tokens per chunk: bounds each float32 temporary to CHUNK_TOKENS x dim x 4 bytes
# (256 MiB at dim 4096), small next to a long sequence, large enough that the
# per-chunk kernel launches do not matter.
CHUNK_TOKENS = 16384


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(i, min(i + CHUNK_TOKENS, n)) for i in range(0, n, CHUNK_TOKENS)]


def _up(x: Tensor) -> Tensor:
    # float32 for 16-bit and float32 activations; float64 stays float64.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _normalized(x: Tensor, rstd: Tensor) -> Tensor:
    return _up(x) * rstd


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        # Allocated in x's shape and filled through a 2-D view: the output must
        # not itself be a view (FSDP hooks and in-place users need a base).
        out = torch.empty(x.shape, dtype=torch.result_type(x, weight), device=x.device)
        out2 = out.view(x2.shape)
        for a, b in _chunks(x2.shape[0]):
            xf = _up(x2[a:b])
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[a:b] = r
            out2[a:b] = (xf * r).type_as(x) * weight
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, rstd = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_out.reshape(-1, x.shape[-1])
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        grad_x2 = None if grad_x is None else grad_x.view(x2.shape)
        grad_w = torch.zeros(weight.shape, dtype=rstd.dtype, device=weight.device)
        for a, b in _chunks(x2.shape[0]):
            n = _normalized(x2[a:b], rstd[a:b])
            g = g2[a:b]
            if ctx.needs_input_grad[1]:
                # y = n.type_as(x) * w: dw = sum over tokens of g * n (in x's dtype).
                grad_w += _up(g * n.type_as(x)).sum(0)
            if grad_x is not None:
                # dn = g * w (then upcast, as type_as's backward does);
                # dx = rstd * (dn - n * mean(dn * n)).
                dn = _up(g * weight)
                grad_x2[a:b] = (rstd[a:b] * (dn - n * (dn * n).mean(-1, keepdim=True))).type_as(x)
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``(x / rms(x)) * weight`` computed in float32, output in ``x``'s dtype times ``weight``'s."""
    if torch.compiler.is_compiling():
        # Inductor fuses the plain expression, and its partitioner picks what
        # backward keeps; the chunked loop would only fragment the kernels.
        xf = _up(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the activation dtype (see module doc)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
