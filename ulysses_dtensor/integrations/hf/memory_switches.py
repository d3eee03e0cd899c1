"""ALST's memory switches for transformers decoder layers: the tiled per-token block.

``memory.tiled_mlp`` for a transformers model tiles what each decoder layer
runs on every token by itself after attention: its dense MLP, or its MoE block
(router, routed experts and shared experts together). Its ``(tokens, ffn)``
intermediates -- for an MoE block, those of every chosen expert -- then exist
one tile at a time, each tile checkpointed (forward keeps only the tile's
input, a view; backward recomputes one tile at a time).

Tiles are cut from the layer's tokens FLATTENED over the batch, so a tile's
router logits are a contiguous run of the rows the untiled block would route:
the hooks transformers records router logits with see the tiles in row order,
and the router loss (``hf_moe``) walks them with the same padding mask. An MoE
block that returns its router scores beside the hidden states (gpt-oss) gets
them back whole.

The module keeps its class and parameter names: its class is swapped for a
subclass whose ``forward`` tiles the original one (as the trainer's adapter
does for the model), so checkpoints load either way.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ulysses_dtensor.memory.tiling import _tiles, auto_num_tiles, checkpointed_pieces, tile_views
from ulysses_dtensor.models.norm import rms_norm
from ulysses_dtensor.parallel.tensor_parallel import sum_grad_over

__all__ = ["PER_TOKEN_BLOCK_NAMES", "LeanRMSNorm", "TiledPerToken", "lean_norms", "norm_formula", "per_token_block", "per_token_blocks", "per_token_width",
           "tile_per_token_blocks"]

# What decoder layers call their per-token block (dense MLP or MoE), in the
# spellings transformers' families use.
PER_TOKEN_BLOCK_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn")


def per_token_width(text_config) -> int:
    """Intermediate width per token of a layer's per-token block, for the automatic
    tile count: the MLP's width, or for an MoE block each chosen expert's."""
    from .causal_lm import causal_lm_shape

    shape = causal_lm_shape(text_config)
    return shape.ffn_dim * max(1, shape.experts_per_token)


def per_token_block(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's per-token block (its only child named in
    :data:`PER_TOKEN_BLOCK_NAMES`), or None when it has none or several."""
    found = [getattr(layer, n) for n in PER_TOKEN_BLOCK_NAMES if isinstance(getattr(layer, n, None), nn.Module)]
    return found[0] if len(found) == 1 else None


class TiledPerToken:
    """Mixed into a per-token block's class: ``forward`` over tiles of the tokens.

    ``sp_num_tiles``: 1 runs the block whole; n > 1 over n tiles; None picks
    the count from the shapes (:func:`~ulysses_dtensor.memory.tiling.auto_num_tiles`
    with ``sp_tile_width``, the block's intermediate width per token).
    """

    sp_num_tiles: int | None = 1
    sp_tile_width: int = 0

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        block = super().forward
        if args or kwargs:
            raise TypeError(
                f"memory.tiled_mlp: {self._sp_original.__name__} was called with more than the hidden "
                "states; only a block of the hidden states alone can be tiled over tokens"
            )
        b, s, d = hidden_states.shape
        tokens = b * s
        n = self.sp_num_tiles or auto_num_tiles(tokens, self.sp_tile_width or 4 * d, d)
        tiles = _tiles(tokens, n)
        if len(tiles) == 1:
            return block(hidden_states)
        flat = hidden_states.reshape(1, tokens, d)
        name = self._sp_original.__name__
        if torch.is_grad_enabled():
            views = tile_views(flat, tiles)
            parts = list(checkpointed_pieces(
                block, len(tiles), lambda i: (views[i],),
                lambda out, k: _stand_in(out, k, tiles[0][1], name)))
        else:
            parts = [block(flat.narrow(1, start, length)) for start, length in tiles]
        return _join(parts, tiles[0][1], b, s, name)


def _token_dim(t, length: int, name: str) -> int:
    """Where a tile's output of ``length`` tokens runs along the tokens: ``(1, tile, ...)``
    (hidden states) or ``(tile, ...)`` (router scores of flattened tokens)."""
    if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == length:
        return 1
    if isinstance(t, Tensor) and t.shape[:1] == (length,):
        return 0
    raise TypeError(f"memory.tiled_mlp: {name} returned {type(t).__name__} "
                    f"{tuple(getattr(t, 'shape', ()))} for a tile of {length} tokens, which is "
                    "not per token; it cannot be tiled")


def _stand_in(out, k: int, length: int, name: str):
    """For the memory planner (edge pieces): one empty output as large as ``k`` tiles' ``out``."""
    def grow(t):
        if t is None:
            return None
        dim = _token_dim(t, length, name)
        return t.new_empty((*t.shape[:dim], k * t.shape[dim], *t.shape[dim + 1:]))

    return tuple(grow(t) for t in out) if isinstance(out, tuple) else grow(out)


def _join(parts: list, length: int, b: int, s: int, name: str):
    """The tiles' outputs (all but the last ``length`` tokens long) put back together
    as the untiled block returns them: ``(1, tile, ...)`` pieces along the tokens as
    ``(b, s, ...)``, ``(tile, ...)`` pieces (router scores of flattened tokens) as
    ``(b * s, ...)``."""
    def cat(items: list):
        first = items[0]
        if first is None:
            return None
        if _token_dim(first, length, name) == 1:
            return torch.cat(items, dim=1).reshape(b, s, *first.shape[2:])
        return torch.cat(items, dim=0)

    if isinstance(parts[0], tuple):
        return tuple(cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return cat(parts)


_TILED_CLASSES: dict[type, type] = {}


def _tiled_class(cls: type) -> type:
    if issubclass(cls, TiledPerToken):
        return cls
    if cls not in _TILED_CLASSES:
        _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (TiledPerToken, cls), {"_sp_original": cls})
    return _TILED_CLASSES[cls]


def per_token_blocks(model_name: str, layers) -> list[nn.Module]:
    """Each decoder layer's per-token block; ValueError naming the model and the layer
    class for a layer whose per-token block cannot be told apart (nothing changed)."""
    blocks = []
    for layer in layers:
        block = per_token_block(layer)
        if block is None:
            names = [n for n in PER_TOKEN_BLOCK_NAMES if hasattr(layer, n)]
            raise ValueError(
                f"memory.tiled_mlp: {model_name}'s decoder layer {type(layer).__name__} has "
                f"{'no' if not names else 'more than one'} per-token block (an attribute named one of "
                f"{', '.join(PER_TOKEN_BLOCK_NAMES)}{'' if not names else ': ' + ', '.join(names)}), so "
                "tiling cannot see what to tile; set memory.tiled_mlp=false for this family"
            )
        blocks.append(block)
    return blocks


def tile_per_token_blocks(blocks: list[nn.Module], num_tiles: int | None, width: int) -> None:
    """Tile each block (``num_tiles``: a count, or None for one from the shapes), in place."""
    for block in blocks:
        block.__class__ = _tiled_class(type(block))
        block.sp_num_tiles, block.sp_tile_width = num_tiles, width


# ---------------------------------------------------------------------------
# RMSNorms that keep only their input for backward
# ---------------------------------------------------------------------------

_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


# The formulas transformers' RMSNorms use, as rms_norm's keywords: Llama's (cast, then
# times the weight), gpt-oss / OLMo2's (times the weight in float32, then cast) and
# Gemma / Qwen3-Next's (times 1 + weight in float32, then cast).
_FORMULAS = ({"offset": 0.0, "cast_first": True}, {"offset": 0.0, "cast_first": False},
             {"offset": 1.0, "cast_first": False})


class LeanRMSNorm:
    """Mixed into an RMSNorm's class whose forward was proven to be one of
    :func:`~ulysses_dtensor.models.norm.rms_norm`'s formulas (see :func:`lean_norms`)."""

    sp_norm_eps: float = 1e-6
    sp_norm_formula: dict = _FORMULAS[0]
    sp_grad_group = None  # tensor parallelism: see models.norm.RMSNorm

    def forward(self, hidden_states: Tensor) -> Tensor:
        weight = sum_grad_over(self.weight, self.sp_grad_group)
        return rms_norm(hidden_states, weight, self.sp_norm_eps, **self.sp_norm_formula)


_LEAN_CLASSES: dict[type, type] = {}
_PROVEN: dict[tuple[type, float], dict | None] = {}


def _norm_eps(module: nn.Module) -> float | None:
    """The module's epsilon when it looks like an RMSNorm: one (dim,) weight, nothing else."""
    params = dict(module.named_parameters(recurse=False))
    if list(params) != ["weight"] or params["weight"].dim() != 1 or list(module.buffers()) or list(module.children()):
        return None
    eps = [getattr(module, n) for n in _EPS_NAMES if isinstance(getattr(module, n, None), float)]
    return eps[0] if len(eps) == 1 else None


def _probe(module: nn.Module, weight: Tensor) -> nn.Module:
    """A fresh instance of the module's class with its plain attributes and a real
    ``weight`` (the module's own may be on meta or fake)."""
    probe = type(module).__new__(type(module))
    nn.Module.__init__(probe)
    probe.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
    probe.weight = nn.Parameter(weight)
    return probe


def _formula(module: nn.Module, eps: float) -> dict | None:
    """Which of :data:`_FORMULAS` the module's class computes: its own forward on random
    inputs (float32, and bfloat16 as under mixed precision), outside any fake or
    tracing mode, bitwise equal to ``rms_norm``'s; None for none. Once per class."""
    key = (type(module), eps)
    if key not in _PROVEN:
        from torch.utils._python_dispatch import _disable_current_modes

        found = None
        with _disable_current_modes(), torch.no_grad():
            g = torch.Generator().manual_seed(0)
            dim = module.weight.shape[0]
            cases = []
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(3, 5, dim, generator=g) * 3).to(dtype)
                w = (1 + torch.randn(dim, generator=g) / 4).to(dtype)
                try:
                    cases.append((x, w, type(module).forward(_probe(module, w), x)))
                except Exception:  # noqa: BLE001 - a forward that fails here is not an RMSNorm's
                    cases = []
                    break
            for formula in _FORMULAS:
                if cases and all(torch.equal(out, rms_norm(x, w, eps, **formula)) for x, w, out in cases):
                    found = formula
                    break
        _PROVEN[key] = found
    return _PROVEN[key]


def norm_formula(module: nn.Module) -> dict | None:
    """Which of ``rms_norm``'s formulas ``module`` computes, proven (None: not an RMSNorm
    this package computes)."""
    if isinstance(module, LeanRMSNorm):
        return module.sp_norm_formula
    eps = _norm_eps(module)
    return None if eps is None else _formula(module, eps)


def lean_norms(model: nn.Module) -> int:
    """Swap every RMSNorm of ``model`` whose forward is proven to be one of
    :func:`~ulysses_dtensor.models.norm.rms_norm`'s formulas for that function (same
    forward values, bitwise; gradients to float32 rounding), in place; return how many.

    Why: transformers' RMSNorms upcast the hidden states to float32 under autograd,
    which keeps float32 copies of every normed tensor (the two or four per layer and
    the q/k norms) for backward: at long context the largest part of a recomputed
    layer's backward memory once the MLP and logits are tiled. Ours keeps the input
    and one float32 scale per token. Norms of other forms (gated norms, LayerNorms)
    are left as they are.
    """
    swapped = 0
    for module in model.modules():
        if isinstance(module, LeanRMSNorm):
            continue
        formula = norm_formula(module)
        if formula is None:
            continue
        cls, eps = type(module), _norm_eps(module)
        if cls not in _LEAN_CLASSES:
            _LEAN_CLASSES[cls] = type(f"Lean{cls.__name__}", (LeanRMSNorm, cls), {})
        module.__class__ = _LEAN_CLASSES[cls]
        module.sp_norm_eps, module.sp_norm_formula = eps, formula
        swapped += 1
    return swapped
