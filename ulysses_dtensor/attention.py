"""Local (single-rank) attention backends behind one call.

This is what runs inside Ulysses sequence parallelism after the all-to-all: each
rank holds the FULL sequence for a subset of heads, so any ordinary attention
kernel can be used unchanged. The layout everywhere is ``(batch, seq, heads,
head_dim)``, the layout q/k/v have as they leave their projections; backends that
want SDPA's ``(batch, heads, seq, head_dim)`` get a transposed view internally.

Packed documents are described by ``document_ids`` of shape ``(batch, seq)``
(:mod:`~ulysses_dtensor.documents`): every backend -- dense mask, flex block
mask, varlen ``cu_seqlens`` -- sees the same segmentation, one document per run
of equal ids, even if an id value repeats later in the row.

Backends:

* ``auto``       the default: picked from the tensors' device and dtype by
                 :func:`default_backend` (once per device type and dtype) (``sdpa`` on CPU; on CUDA in 16-bit
                 ``flash_attn`` if installed, else ``varlen``, else ``sdpa``).
* ``sdpa``       torch SDPA; CPU and CUDA, forward and backward. Documents use a
                 dense (B, 1, S, S) boolean mask.
* ``flex``       FlexAttention with a block mask; compiled on CUDA. On CPU torch
                 has a forward only (no backward).
* ``varlen``     ``torch.nn.attention.varlen.varlen_attn``; CUDA only.
* ``flash_attn`` the flash-attn package, imported lazily; CUDA only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .documents import (
    cached_for_documents,
    cu_seqlens,
    cu_seqlens_from_document_ids,
    document_ids_from_position_ids,
    segment_ids,
)
from .suggest import unknown_name

__all__ = [
    "BACKENDS",
    "check_backend",
    "default_backend",
    "document_ids_from_position_ids",
    "cu_seqlens_from_document_ids",
    "local_attention",
    "LocalAttention",
]

BACKENDS = ("auto", "sdpa", "flex", "varlen", "flash_attn")

_FLASH_EXTRA_MSG = (
    "attention backend 'flash_attn' needs the flash-attn package: "
    "pip install 'ulysses-dtensor[flash]'"
)


# --------------------------------------------------------------------------- #
# Backend selection
# --------------------------------------------------------------------------- #


def check_backend(name: str) -> str:
    """Return ``name`` if it is a known backend, else raise a ValueError."""
    if name in BACKENDS:
        return name
    raise ValueError(unknown_name("attention backend", name, BACKENDS))


def _import_flash_attn():
    """Import flash-attn on demand; it is optional and absent on CPU machines."""
    try:
        return importlib.import_module("flash_attn")
    except ImportError as e:
        raise ImportError(_FLASH_EXTRA_MSG) from e


_RESOLVED: dict[tuple[str, torch.dtype], str] = {}


@torch.compiler.assume_constant_result
def _resolved_default(device: torch.device, dtype: torch.dtype) -> str:
    # Runs per attention call: the import probes (a failed import searches the
    # file system) run once per (device type, dtype). A constant to
    # torch.compile, which calls it at trace time instead of tracing it.
    key = (device.type, dtype)
    if key not in _RESOLVED:
        _RESOLVED[key] = default_backend(device, dtype)
    return _RESOLVED[key]


def _has_varlen() -> bool:
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return False
    return True


def default_backend(device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend ``"auto"`` runs for tensors on ``device`` with ``dtype``.

    * CPU (and any non-CUDA device): ``sdpa``, the only one with a CPU backward.
    * CUDA, 16-bit (or ``dtype=None``): ``flash_attn`` when the package imports,
      else torch's ``varlen``, else ``sdpa``. The first two run FlashAttention
      kernels and take packed documents as ``cu_seqlens``, skipping masked
      blocks; SDPA needs a dense (B, 1, S, S) mask for documents, O(S^2) memory,
      which at long context costs more than the attention itself. Without
      documents all three run FlashAttention-2-class kernels.
    * CUDA, float32: ``sdpa`` (the FlashAttention kernels are 16-bit only).
    """
    if torch.device(device).type != "cuda":
        return "sdpa"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    try:
        _import_flash_attn()
    except ImportError:
        return "varlen" if _has_varlen() else "sdpa"
    return "flash_attn"


# --------------------------------------------------------------------------- #
# Checks
# --------------------------------------------------------------------------- #


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"local_attention expects 4-D q, k, v of shape (batch, seq, heads, head_dim); got {shapes}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q, k, v must agree in batch, seq and head_dim (dims 0, 1, 3); got {shapes}"
        )
    hq, hkv = q.shape[2], k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}); got {shapes}"
        )
    if document_ids is not None:
        if tuple(document_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(
                f"document_ids must have shape (batch, seq) = {tuple(q.shape[:2])}; "
                f"got {tuple(document_ids.shape)}"
            )
        if document_ids.is_floating_point() or document_ids.is_complex():
            raise ValueError(f"document_ids must be an integer tensor; got {document_ids.dtype}")


def _require_cuda(backend: str, q: Tensor) -> None:
    if q.device.type != "cuda":
        raise RuntimeError(
            f"attention backend {backend!r} runs on CUDA only; got tensors on device "
            f"'{q.device}'. Use backend 'sdpa' on CPU."
        )


def _require_half(backend: str, q: Tensor) -> None:
    # Both are FlashAttention kernels, which exist for 16-bit floats only.
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"attention backend {backend!r} needs float16 or bfloat16 inputs; got {q.dtype}. "
            "Use backend 'sdpa' (or 'flex') for other dtypes."
        )


def _repeat_kv(t: Tensor, n_rep: int) -> Tensor:
    # (B, S, Hkv, D) -> (B, S, Hkv * n_rep, D), kv head h serving q heads h*n_rep ... (h+1)*n_rep-1
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=2)


# --------------------------------------------------------------------------- #
# Backends
# --------------------------------------------------------------------------- #


def _sdpa(q, k, v, causal, seg, scale):
    hq, hkv = q.shape[2], k.shape[2]
    mask = None
    if seg is not None:
        # Dense (B, 1, S, S) mask: O(S^2) memory, meant for CPU and short
        # sequences (tests, debug configs). On CUDA with documents prefer
        # 'varlen', 'flash_attn' or 'flex', which skip masked blocks entirely.
        mask = seg[:, :, None] == seg[:, None, :]
        if causal:
            s = q.shape[1]
            mask &= torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        mask = mask[:, None]
    # enable_gqa avoids materialising repeated kv heads. It works (with backward)
    # on CPU; on CUDA only the flash kernel honours it (16-bit, no mask), otherwise
    # SDPA falls back to the math kernel, so repeat the heads there instead to
    # keep the memory-efficient kernel.
    gqa_native = hq != hkv and (
        q.device.type == "cpu" or (mask is None and q.dtype in (torch.float16, torch.bfloat16))
    )
    if hq != hkv and not gqa_native:
        k, v = _repeat_kv(k, hq // hkv), _repeat_kv(v, hq // hkv)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=gqa_native,
    )
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex():
    # FlexAttention only becomes a fused kernel under torch.compile; eager flex
    # materialises the full score matrix. Shapes change rarely (context-length
    # stages), so static shapes are fine and avoid dynamic-shape recompiles.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _build_block_mask(seg, causal, b, s, device):
    from torch.nn.attention.flex_attention import create_block_mask

    kwargs = {}
    if device.type == "cuda" and not torch.compiler.is_compiling():
        # Building the block mask eagerly materialises an S x S mask; compiled it
        # is computed block-wise.
        kwargs["_compile"] = True
    if seg is None:
        return create_block_mask(_causal_mod, None, None, s, s, device=device, **kwargs)

    if causal:

        def mask_mod(bi, h, q_idx, kv_idx):
            return (seg[bi, q_idx] == seg[bi, kv_idx]) & (q_idx >= kv_idx)

    else:

        def mask_mod(bi, h, q_idx, kv_idx):
            return seg[bi, q_idx] == seg[bi, kv_idx]

    return create_block_mask(mask_mod, b, None, s, s, device=device, **kwargs)


@functools.lru_cache(maxsize=16)
def _causal_block_mask(s: int, device: torch.device):
    return _build_block_mask(None, True, None, s, device)


def _flex(q, k, v, causal, seg, scale, document_ids):
    from torch.nn.attention.flex_attention import flex_attention

    on_cpu = q.device.type == "cpu"
    if on_cpu:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise RuntimeError(
                "attention backend 'flex' has no backward on CPU in this torch "
                f"({torch.__version__}): FlexAttention on CPU is forward-only. Use backend "
                "'sdpa' on CPU, or run flex under torch.no_grad()."
            )
        # torch refuses CPU flex whenever an input requires grad, even under
        # no_grad; nothing needs a graph here, so drop it.
        q, k, v = q.detach(), k.detach(), v.detach()

    b, s = q.shape[:2]
    if seg is None:
        if not causal:
            block_mask = None
        elif torch.compiler.is_compiling():
            # Let the compiler trace the mask construction rather than an lru_cache.
            block_mask = _build_block_mask(None, True, None, s, q.device)
        else:
            block_mask = _causal_block_mask(s, q.device)
    else:
        block_mask = cached_for_documents(
            "flex_block_mask",
            document_ids,
            (causal, q.device, b, s),
            lambda: _build_block_mask(seg, causal, b, s, q.device),
        )

    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    if on_cpu:
        # Compiling flex on CPU costs seconds per shape for a forward-only path;
        # the eager (unfused) implementation is exact and fine at CPU sizes.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = flex_attention(*args, **kwargs)
    else:
        out = _compiled_flex()(*args, **kwargs)
    return out.transpose(1, 2)


def _packed_lengths(seg, document_ids, b, s, device):
    """cu_seqlens and max_seqlen for flattening (B, S) into one packed sequence."""
    if seg is None:
        # One document per row: no data-dependent lengths, no host sync.
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
        return cu, s
    if torch.compiler.is_compiling():
        # Avoid a graph break on .item(): S is a valid upper bound on any
        # document length (the kernel launches some empty blocks).
        return cu_seqlens(seg), s
    return cached_for_documents(
        "cu_seqlens", document_ids, (device, b, s), lambda: cu_seqlens_from_document_ids(seg)
    )


@functools.cache
def _varlen_params() -> frozenset:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen(q, k, v, causal, seg, scale, document_ids):
    _require_cuda("varlen", q)
    _require_half("varlen", q)
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    cu, max_len = _packed_lengths(seg, document_ids, b, s, q.device)

    kwargs = {}
    # The causal flag moved: torch 2.10 takes is_causal, later versions express
    # it as a (left, right) = (-1, 0) window.
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    if hq != hkv:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, hq // hkv), _repeat_kv(v, hq // hkv)
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:
            # Same logits as a custom scale under the kernel's default 1/sqrt(d).
            q = q * (scale * math.sqrt(d))

    out = varlen_attn(
        q.reshape(b * s, hq, d),
        k.reshape(b * s, k.shape[2], d),
        v.reshape(b * s, v.shape[2], d),
        cu,
        cu,
        max_len,
        max_len,
        **kwargs,
    )
    return out.reshape(b, s, hq, d)


def _flash_attn(q, k, v, causal, seg, scale, document_ids):
    # Device first, so a CPU caller learns about the device, not a missing package.
    _require_cuda("flash_attn", q)
    _require_half("flash_attn", q)
    fa = _import_flash_attn()
    # flash-attn takes (B, S, H, D) directly and handles GQA (Hq % Hkv == 0) natively.
    if seg is None:
        return fa.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal)
    b, s, hq, d = q.shape
    cu, max_len = _packed_lengths(seg, document_ids, b, s, q.device)
    out = fa.flash_attn_varlen_func(
        q.reshape(b * s, hq, d),
        k.reshape(b * s, k.shape[2], d),
        v.reshape(b * s, v.shape[2], d),
        cu,
        cu,
        max_len,
        max_len,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
    )
    return out.reshape(b, s, hq, d)


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: str = "auto",
    causal: bool = True,
    document_ids: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention over the full local sequence.

    q: (B, S, Hq, D); k, v: (B, S, Hkv, D) with Hq % Hkv == 0 (GQA / MQA).
    document_ids: optional (B, S) integer tensor; a token attends only within its
    own document (a run of equal ids in its row), causally when ``causal``.
    scale: softmax scale, default 1/sqrt(D). Returns (B, S, Hq, D) in q's dtype.
    """
    check_backend(backend)
    _check_shapes(q, k, v, document_ids)
    if backend == "auto":
        backend = _resolved_default(q.device, q.dtype)
    seg = None
    if document_ids is not None:
        if document_ids.device != q.device:
            document_ids = document_ids.to(q.device)
        seg = segment_ids(document_ids)

    if backend == "sdpa":
        out = _sdpa(q, k, v, causal, seg, scale)
    elif backend == "flex":
        out = _flex(q, k, v, causal, seg, scale, document_ids)
    elif backend == "varlen":
        out = _varlen(q, k, v, causal, seg, scale, document_ids)
    else:
        out = _flash_attn(q, k, v, causal, seg, scale, document_ids)
    return out.to(q.dtype)


class LocalAttention(torch.nn.Module):
    """Module wrapper around :func:`local_attention` (no parameters)."""

    def __init__(self, backend: str = "auto", causal: bool = True, scale: float | None = None):
        super().__init__()
        self.backend = check_backend(backend)
        self.causal = causal
        self.scale = scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None) -> Tensor:
        return local_attention(
            q,
            k,
            v,
            backend=self.backend,
            causal=self.causal,
            document_ids=document_ids,
            scale=self.scale,
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, causal={self.causal}"
