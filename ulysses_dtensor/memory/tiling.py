"""Sequence tiling for the two largest per-token intermediates.

At long context the biggest tensors of a step are not attention's (flash
kernels keep it O(seq)) but the MLP's ``(seq, ffn_dim)`` hidden states and the
head's ``(seq, vocab)`` logits (128256 wide for Llama-3). Both are per-token,
so they can be computed over tiles of the sequence. Each tile runs under
non-reentrant activation checkpointing: forward keeps only the tile's input
(a view of the full input, no copy), and backward recomputes one tile at a
time, so at most one tile's intermediate is alive. Results and gradients are
those of the untiled computation up to float reassociation.

Every loop over pieces of the sequence (these tiles and chunks, the transformers
path's, RMSNorm's chunks) runs them through :func:`checkpointed_pieces` or
:func:`edge_pieces`, so that the memory planner can trace a step with only the
edge pieces of each loop (:func:`edge_pieces_only`): a loop over equal pieces
repeats the same memory pattern piece after piece, and what it accumulates
grows by the same amount with each, so the first two and the last two pieces
show every level the others reach. A step at millions of tokens then traces in
the time of a short one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..parallel.loss import IGNORE_INDEX
from ..runtime.regions import in_region


def auto_num_tiles(seq: int, width: int, hidden: int) -> int:
    """Tiles so that one tile's ``(tile, width)`` intermediate is about ``(hidden, hidden)``.

    The same rule of thumb ALST uses for the MLP (tile length ~ model dim):
    per-tile tensors are then no larger than a weight matrix, and tiles stay
    long enough for the matmuls to run at full speed.
    """
    return max(1, math.ceil(seq * width / (hidden * hidden)))


# The automatic loss chunk holds at most this many bytes of float32 logits. The
# loss runs where no layer's temporaries are alive (between the last forward and
# the first backward), so a 1 GiB chunk adds nothing to the step's peak at long
# context (the planner shows the same peak as ~100-token chunks for Qwen3-8B), while
# chunks of about dim^2 / vocab tokens -- the MLP's rule -- would be ~100 tokens:
# thousands of kernel launches per step, and as many ops for the planner to trace.
LOSS_CHUNK_BYTES = 1 << 30


def auto_loss_chunks(tokens: int, vocab: int) -> int:
    """Chunks so that each chunk's ``(tokens / n, vocab)`` float32 logits fit :data:`LOSS_CHUNK_BYTES`."""
    return max(1, math.ceil(tokens * vocab * 4 / LOSS_CHUNK_BYTES))


def _tiles(seq: int, num_tiles: int) -> list[tuple[int, int]]:
    num_tiles = max(1, min(num_tiles, seq))
    step = math.ceil(seq / num_tiles)
    return [(start, min(step, seq - start)) for start in range(0, seq, step)]


# Edge pieces kept at each end of a loop under edge_pieces_only(): two, because the
# first piece of a loop can differ from the others (a gradient buffer is created
# rather than added to) and the last can be shorter than the others.
_EDGE = 2
_edge_only = False


@contextlib.contextmanager
def edge_pieces_only():
    """For the memory planner's traces: sequence loops run only their first and last
    two pieces (:func:`checkpointed_pieces`, :func:`edge_pieces`). The step's
    results are then wrong, and its memory is that of the whole loop."""
    global _edge_only
    before, _edge_only = _edge_only, True
    try:
        yield
    finally:
        _edge_only = before


def edge_pieces(pieces: list) -> list:
    """``pieces``, or their first and last two under :func:`edge_pieces_only`.

    For loops whose pieces only write into tensors allocated before the loop
    (RMSNorm's chunks): a skipped piece changes no tensor's size or lifetime.
    """
    if not _edge_only or len(pieces) <= 2 * _EDGE:
        return pieces
    return pieces[:_EDGE] + pieces[-_EDGE:]


def checkpointed_pieces(fn, n: int, piece, stand_in=None) -> Iterator:
    """``fn(*piece(i))`` for ``i`` in ``range(n)``, in order, each under non-reentrant
    activation checkpointing: a piece's intermediates exist only while it runs, in
    forward and when backward recomputes it. ``piece(i)`` makes the arguments of
    piece ``i`` (views of the sequence) when it runs.

    Under :func:`edge_pieces_only` the middle pieces are not run, and neither is
    their backward (it would repeat that of the pieces around them).
    ``stand_in(out, k)`` then makes, and this yields in their place, one tensor
    (or tuple) without grad as large as their ``k`` outputs joined, shaped after
    ``out`` (the second piece's): the outputs accumulate as they would. Without
    ``stand_in`` (pieces that return scalars to add up) nothing is yielded for
    them. Pieces must be equal but for the last.
    """
    if not _edge_only or n <= 2 * _EDGE:
        for i in range(n):
            yield checkpoint(fn, *piece(i), use_reentrant=False)
        return
    for i in range(_EDGE):
        out = checkpoint(fn, *piece(i), use_reentrant=False)
        yield out
    if stand_in is not None:
        yield stand_in(out, n - 2 * _EDGE)
    for i in range(n - _EDGE, n):
        yield checkpoint(fn, *piece(i), use_reentrant=False)


def tile_views(x: Tensor, tiles: list[tuple[int, int]]) -> tuple[Tensor, ...]:
    """The tiles of ``x`` along dim 1, as views made by one split. Its backward joins the
    tiles' gradients once, where a view per tile (``narrow``) would give each tile's
    gradient as a whole-size tensor, added up one by one: two whole-size gradients
    alive at every tile's backward, and a whole-size zero fill per tile."""
    sizes = [n for _, n in tiles]
    if not _edge_only or len(tiles) <= 2 * _EDGE:
        return x.split(sizes, dim=1)
    # Under edge_pieces_only the middle pieces never run: one view stands for them all, so that
    # the split's backward fills one gradient as large as theirs, in one op whatever their count.
    parts = x.split(sizes[:_EDGE] + [sum(sizes[_EDGE:-_EDGE])] + sizes[-_EDGE:], dim=1)
    return (*parts[:_EDGE], *([None] * (len(tiles) - 2 * _EDGE)), *parts[-_EDGE:])


def tiled_forward(fn, x: Tensor, num_tiles: int) -> Tensor:
    """``fn(x)`` for a per-token ``fn``, over ``num_tiles`` tiles of dim 1.

    With grad, each tile is checkpointed: only one tile's intermediates are
    ever alive, in forward and in backward.
    """
    tiles = _tiles(x.shape[1], num_tiles)
    if len(tiles) == 1:
        return fn(x)
    if torch.is_grad_enabled():
        views = tile_views(x, tiles)
        outs = list(checkpointed_pieces(
            fn, len(tiles), lambda i: (views[i],),
            lambda out, k: out.new_empty((out.shape[0], k * out.shape[1], *out.shape[2:]))))
    else:
        outs = [fn(x.narrow(1, s, n)) for s, n in tiles]
    return torch.cat(outs, dim=1)


class TiledMLP(nn.Module):
    """Run any per-token ``mlp`` over tiles of the sequence dim of ``(batch, seq, dim)``.

    For users' own models; the Llama here tiles inside its ``FeedForward``
    (so parameter names do not change). ``num_tiles=None`` picks
    :func:`auto_num_tiles` from the shapes.
    """

    def __init__(self, mlp: nn.Module, ffn_dim: int, num_tiles: int | None = None):
        super().__init__()
        self.mlp = mlp
        self.ffn_dim = ffn_dim
        self.num_tiles = num_tiles

    def forward(self, x: Tensor) -> Tensor:
        n = self.num_tiles or auto_num_tiles(x.shape[1], self.ffn_dim, x.shape[-1])
        return tiled_forward(self._mlp, x, n)

    @in_region("mlp")  # inside each tile's checkpoint: its recompute is marked too
    def _mlp(self, x: Tensor) -> Tensor:
        return self.mlp(x)


@in_region("loss")  # inside each chunk's checkpoint: its recompute is marked too
def _chunk_loss_sum(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


def tiled_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    num_chunks: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Sum of cross entropy of ``hidden @ weight.T`` against ``labels``, by sequence chunks.

    Never materialises the ``(batch, seq, vocab)`` logits: each chunk's logits
    (and their gradient) exist only while that chunk is computed. Pair with
    :func:`ulysses_dtensor.parallel.loss.sp_cross_entropy`'s normalisation by dividing
    by the global valid-token count (see :func:`tiled_sp_cross_entropy`).
    """
    seq = hidden.shape[1]
    n = num_chunks or auto_loss_chunks(hidden.shape[0] * seq, weight.shape[0])
    total = hidden.new_zeros((), dtype=torch.float32)
    tiles = _tiles(seq, n)

    def piece(i):
        return hidden.narrow(1, *tiles[i]), weight, labels.narrow(1, *tiles[i]), ignore_index

    parts = (checkpointed_pieces(_chunk_loss_sum, len(tiles), piece) if torch.is_grad_enabled()
             else (_chunk_loss_sum(*piece(i)) for i in range(len(tiles))))
    for part in parts:
        total = total + part
    return total


def tiled_sp_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    num_valid_tokens: Tensor | int,
    *,
    num_chunks: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """This rank's share of the global token-mean loss, computed chunk by chunk."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree: "
            "hidden must be labels.shape + (dim,)"
        )
    local_sum = tiled_cross_entropy_sum(
        hidden, weight, labels, num_chunks=num_chunks, ignore_index=ignore_index
    )
    denom = torch.as_tensor(num_valid_tokens, device=local_sum.device).clamp(min=1)
    return local_sum / denom
