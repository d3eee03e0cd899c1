"""The ParallelStyle shared by the token mixers that are not attention (gated delta-nets,
Mamba, Mamba-2, short convolutions): check the mesh, the module's class and its head /
channel counts, then give the module an exchanging forward of its own. Also the
activation of their convolutions (:func:`conv_activation`)."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from ulysses_dtensor.mixers.kernel_choice import FUSED_ACTIVATIONS

from ..attention_function import CallState


def conv_activation(module: nn.Module) -> str | Callable | None:
    """The activation after a mixer's convolution (``module.activation``, a transformers
    name): the name where the convolution kernels apply it themselves, else transformers'
    function of that name (from the module's own modeling module)."""
    name = module.activation
    return name if name in FUSED_ACTIVATIONS else sys.modules[type(module).__module__].ACT2FN[name]


class UlyssesMixerStyle(ParallelStyle):
    """Subclasses set ``kind`` (for messages), ``classes`` (the module classes it runs),
    ``check(model_name, module, sp)`` and ``forward_fn(module, mesh, model_name, call, *args)``."""

    kind = ""
    classes: frozenset | dict = frozenset()
    check: Callable
    forward_fn: Callable

    def __init__(self, model_name: str = "model", call: CallState | None = None):
        super().__init__()
        self.model_name = model_name
        self.call = call  # the model's per-call state (document ids when the model does not pass them down)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(f"{type(self).__name__} must be applied on the 1-D sp mesh (mesh['sp']), got a "
                             f"{device_mesh.ndim}-D mesh with dims {device_mesh.mesh_dim_names}")
        if type(module).__name__ not in self.classes:
            raise ValueError(f"{self.model_name}: {type(module).__name__} is not a supported {self.kind}; "
                             f"supported: {sorted(self.classes)}")
        self.check(self.model_name, module, device_mesh.size())
        # An instance attribute: the class (and unsharded models of it) keep their forward.
        module.forward = functools.partial(type(self).forward_fn, module, device_mesh, self.model_name, self.call)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_name={self.model_name!r})"
