"""Backend names, which attention-pattern features each backend's kernel can
express, which tensors (device, dtype, head dims) it takes, and what ``auto``
resolves to.

``auto`` resolves per call to :func:`.kernel_table.auto_choice` for the call's
case (documents, window, soft-cap, sinks, head dims, dtype) on this device's
:class:`~.capabilities.Capabilities` -- cached, and a constant to
torch.compile. An explicitly named backend that cannot express a feature, take
the tensors, or run on this machine is refused with one message naming the
backend and the reason (:func:`resolve_backend`, :func:`backend_refusal`).
"""

from __future__ import annotations

import importlib

import torch

from ..runtime.suggest import unknown_name
from .capabilities import Capabilities, has_varlen
from .kernel_table import (
    Case,
    auto_choice,
    cudnn_refusal,
    cudnn_tensor_refusal,
    fa4_refusal,
)

__all__ = [
    "BACKENDS",
    "FEATURES",
    "FLASH_MAX_HEAD_DIM",
    "backend_refusal",
    "check_backend",
    "default_backend",
    "flash_head_dim",
    "kernel_refusal",
    "resolve_backend",
]

BACKENDS = ("auto", "sdpa", "flex", "varlen", "flash_attn", "cudnn", "fa4")

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
# varlen and fa4 (torch's varlen path on FlashAttention-4): window_size (torch
# versions that have it); cudnn: masks (a dense one for documents and windows).
# All take a value head dim different from the query/key one (the packed
# kernels by zero padding).
SUPPORTS = {
    "sdpa": frozenset(FEATURES),
    "flex": frozenset(FEATURES),
    "varlen": frozenset({"window"}),
    "flash_attn": frozenset({"window", "softcap"}),
    "cudnn": frozenset({"window"}),
    "fa4": frozenset({"window"}),
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


def kernel_refusal(
    backend: str, device_type: str, dtype: torch.dtype, head_dim: int, v_head_dim: int | None = None
) -> str | None:
    """Why ``backend``'s kernel cannot take tensors of this device type, dtype and
    head dims (``v_head_dim`` None: ``head_dim``, or the larger of the two when a
    caller has only that); None when it can. A pure function: decided on any
    machine for ``device_type="cuda"``. What depends on the machine (cuDNN's
    version, an installed package) is :func:`backend_refusal`'s."""
    if backend not in ("varlen", "flash_attn", "cudnn", "fa4"):
        return None  # sdpa runs everything; flex's CPU limit is its backward (flex.py)
    if device_type != "cuda":
        return f"runs on CUDA only; got tensors on device '{device_type}'. Use backend 'sdpa' on CPU."
    if dtype not in FLASH_DTYPES:
        kind = "cuDNN attention" if backend == "cudnn" else "FlashAttention kernels"
        return (f"needs float16 or bfloat16 inputs ({kind}); got {dtype}. "
                "Use backend 'sdpa' (or 'flex') for other dtypes.")
    if backend == "cudnn":
        why = cudnn_tensor_refusal(Case(dtype, head_dim, v_head_dim), Capabilities(device_type="cuda"))
        return None if why is None else f"{why}. Use backend 'sdpa' (or 'varlen')."
    if max(head_dim, v_head_dim or 0) > FLASH_MAX_HEAD_DIM:
        return (f"takes head dims up to {FLASH_MAX_HEAD_DIM} (FlashAttention kernels); "
                f"got {max(head_dim, v_head_dim or 0)}. Use backend 'sdpa' (or 'flex').")
    return None


def backend_refusal(
    backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int | None = None
) -> str | None:
    """:func:`kernel_refusal`, then what this machine lacks for ``cudnn`` and ``fa4``
    (cuDNN's version and switches, the flash-attn-4 package); None when it can run."""
    device = torch.device(device)
    why = kernel_refusal(backend, device.type, dtype, head_dim, v_head_dim)
    if why or backend not in ("cudnn", "fa4"):
        return why
    return _machine_refusal(backend, torch.device(device), dtype, head_dim, v_head_dim or head_dim) or None


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
    return has_varlen()


def default_backend(device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend ``"auto"`` runs for plain causal attention (head dim 128) on
    ``device`` with ``dtype`` (16-bit when None), read from the machine now.

    * CPU (and any non-CUDA device): ``sdpa``, the only one with a CPU backward.
    * CUDA, 16-bit: the kernel table's answer (:mod:`.kernel_table`): ``cudnn`` on
      Hopper and sm100 with a cuDNN above 9.15.0, else FlashAttention
      (``fa4`` / ``flash_attn`` / ``varlen``), else ``sdpa``. On a machine
      without CUDA the GPU's capability is unknown: the FlashAttention rows.
    * CUDA, float32: ``sdpa``.

    Other cases (documents, windows, soft-capping, sinks, other head dims) have
    rows of their own: :func:`.kernel_table.auto_choice`.
    """
    case = Case(dtype or torch.bfloat16, 128)
    return auto_choice(case, Capabilities.read(device)).backend


_RESOLVED: dict[tuple, str] = {}


def _constant_to_compile(fn):
    """What ``torch.compiler.assume_constant_result`` does (it marks ``fn``), without
    importing ``torch._dynamo`` here: that import costs ~1.5 s of every process start,
    and most processes never compile. tests/test_attention.py pins the equivalence."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_to_compile
def _resolved_auto(device: torch.device, dtype: torch.dtype, window: bool, softcap: bool, sinks: bool,
                   documents: bool, head_dim: int, v_head_dim: int) -> str:
    # Runs per attention call, so it is cached per (device, case): the machine is
    # probed once per device. A constant to torch.compile, which calls it at trace
    # time instead of tracing it.
    key = (device.type, device.index, dtype, window, softcap, sinks, documents, head_dim, v_head_dim)
    if key not in _RESOLVED:
        case = Case(dtype, head_dim, v_head_dim, documents, window, softcap, sinks)
        _RESOLVED[key] = auto_choice(case, Capabilities.probe(device)).backend
    return _RESOLVED[key]


@_constant_to_compile
def _named_refusal(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                   v_head_dim: int | None) -> str:
    # kernel_refusal, then the machine's: "" when ``backend`` runs. A constant to
    # torch.compile (decided at trace time: the tables build dataclasses).
    why = kernel_refusal(backend, device.type, dtype, head_dim, v_head_dim)
    if not why and backend in ("cudnn", "fa4"):
        why = _machine_refusal(backend, device, dtype, head_dim, head_dim if v_head_dim is None else v_head_dim)
    return why or ""


@_constant_to_compile
def _machine_refusal(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, v_head_dim: int) -> str:
    # "" when ``backend`` runs here (a str: torch.compile keeps it as a constant).
    case = Case(dtype, head_dim, v_head_dim)
    caps = Capabilities.probe(device)
    why = cudnn_refusal(case, caps, auto=False) if backend == "cudnn" else fa4_refusal(case, caps, auto=False)
    return f"cannot run on this machine ({caps.describe()}): {why}" if why else ""


def resolve_backend(
    backend: str,
    features: frozenset,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int = 0,
    *,
    v_head_dim: int | None = None,
    documents: bool = False,
) -> str:
    """The backend that runs: ``auto`` resolved by the kernel table for this case
    (``features``, ``documents``, head dims, dtype) on ``device``; a named backend
    that cannot express one of the features, take the tensors or run on this
    machine is refused (ValueError naming the backend and the reason)."""
    if backend == "auto":
        return _resolved_auto(device, dtype, "window" in features, "softcap" in features, "sinks" in features,
                              documents, head_dim, head_dim if v_head_dim is None else v_head_dim)
    missing = sorted(features - SUPPORTS[backend])
    if missing:
        able = [b for b in SUPPORTS if features <= SUPPORTS[b]]
        raise ValueError(
            f"attention backend {backend!r} cannot apply {FEATURES[missing[0]]} ({missing[0]}=...): its "
            f"kernel has no such option; backends that can: {', '.join(able)}"
        )
    why = _named_refusal(backend, device, dtype, head_dim, v_head_dim)
    if why:
        raise ValueError(f"attention backend {backend!r} {why}")
    return backend
