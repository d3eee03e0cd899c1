"""The ``flex`` backend: FlexAttention with a block mask and a score_mod.

The block mask carries causality, the window and the documents; soft-capping
is a ``score_mod``; sinks rescale the output by ``sigmoid(lse - sink)`` with
the log-sum-exp FlexAttention returns, which is differentiable, so the
gradients of q, k and the sink logits are exact. Compiled on CUDA; on CPU
torch has a forward only.

Compiled flex that runs out of recompiles would silently run eagerly, i.e.
unfused, materialising S x S scores: it is compiled with ``fullgraph=True``
(hitting the limit is then an error, raised here with the knob to turn) and a
recompile limit of its own, :data:`FLEX_RECOMPILE_LIMIT`, since every context
length, pattern and grad mode is a graph of its own.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
from torch import Tensor

from .documents import cached_for_documents
from .pattern import Pattern

__all__ = ["flex_attention_backend"]


# Distinct graphs a run may need: context-length stages x mask patterns (a
# model alternating sliding and full layers has two) x score_mods x grad mode
# (training, evaluation). torch's default of 8 is soon spent.
FLEX_RECOMPILE_LIMIT = 64


def _compile(fn, **kwargs):
    """torch.compile with :data:`FLEX_RECOMPILE_LIMIT` for ``fn``."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        kwargs["recompile_limit"] = FLEX_RECOMPILE_LIMIT
    else:  # no per-function limit in this torch: raise the process-wide one (never lower it)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    return torch.compile(fn, **kwargs)


def _compile_flex(backend: str = "inductor"):
    # FlexAttention only becomes a fused kernel under torch.compile; eager flex
    # materialises the full score matrix. Shapes change rarely (context-length
    # stages), so static shapes are fine and avoid dynamic-shape recompiles.
    from torch.nn.attention.flex_attention import flex_attention

    return _compile(flex_attention, backend=backend, dynamic=False, fullgraph=True)


@functools.cache
def _compiled_flex():
    return _compile_flex()


@functools.cache
def _limit_hit_error() -> type:
    """What hitting the limit under fullgraph=True raises (its older name as a fallback).
    Looked up on a failure only: importing torch._dynamo costs every process ~1.5 s."""
    from torch._dynamo import exc

    return getattr(exc, "FailOnRecompileLimitHit", None) or getattr(exc, "FailOnCacheLimitHit", RuntimeError)


def _run_compiled(flex, *args, **kwargs):
    if torch.compiler.is_compiling():  # traced into the caller's graph, under its limits
        return flex(*args, **kwargs)
    try:
        return flex(*args, **kwargs)
    except Exception as e:
        if not isinstance(e, _limit_hit_error()):
            raise
        raise RuntimeError(
            "compiled FlexAttention hit torch.compile's recompile limit (one graph per context length, "
            "mask pattern, score_mod and grad mode): running on would fall back to unfused attention "
            "that materialises S x S scores. Raise ulysses_dtensor.attention.flex.FLEX_RECOMPILE_LIMIT "
            "before the first call, or use fewer distinct shapes; TORCH_LOGS=recompiles names the reasons"
        ) from e


def _mask_mod(seg, causal: bool, window: int | None):
    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx if causal else None
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        if seg is not None:
            same = seg[b, q_idx] == seg[b, kv_idx]
            keep = same if keep is None else keep & same
        return keep

    return mask_mod


@functools.lru_cache(maxsize=8)
def _softcap_mod(softcap: float):
    # One function object per value: a compiled flex call guards on it.
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


@functools.cache
def _compiled_create_block_mask():
    # One compiled builder for the process (create_block_mask(_compile=True) is
    # deprecated and wraps a new torch.compile per call). Eagerly, building a
    # block mask materialises an S x S mask; compiled it is computed block-wise.
    from torch.nn.attention.flex_attention import create_block_mask

    return _compile(create_block_mask)


def _build_block_mask(seg, pattern: Pattern, b, s, device):
    from torch.nn.attention.flex_attention import create_block_mask

    build = create_block_mask
    if device.type == "cuda" and not torch.compiler.is_compiling():
        build = _compiled_create_block_mask()
    mod = _mask_mod(seg, pattern.causal, pattern.window)
    return build(mod, None if seg is None else b, None, s, s, device=device)


@functools.lru_cache(maxsize=16)
def _cached_block_mask(pattern: Pattern, s: int, device: torch.device):
    return _build_block_mask(None, pattern, None, s, device)


def _block_mask(q, pattern: Pattern, seg, document_ids):
    b, s = q.shape[:2]
    # Only the mask-shaping fields key the cache.
    shape = Pattern(causal=pattern.causal, window=pattern.window)
    if seg is None:
        if not pattern.causal:
            return None
        if torch.compiler.is_compiling():
            # Let the compiler trace the mask construction rather than an lru_cache.
            return _build_block_mask(None, shape, None, s, q.device)
        return _cached_block_mask(shape, s, q.device)
    return cached_for_documents(
        "flex_block_mask",
        document_ids,
        (shape, q.device, b, s),
        lambda: _build_block_mask(seg, shape, b, s, q.device),
    )


def flex_attention_backend(q, k, v, pattern: Pattern, seg, scale, document_ids, sinks: Tensor | None) -> Tensor:
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    on_cpu = q.device.type == "cpu"
    if on_cpu:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
            raise RuntimeError(
                "attention backend 'flex' has no backward on CPU in this torch "
                f"({torch.__version__}): FlexAttention on CPU is forward-only. Use backend "
                "'sdpa' on CPU, or run flex under torch.no_grad()."
            )
        # torch refuses CPU flex whenever an input requires grad, even under
        # no_grad; nothing needs a graph here, so drop it.
        q, k, v = q.detach(), k.detach(), v.detach()
        sinks = None if sinks is None else sinks.detach()

    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    kwargs = dict(
        block_mask=_block_mask(q, pattern, seg, document_ids),
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
        score_mod=None if pattern.softcap is None else _softcap_mod(pattern.softcap),
    )
    if sinks is not None:
        kwargs["return_aux"] = AuxRequest(lse=True)
    if on_cpu:
        # Compiling flex on CPU costs seconds per shape for a forward-only path;
        # the eager (unfused) implementation is exact and fine at CPU sizes.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = flex_attention(*args, **kwargs)
    else:
        out = _run_compiled(_compiled_flex(), *args, **kwargs)
    if sinks is not None:
        out, aux = out
        # (B, H, S) lse; the sink joins each query's denominator.
        keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
        out = (out.float() * keep.unsqueeze(-1)).to(q.dtype)
    return out.transpose(1, 2)
