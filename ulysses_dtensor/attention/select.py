"""Backend names, the default backend per device and dtype, and which
attention-pattern features each backend's kernel can express.

``auto`` resolves to :func:`default_backend`; when that kernel cannot express a
requested feature (a sink on FlashAttention, say), it resolves to the first
backend that can on that device instead. An explicitly named backend that
cannot is refused with one message naming the backend, the feature and the
backends that can (:func:`resolve_backend`).
"""

from __future__ import annotations

import importlib

import torch

from ..suggest import unknown_name

__all__ = ["BACKENDS", "FEATURES", "check_backend", "default_backend", "resolve_backend"]

BACKENDS = ("auto", "sdpa", "flex", "varlen", "flash_attn")

_FLASH_EXTRA_MSG = (
    "attention backend 'flash_attn' needs the flash-attn package: "
    "pip install 'ulysses-dtensor[flash]'"
)

# Pattern features beyond causal masking, packed documents, a scale and GQA,
# with the words an error uses for them.
FEATURES = {
    "window": "a sliding window",
    "softcap": "attention-logit soft-capping",
    "sinks": "attention sinks",
}

# What each kernel can express. sdpa: masks, and an explicit-scores path for
# soft-capping and sinks; flex: mask_mod / score_mod, and sinks through its
# differentiable log-sum-exp; flash_attn: window_size and softcap arguments;
# varlen: window_size (torch versions that have it). All take a value head dim
# different from the query/key one (the packed kernels by zero padding).
SUPPORTS = {
    "sdpa": frozenset(FEATURES),
    "flex": frozenset(FEATURES),
    "varlen": frozenset({"window"}),
    "flash_attn": frozenset({"window", "softcap"}),
}


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

    A pattern feature the default cannot express moves ``auto`` on to ``flex``
    (CUDA) or ``sdpa`` (see :func:`resolve_backend`).
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


def resolve_backend(backend: str, features: frozenset, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs: ``auto`` resolved for ``features``; a named backend
    that cannot express one of them is refused (ValueError naming both)."""
    if backend == "auto":
        backend = _resolved_default(device, dtype)
        if features <= SUPPORTS[backend]:
            return backend
        # flex is the fused kernel that expresses every feature; it needs CUDA for a backward.
        return "flex" if device.type == "cuda" else "sdpa"
    missing = sorted(features - SUPPORTS[backend])
    if missing:
        able = [b for b in SUPPORTS if features <= SUPPORTS[b]]
        raise ValueError(
            f"attention backend {backend!r} cannot apply {FEATURES[missing[0]]} ({missing[0]}=...): its "
            f"kernel has no such option; backends that can: {', '.join(able)}"
        )
    return backend
