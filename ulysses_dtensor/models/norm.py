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

from ..memory.tiling import edge_pieces
from ..parallel.tensor_parallel import sum_grad_over
from ..runtime.regions import in_region

__all__ = ["RMSNorm", "rms_norm"]

# Elements per chunk: bounds each float32 temporary to 256 MiB (16K tokens at dim
# 4096), small next to a long sequence, large enough that the per-chunk kernel
# launches do not matter -- also for q/k norms over one head's dim, whose rows are
# heads x tokens (a chunk of rows, not of tokens, would launch 32x more kernels).
CHUNK_ELEMENTS = 1 << 26


def _chunks(n: int, dim: int) -> list[tuple[int, int]]:
    rows = max(1, CHUNK_ELEMENTS // dim)
    return [(i, min(i + rows, n)) for i in range(0, n, rows)]


def _up(x: Tensor) -> Tensor:
    # float32 for 16-bit and float32 activations; float64 stays float64.
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _normalized(x: Tensor, rstd: Tensor) -> Tensor:
    return _up(x) * rstd


def _scale(weight: Tensor, offset: float) -> Tensor:
    return _up(weight) + offset if offset else _up(weight)


def _apply_weight(n: Tensor, x: Tensor, weight: Tensor, offset: float, cast_first: bool) -> Tensor:
    """The normalised float32 ``n`` to the output: cast to ``x``'s dtype then times the
    weight (Llama), or times ``offset + weight`` in float32 then cast (gpt-oss, OLMo2; Gemma
    with ``offset=1``)."""
    if cast_first:
        return n.type_as(x) * weight
    return (n * _scale(weight, offset)).to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float, cast_first: bool) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        # Allocated in x's shape and filled through a 2-D view: the output must
        # not itself be a view (FSDP hooks and in-place users need a base).
        dtype = torch.result_type(x, weight) if cast_first else x.dtype
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        out2 = out.view(x2.shape)
        # Chunks only write into tensors made before the loop: the memory planner
        # traces the edge ones alone (edge_pieces).
        for a, b in edge_pieces(_chunks(*x2.shape)):
            xf = _up(x2[a:b])
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            rstd[a:b] = r
            out2[a:b] = _apply_weight(xf * r, x, weight, offset, cast_first)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.cast_first = offset, cast_first
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, rstd = ctx.saved_tensors
        offset, cast_first = ctx.offset, ctx.cast_first
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_out.reshape(-1, x.shape[-1])
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        grad_x2 = None if grad_x is None else grad_x.view(x2.shape)
        grad_w = torch.zeros(weight.shape, dtype=rstd.dtype, device=weight.device)
        scale = None if cast_first else _scale(weight, offset)
        for a, b in edge_pieces(_chunks(*x2.shape)):
            n = _normalized(x2[a:b], rstd[a:b])
            g = g2[a:b]
            if cast_first:
                # y = n.type_as(x) * w: dw = sum over tokens of g * n (in x's dtype);
                # dn = g * w (then upcast, as type_as's backward does).
                if ctx.needs_input_grad[1]:
                    grad_w += _up(g * n.type_as(x)).sum(0)
                dn = _up(g * weight) if grad_x is not None else None
            else:
                # y = (n * (offset + w)).to(dtype), all in float32.
                gf = _up(g)
                if ctx.needs_input_grad[1]:
                    grad_w += (gf * n).sum(0)
                dn = gf * scale if grad_x is not None else None
            if grad_x is not None:
                # dx = rstd * (dn - n * mean(dn * n)).
                grad_x2[a:b] = (rstd[a:b] * (dn - n * (dn * n).mean(-1, keepdim=True))).type_as(x)
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, offset: float = 0.0, cast_first: bool = True) -> Tensor:
    """``(x / rms(x)) * weight`` computed in float32: by default the normalised tensor
    is cast to ``x``'s dtype and times ``weight`` (Llama); ``cast_first=False``
    multiplies by ``offset + weight`` in float32 and casts after (gpt-oss, OLMo2;
    Gemma with ``offset=1``)."""
    if torch.compiler.is_compiling():
        # Inductor fuses the plain expression, and its partitioner picks what
        # backward keeps; the chunked loop would only fragment the kernels.
        xf = _up(x)
        return _apply_weight(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), x, weight, offset, cast_first)
    return _RMSNormFunction.apply(x, weight, eps, offset, cast_first)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the activation dtype (see module doc).

    ``sp_grad_group`` (set by tensor parallelism for a norm over one head's dim,
    which sees only its rank's heads): the process group the weight's gradient is
    summed over.
    """

    sp_grad_group = None

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    @in_region("norm")
    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, sum_grad_over(self.weight, self.sp_grad_group), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
