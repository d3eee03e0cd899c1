"""The CUDA caching allocator set for long context: expandable segments, unless the user chose.

At millions of tokens, and as a context schedule changes the length, the caching
allocator's fixed-size segments fragment: a planned fit can fail with memory reserved
but unused. Expandable segments (one growing mapping per stream) are PyTorch's remedy.
So the trainer's launches (``scripts/run_train.sh``, ``python -m ulysses_dtensor.train``,
``UlyssesHFTrainer``) set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when neither
``PYTORCH_CUDA_ALLOC_CONF`` nor ``PYTORCH_ALLOC_CONF`` is set (even to an empty value):
a setting of the user's is kept as it is.

torch reads the variable when it is imported (torch 2.13: the allocator's settings are
parsed then), so the entry point sets it before importing torch. Where torch is imported
already (a Trainer script), :func:`apply_allocator_default` also sets it in the running
allocator with ``torch._C._accelerator_setAllocatorSettings`` (torch >= 2.9: 2.11 and
2.13 have it; before, ``torch.cuda.memory._set_allocator_settings``), which applies to
the segments allocated from then on, whether or not CUDA is initialised.

This module imports nothing heavy: the entry point calls it before ``import torch``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ALLOC_ENV", "DEFAULT_ALLOC_CONF", "allocator_banner", "apply_allocator_default"]

ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_USER_ENVS = ("PYTORCH_ALLOC_CONF", ALLOC_ENV)  # torch reads either; the first is the newer name
DEFAULT_ALLOC_CONF = "expandable_segments:True"
# Set beside the default by whoever applied it (run_train.sh, the entry point): the ranks
# torchrun starts then know the value is this package's default, not the user's.
DEFAULTED_ENV = "ULYSSES_DTENSOR_ALLOC_DEFAULT"


def apply_allocator_default(environ=None) -> bool:
    """Set the default where the user set no allocator configuration; True when it was set
    here (False: the user's value is kept, or the default was set by a parent launcher)."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _USER_ENVS):
        return False
    env[ALLOC_ENV] = DEFAULT_ALLOC_CONF
    env[DEFAULTED_ENV] = "1"
    torch = sys.modules.get("torch") if environ is None else None
    if torch is not None:  # imported already: it parsed the environment before this
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            setter = torch.cuda.memory._set_allocator_settings
        setter(DEFAULT_ALLOC_CONF)
    return True


def allocator_banner(device_type: str, environ=None) -> str:
    """What the run's banner says about the allocator: the setting in effect and whose it is."""
    env = os.environ if environ is None else environ
    name = next((n for n in _USER_ENVS if n in env), None)
    if name is None:
        setting = "torch's default allocator settings (no PYTORCH_CUDA_ALLOC_CONF)"
    elif env.get(DEFAULTED_ENV) == "1" and env.get(name) == DEFAULT_ALLOC_CONF:
        setting = f"{DEFAULT_ALLOC_CONF} (this package's default; set {ALLOC_ENV} to choose another)"
    else:
        setting = f"{name}={env[name]!r} (yours, kept)"
    if device_type != "cuda":
        return f"allocator: {setting}, for CUDA only: not in effect on {device_type}"
    return f"allocator: {setting}"
