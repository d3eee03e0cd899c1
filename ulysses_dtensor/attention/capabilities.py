"""What a machine offers the attention kernels: the GPU's capability, torch's and
cuDNN's versions, the switches that steer SDPA, and which kernel packages import.

:class:`Capabilities` is a plain record, so :mod:`.kernel_table` decides on it as a
pure function. Two ways to build one:

* :meth:`Capabilities.probe` reads this process's device (cached per device);
* :meth:`Capabilities.target` describes a machine we are not on ("an H100 with
  torch 2.11"), for the memory planner and the docs.

The probe imports nothing heavy on CPU and never imports a kernel package that
its distribution metadata says is absent (a failed import searches the file
system; flash-attn's import loads its CUDA extension).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import re
from dataclasses import dataclass, replace

import torch

__all__ = ["Capabilities", "cudnn_version_int", "cudnn_version_str", "has_varlen", "varlen_keywords"]


def cudnn_version_int(text: str) -> int:
    """``"9.15.1"`` -> 91501, the integer ``torch.backends.cudnn.version()`` reports
    (cuDNN 9: major*10000 + minor*100 + patch; cuDNN 8: major*1000 + minor*100 + patch)."""
    parts = [int(p) for p in re.findall(r"\d+", text)[:3]]
    major, minor, patch = (parts + [0, 0, 0])[:3]
    return major * (10000 if major >= 9 else 1000) + minor * 100 + patch


def cudnn_version_str(version: int | None) -> str:
    if version is None:
        return "none"
    if version >= 90000:
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def _torch_version(text: str) -> tuple[int, int]:
    major, minor = (int(p) for p in re.findall(r"\d+", text)[:2])
    return major, minor


# torch reads TORCH_CUDNN_SDPA_DEPRIORITIZED with c10::utils::check_env: these spell "true".
_ENV_TRUE = {"1", "on", "yes", "true", "y"}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _ENV_TRUE


# Compute capability of the GPUs a plan names (NVIDIA's tables).
GPU_SM = {
    "a100": (8, 0), "a800": (8, 0), "a10": (8, 6), "a10g": (8, 6), "rtx3090": (8, 6), "a6000": (8, 6),
    "l4": (8, 9), "l40": (8, 9), "l40s": (8, 9), "rtx4090": (8, 9),
    "h100": (9, 0), "h200": (9, 0), "h800": (9, 0), "h20": (9, 0), "gh200": (9, 0),
    "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3), "gb300": (10, 3), "rtxpro6000": (12, 0),
}


@dataclass(frozen=True)
class Capabilities:
    """One machine as the kernel table sees it.

    ``cudnn``: the cuDNN that torch loaded (``torch.backends.cudnn.version()``);
    ``cudnn_bundled``: the version of the ``nvidia-cudnn-cu1x`` wheel installed
    beside torch, when one is -- a ``cudnn`` older than it means a system cuDNN
    earlier on ``LD_LIBRARY_PATH`` hides the bundled one. ``fa4``: the
    ``flash-attn-4`` package is installed AND this torch can route its flash
    kernels to it (``torch.nn.attention.activate_flash_attention_impl("FA4")``).
    """

    device_type: str = "cpu"
    sm: tuple[int, int] | None = None
    torch_version: tuple[int, int] = (2, 11)
    cudnn: int | None = None
    cudnn_bundled: int | None = None
    cudnn_sdp_enabled: bool = True  # torch.backends.cuda.enable_cudnn_sdp(False) turns it off
    cudnn_deprioritized: bool = False  # TORCH_CUDNN_SDPA_DEPRIORITIZED set
    deterministic: bool = False  # torch.use_deterministic_algorithms(True) (not warn-only): no cuDNN SDPA
    flash_attn: bool = False  # flash-attn 2 (the `flash_attn` package) imports
    fa4: bool = False
    varlen: bool = True  # torch.nn.attention.varlen (torch >= 2.10)
    varlen_window: bool = True  # its varlen_attn takes window_size (torch >= 2.11)

    # ------------------------------------------------------------------ #
    # What the table asks
    # ------------------------------------------------------------------ #

    @property
    def cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def sm_name(self) -> str:
        if self.sm is None:
            return "a GPU of unknown capability" if self.cuda else self.device_type
        return f"sm{self.sm[0]}{self.sm[1]}"

    @property
    def cudnn_hidden(self) -> bool:
        """A cuDNN older than the wheel torch installed was loaded instead of it."""
        return self.cudnn is not None and self.cudnn_bundled is not None and self.cudnn < self.cudnn_bundled

    def describe(self) -> str:
        """``sm90, torch 2.11, cuDNN 9.15.1`` (what the banner quotes)."""
        if not self.cuda:
            return f"{self.device_type}, torch {self.torch_version[0]}.{self.torch_version[1]}"
        hidden = f" (the wheel's {cudnn_version_str(self.cudnn_bundled)} hidden)" if self.cudnn_hidden else ""
        return (f"{self.sm_name}, torch {self.torch_version[0]}.{self.torch_version[1]}, "
                f"cuDNN {cudnn_version_str(self.cudnn)}{hidden}")

    # ------------------------------------------------------------------ #
    # Building one
    # ------------------------------------------------------------------ #

    @classmethod
    def target(
        cls,
        gpu: str,
        torch_version: str = "2.11",
        *,
        cuda: str = "13.0",
        cudnn: str | None = None,
        packages: tuple[str, ...] = (),
    ) -> Capabilities:
        """A machine we are not on: ``gpu`` a name (``"H100"``, ``"B200"``, ``"A100"``, ...)
        or ``"sm90"``; ``packages`` of ``"flash_attn"``, ``"fa4"``.

        ``cudnn`` defaults to the lowest cuDNN torch's CUDA wheels ship (its
        ``check_prefer_cudnn_attention`` comment: CUDA <= 12.9 wheels carry a cuDNN
        older than 9.15.1): 9.15.1 for CUDA 13, 9.10.2 for CUDA 12 (what the cu128
        wheels of torch 2.8-2.11 pin). Pass the real one when it is known.
        """
        sm = _parse_gpu(gpu)
        tv = _torch_version(torch_version)
        unknown = set(packages) - {"flash_attn", "fa4"}
        if unknown:
            raise ValueError(f"Capabilities.target: unknown packages {sorted(unknown)}; valid: flash_attn, fa4")
        if cudnn is None:
            cudnn = "9.15.1" if _torch_version(cuda)[0] >= 13 else "9.10.2"
        return cls(
            device_type="cuda",
            sm=sm,
            torch_version=tv,
            cudnn=cudnn_version_int(cudnn),
            flash_attn="flash_attn" in packages,
            fa4="fa4" in packages and tv >= (2, 11),
            varlen=tv >= (2, 10),
            varlen_window=tv >= (2, 11),
        )

    @staticmethod
    @functools.cache
    def probe(device: torch.device | str) -> Capabilities:
        """:meth:`read`, once per device for the process: set torch's SDPA switches,
        determinism and the environment before the first attention call."""
        return Capabilities.read(device)

    @classmethod
    def read(cls, device: torch.device | str) -> Capabilities:
        """This process's ``device``, read now. A CUDA device on a machine without
        CUDA (a plan or a test on CPU) reads as a GPU of unknown capability."""
        device = torch.device(device)
        tv = _torch_version(torch.__version__)
        if device.type != "cuda":
            return cls(device_type=device.type, torch_version=tv)
        varlen = has_varlen()
        caps = cls(
            device_type="cuda",
            torch_version=tv,
            cudnn_deprioritized=_env_true("TORCH_CUDNN_SDPA_DEPRIORITIZED"),
            deterministic=torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled(),
            flash_attn=flash_attn_imports(),
            fa4=fa4_installed() and torch_routes_fa4(),
            varlen=varlen,
            varlen_window=varlen and "window_size" in varlen_keywords(),
        )
        if not torch.cuda.is_available():
            return caps
        return caps.with_(
            sm=tuple(torch.cuda.get_device_capability(device)),
            cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            cudnn_bundled=_bundled_cudnn(),
            cudnn_sdp_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
        )

    def with_(self, **changes) -> Capabilities:
        """A copy with ``changes`` (a test's or a plan's what-if)."""
        return replace(self, **changes)


def _parse_gpu(gpu: str) -> tuple[int, int]:
    key = re.sub(r"[\s_-]", "", gpu.lower())
    m = re.fullmatch(r"sm(\d+?)(\d)", key)
    if m:
        return int(m.group(1)), int(m.group(2))
    for name, sm in sorted(GPU_SM.items(), key=lambda kv: -len(kv[0])):
        if key.startswith((name, "nvidia" + name)):
            return sm
    raise ValueError(f"unknown GPU {gpu!r}; give one of {', '.join(sorted(GPU_SM))} or 'smXY'")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _bundled_cudnn() -> int | None:
    version = _dist_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
    return None if version is None else cudnn_version_int(version)


def has_varlen() -> bool:
    """torch has ``torch.nn.attention.varlen`` (2.10 on)."""
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return False
    return True


@functools.cache
def varlen_keywords() -> frozenset:
    """The keywords this torch's ``varlen_attn`` takes (its signature changed from 2.10 to 2.12)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def flash_attn_imports() -> bool:
    """flash-attn 2 imports (absent on CPU machines; its import loads a CUDA extension)."""
    try:
        importlib.import_module("flash_attn")
    except ImportError:
        return False
    return True


def fa4_installed() -> bool:
    """The ``flash-attn-4`` distribution (module ``flash_attn.cute``) is installed."""
    return _dist_version("flash-attn-4", "flash_attn_4") is not None


def torch_routes_fa4() -> bool:
    """This torch registers an ``"FA4"`` flash-attention implementation."""
    try:
        from torch.nn.attention import list_flash_attention_impls
    except ImportError:
        return False
    return "FA4" in list_flash_attention_impls()
