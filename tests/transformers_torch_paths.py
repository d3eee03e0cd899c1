"""transformers' torch paths on a torch without CUDA, where fla-core is installed.

transformers (5.x) binds its hybrid layers' gated-delta / KDA functions to fla-core's
Triton kernels whenever ``fla`` imports (``use_kernel_func_from_hub_with_fallback`` in
``transformers/integrations/hub_kernels.py``), whatever the tensors' device: on a
CPU-only torch, Triton finds no driver and the unsharded reference models of the tests
fail. fla-core is in the ``test`` extra (its signatures are checked here), so
:func:`install` makes that decorator keep transformers' torch function for the GPU-only
packages when torch has no CUDA build: at once where transformers' module is loaded,
else when it loads. conftest.py installs it, and so does each pooled rank before its
first task (tests/distributed.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

__all__ = ["install"]

GPU_ONLY = ("fla", "causal_conv1d", "mamba_ssm")
_MODULE = "transformers.integrations.hub_kernels"
_MARK = "_torch_paths_without_cuda"


def _keep_torch_functions(module) -> None:
    import torch

    original = module.use_kernel_func_from_hub_with_fallback
    if torch.backends.cuda.is_built() or getattr(original, _MARK, False):
        return

    def without_gpu_packages(func_name: str, package: str, internal_path: str | None = None):
        if package in GPU_ONLY:
            package = f"{package}_needs_cuda"  # does not import: transformers keeps its torch function
        return original(func_name, package, internal_path)

    setattr(without_gpu_packages, _MARK, True)
    module.use_kernel_func_from_hub_with_fallback = without_gpu_packages


class _OnLoad(importlib.abc.MetaPathFinder):
    """Patches transformers' hub-kernel module right after it executes, before any
    modeling module decorates its functions with it."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _keep_torch_functions(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(importlib.util.find_spec(p) is not None for p in GPU_ONLY):
        return  # nothing for transformers to bind to
    if _MODULE in sys.modules:
        _keep_torch_functions(sys.modules[_MODULE])
    elif not any(isinstance(f, _OnLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnLoad())


install()
