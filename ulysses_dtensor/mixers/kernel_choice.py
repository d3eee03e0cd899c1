"""Which implementation runs each token-mixing op: a GPU kernel package or the pure-torch code.

The ops, and the kernels that can run them (each restarting at packed documents):

==============  ===========================  ============================================
op              what                         GPU kernel (package: function, documents as)
==============  ===========================  ============================================
``gated_delta`` the gated delta rule         fla-core: ``chunk_gated_delta_rule``, cu_seqlens
``conv``        the short causal convolution causal-conv1d: ``causal_conv1d_fn``, seq_idx;
                                             else fla-core: ``causal_conv1d``, cu_seqlens
``ssd``         the Mamba-2 scan             mamba-ssm: ``mamba_chunk_scan_combined``, seq_idx
``selective``   the Mamba selective scan     mamba-ssm: ``selective_scan_fn`` (no documents)
==============  ===========================  ============================================

A kernel runs only where it computes what the torch code computes: on CUDA, with its
package importable, in the dtypes it computes exactly (fla's and mamba-ssm's chunked
kernels multiply on tensor cores, TF32 for float32 inputs: 16-bit only; the convolutions
and the selective scan accumulate in float32: any float dtype), for the shapes it takes.
Anything else runs the torch code of :mod:`.gated_delta` / :mod:`.ssm_scan`, never a
different result; so does a layer inside torch.compile (the kernels are opaque to it). Each ``choose_*`` function is pure (the importable kernels passed in,
or probed once on CUDA), so every row is tested on CPU with them mocked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

__all__ = [
    "FUSED_ACTIVATIONS",
    "KERNEL_FUNCTIONS",
    "KernelChoice",
    "choose_conv",
    "choose_gated_delta",
    "choose_selective_scan",
    "choose_ssd",
    "describe_mixer_kernels",
    "importable_kernels",
    "load_kernel",
]

# kernel name -> (distribution to install, module, function)
KERNEL_FUNCTIONS = {
    "fla.chunk_gated_delta_rule": ("fla-core", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "fla.causal_conv1d": ("fla-core", "fla.modules.causal_conv1d", "causal_conv1d"),
    "causal_conv1d_fn": ("causal-conv1d", "causal_conv1d", "causal_conv1d_fn"),
    "mamba_chunk_scan_combined": ("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
    "selective_scan_fn": ("mamba-ssm", "mamba_ssm.ops.selective_scan_interface", "selective_scan_fn"),
}
TORCH = "torch"
# Activations the convolution kernels apply themselves (others run after the kernel).
FUSED_ACTIVATIONS = (None, "silu", "swish")
_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KernelChoice:
    """What runs one op, and why (for the banner, the log and the docs)."""

    op: str
    kernel: str  # a name of KERNEL_FUNCTIONS, or "torch"
    reason: str

    def __str__(self) -> str:
        return f"{self.op}: {self.kernel} ({self.reason})"


_LOADED: dict[str, object] = {}
_FAILED: dict[str, str] = {}


def load_kernel(name: str):
    """The kernel function ``name`` of :data:`KERNEL_FUNCTIONS`, imported on first use;
    an ImportError naming the package to install where it does not import."""
    if name not in _LOADED:
        dist, module, attr = KERNEL_FUNCTIONS[name]
        try:
            _LOADED[name] = getattr(importlib.import_module(module), attr)
        except Exception as e:  # a CUDA extension missing or built for another torch fails in many ways
            _FAILED[name] = f"{type(e).__name__}: {e}"
            raise ImportError(f"mixer kernel {name} needs {dist} ({module}.{attr}): {_FAILED[name]}") from e
    return _LOADED[name]


def importable_kernels() -> frozenset[str]:
    """The kernels of :data:`KERNEL_FUNCTIONS` whose package imports here (each import
    tried once). Import only where kernels can run (CUDA): a package's import can be slow."""
    return frozenset(name for name in KERNEL_FUNCTIONS if name in _IMPORTABLE)


class _Importable:
    """The importable kernels as a lazy set: ``name in`` imports that kernel's package alone."""

    def __contains__(self, name: str) -> bool:
        if name in _FAILED:
            return False
        try:
            load_kernel(name)
        except ImportError:
            return False
        return True


_IMPORTABLE = _Importable()


def _not_here(op: str, device_type: str, compiling: bool) -> KernelChoice | None:
    if device_type != "cuda":
        return KernelChoice(op, TORCH, f"tensors on {device_type}: the kernels run on CUDA only")
    if compiling:
        # fla-core's entry points disable torch.compile, the CUDA extensions are opaque to it:
        # a fullgraph-compiled layer (transformers' hybrid families) could not call them.
        return KernelChoice(op, TORCH, "inside torch.compile: the kernels cannot be traced, the torch code can "
                                       "(leave the hybrid layers uncompiled for the kernels)")
    return None


def _missing(op: str, dist: str, kernel: str) -> KernelChoice:
    why = _FAILED.get(kernel)
    return KernelChoice(op, TORCH, f"{dist} not importable" + (f": {why}" if why else f"; pip install {dist}"))


def choose_gated_delta(device_type: str, dtype: torch.dtype, k_dim: int, v_dim: int,
                       kernels=None, compiling: bool = False) -> KernelChoice:
    """The gated delta rule: fla's chunked kernel, or the torch code."""
    op = "gated delta rule"
    if (refused := _not_here(op, device_type, compiling)) is not None:
        return refused
    kernels = _IMPORTABLE if kernels is None else kernels
    if "fla.chunk_gated_delta_rule" not in kernels:
        return _missing(op, "fla-core", "fla.chunk_gated_delta_rule")
    if dtype not in _HALF:
        return KernelChoice(op, TORCH, f"{_name(dtype)}: fla's kernels multiply in TF32 for float32, exact for 16-bit only")
    if k_dim > 256 or k_dim % 2 or v_dim % 2:
        return KernelChoice(op, TORCH, f"head dims {k_dim}/{v_dim}: fla's kernels take even head dims, keys up to 256")
    return KernelChoice(op, "fla.chunk_gated_delta_rule", f"CUDA, {_name(dtype)}, documents as cu_seqlens")


def choose_conv(device_type: str, dtype: torch.dtype, channels: int, width: int,
                kernels=None, compiling: bool = False) -> KernelChoice:
    """The short causal convolution: causal-conv1d (CUDA C++), else fla's (Triton), else torch."""
    op = "causal conv"
    if (refused := _not_here(op, device_type, compiling)) is not None:
        return refused
    kernels = _IMPORTABLE if kernels is None else kernels
    if dtype not in _FLOAT:
        return KernelChoice(op, TORCH, f"{_name(dtype)}: the kernels take float16, bfloat16 and float32")
    if "causal_conv1d_fn" in kernels:
        if 2 <= width <= 4 and channels % 8 == 0:
            return KernelChoice(op, "causal_conv1d_fn", f"CUDA, {_name(dtype)}, documents as seq_idx")
        skipped = f"causal-conv1d takes widths 2-4 and channels divisible by 8, not {width} / {channels}"
    else:
        skipped = "causal-conv1d not importable"
    if "fla.causal_conv1d" in kernels:
        return KernelChoice(op, "fla.causal_conv1d", f"CUDA, {_name(dtype)}, documents as cu_seqlens; {skipped}")
    return KernelChoice(op, TORCH, f"{skipped}, fla-core not importable; pip install causal-conv1d or fla-core")


def choose_ssd(device_type: str, dtype: torch.dtype, kernels=None, compiling: bool = False) -> KernelChoice:
    """The Mamba-2 scan: mamba-ssm's chunked kernel, or the torch code."""
    op = "Mamba-2 scan"
    if (refused := _not_here(op, device_type, compiling)) is not None:
        return refused
    kernels = _IMPORTABLE if kernels is None else kernels
    if "mamba_chunk_scan_combined" not in kernels:
        return _missing(op, "mamba-ssm", "mamba_chunk_scan_combined")
    if dtype not in _HALF:
        return KernelChoice(op, TORCH, f"{_name(dtype)}: mamba-ssm's chunked kernels multiply in TF32 for float32, "
                                       "exact for 16-bit only")
    return KernelChoice(op, "mamba_chunk_scan_combined", f"CUDA, {_name(dtype)}, documents as seq_idx")


def choose_selective_scan(device_type: str, dtype: torch.dtype, state: int, documents: bool,
                          kernels=None, compiling: bool = False) -> KernelChoice:
    """The Mamba selective scan: mamba-ssm's kernel for one document per row, else torch."""
    op = "selective scan"
    if (refused := _not_here(op, device_type, compiling)) is not None:
        return refused
    kernels = _IMPORTABLE if kernels is None else kernels
    if "selective_scan_fn" not in kernels:
        return _missing(op, "mamba-ssm", "selective_scan_fn")
    if documents:
        return KernelChoice(op, TORCH, "packed documents: mamba-ssm's selective_scan_fn cannot restart the state")
    if dtype not in _FLOAT or state > 256:
        return KernelChoice(op, TORCH, f"{_name(dtype)}, state {state}: mamba-ssm takes float dtypes, states up to 256")
    return KernelChoice(op, "selective_scan_fn", f"CUDA, {_name(dtype)}, one document per row")


def _name(dtype: torch.dtype | None) -> str:
    return "mixed dtypes" if dtype is None else str(dtype).removeprefix("torch.")


_BANNER_OPS = ("conv", "gated_delta", "ssd", "selective")


def describe_mixer_kernels(ops, device: torch.device | str, dtype: torch.dtype, kernels=None) -> str:
    """One line for a run's banner: what runs each op of ``ops`` (``conv``, ``gated_delta``,
    ``ssd``, ``selective``) for tensors on ``device`` in ``dtype``, at the usual shapes (head
    dims 128, widths 4, channels divisible by 8; a shape a kernel cannot take runs torch,
    logged when it happens)."""
    unknown = set(ops) - set(_BANNER_OPS)
    if unknown:
        raise ValueError(f"unknown mixer ops {sorted(unknown)}; known: {list(_BANNER_OPS)}")
    device_type = torch.device(device).type
    if device_type != "cuda":
        return f"torch for every op (tensors on {device_type}: the kernels run on CUDA only)"
    choose = {
        "conv": lambda: choose_conv(device_type, dtype, 8, 4, kernels),
        "gated_delta": lambda: choose_gated_delta(device_type, dtype, 128, 128, kernels),
        "ssd": lambda: choose_ssd(device_type, dtype, kernels),
        "selective": lambda: choose_selective_scan(device_type, dtype, 16, False, kernels),
    }
    picked = [choose[op]() for op in _BANNER_OPS if op in ops]
    parts = [str(c) for c in picked]
    if any(c.kernel == "selective_scan_fn" for c in picked):
        parts.append("selective scan with packed documents: torch")
    return "; ".join(parts)
