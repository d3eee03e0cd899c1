"""Backend names, the default backend per device and dtype, which
attention-pattern features each backend's kernel can express, and which
tensors (device, dtype, head dim) its kernel takes.

``auto`` resolves to :func:`default_backend`; when that kernel cannot express a
requested feature (a sink on FlashAttention, say) or cannot take the tensors (a
head dim over 256), it resolves to a backend that can on that device instead.
An explicitly named backend that cannot is refused with one message naming the
backend and the reason (:func:`resolve_backend`, :func:`kernel_refusal`).
"""

from __future__ import annotations

import importlib

import torch

from ..runtime.suggest import unknown_name

__all__ = [
    "BACKENDS",
    "FEATURES",
    "FLASH_MAX_HEAD_DIM",
    "check_backend",
    "default_backend",
    "flash_head_dim",
    "kernel_refusal",
    "resolve_backend",
]

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


# FlashAttention (torch's flash kernels and the flash-attn package) takes 16-bit
# floats, head dims up to 256, and -- in torch's own flash API, which the ring and
# ``varlen`` call directly -- head dims that are a multiple of 8 (only SDPA's
# dispatcher pads; the flash-attn package pads for itself).
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8


def flash_head_dim(head_dim: int) -> int:
    """The head dim torch's flash kernels run ``head_dim`` at: zero-padded up to a
    multiple of 8 (exact when the softmax scale of ``head_dim`` is passed)."""
    return -(-head_dim // FLASH_HEAD_DIM_MULTIPLE) * FLASH_HEAD_DIM_MULTIPLE


def kernel_refusal(backend: str, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ``backend``'s kernel cannot take tensors of this device type, dtype and
    (largest, with MLA) head dim; None when it can. A pure function: decided on
    any machine for ``device_type="cuda"``."""
    if backend not in ("varlen", "flash_attn"):
        return None  # sdpa runs everything; flex's CPU limit is its backward (flex.py)
    if device_type != "cuda":
        return f"runs on CUDA only; got tensors on device '{device_type}'. Use backend 'sdpa' on CPU."
    if dtype not in FLASH_DTYPES:
        return (f"needs float16 or bfloat16 inputs (FlashAttention kernels); got {dtype}. "
                "Use backend 'sdpa' (or 'flex') for other dtypes.")
    if head_dim > FLASH_MAX_HEAD_DIM:
        return (f"takes head dims up to {FLASH_MAX_HEAD_DIM} (FlashAttention kernels); got {head_dim}. "
                "Use backend 'sdpa' (or 'flex').")
    return None


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


def _constant_to_compile(fn):
    """What ``torch.compiler.assume_constant_result`` does (it marks ``fn``), without
    importing ``torch._dynamo`` here: that import costs ~1.5 s of every process start,
    and most processes never compile. tests/test_attention.py pins the equivalence."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_to_compile
def _resolved_default(device: torch.device, dtype: torch.dtype) -> str:
    # Runs per attention call: the import probes (a failed import searches the
    # file system) run once per (device type, dtype). A constant to
    # torch.compile, which calls it at trace time instead of tracing it.
    key = (device.type, dtype)
    if key not in _RESOLVED:
        _RESOLVED[key] = default_backend(device, dtype)
    return _RESOLVED[key]


def resolve_backend(
    backend: str, features: frozenset, device: torch.device, dtype: torch.dtype, head_dim: int = 0
) -> str:
    """The backend that runs: ``auto`` resolved for ``features`` and the tensors;
    a named backend that cannot express one of them, or whose kernel cannot take
    the tensors, is refused (ValueError naming the backend and the reason)."""
    if backend == "auto":
        backend = _resolved_default(device, dtype)
        if not features <= SUPPORTS[backend]:
            # flex is the fused kernel that expresses every feature; it needs CUDA for a backward.
            return "flex" if device.type == "cuda" else "sdpa"
        if kernel_refusal(backend, device.type, dtype, head_dim):
            return "sdpa"
        return backend
    missing = sorted(features - SUPPORTS[backend])
    if missing:
        able = [b for b in SUPPORTS if features <= SUPPORTS[b]]
        raise ValueError(
            f"attention backend {backend!r} cannot apply {FEATURES[missing[0]]} ({missing[0]}=...): its "
            f"kernel has no such option; backends that can: {', '.join(able)}"
        )
    why = kernel_refusal(backend, device.type, dtype, head_dim)
    if why:
        raise ValueError(f"attention backend {backend!r} {why}")
    return backend
