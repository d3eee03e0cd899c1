"""Ulysses SP for the gated short convolutions of LFM2 / LFM2-MoE / LFM3 (``conv`` layers).

Such a layer projects ``B, C, x`` per token, convolves ``B * x`` along the
sequence with a short depthwise causal kernel (per channel), and gates the
result with ``C``. Per layer: the projection runs on this rank's slice; one
all-to-all moves ``B * x`` to Shard(channels) (the whole sequence of
``hidden/sp`` channels); the convolution (this rank's rows of its weight)
runs over it, restarting at every packed document's start
(:func:`ulysses_dtensor.mixers.dispatch.causal_conv`: a GPU kernel or the torch code);
one all-to-all brings it back for the ``C`` gate and the out projection.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ulysses_dtensor.mixers.dispatch import causal_conv
from ulysses_dtensor.parallel.mesh import divisors
from ulysses_dtensor.parallel.ulysses import _heads_to_seq_local, _seq_to_heads_local

from ..attention_function import CallState, call_document_ids
from .mamba import _refuse_inputs
from .style import UlyssesMixerStyle

__all__ = ["SHORT_CONVS", "UlyssesShortConv", "check_short_conv"]

SHORT_CONVS = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"})


def check_short_conv(name: str, module: nn.Module, sp: int) -> None:
    channels = module.conv.weight.shape[0]
    if channels % sp:
        raise ValueError(
            f"{name}: Ulysses SP splits the short convolution's {channels} channels over sp ranks, but sp={sp} "
            f"does not divide them; valid sp: {divisors(channels)}")


def _short_conv_forward(module: nn.Module, mesh: DeviceMesh, model_name: str, call: CallState | None,
                        hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    _refuse_inputs(model_name, "short convolution", attention_mask, kwargs)
    sp, rank = mesh.size(), mesh.get_local_rank()
    b, c, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    bx = b * x
    if sp > 1:
        (bx,) = _seq_to_heads_local([bx.unsqueeze(-1)], mesh)
        bx = bx.squeeze(-1)
    width = bx.shape[-1]
    mine = slice(rank * width, (rank + 1) * width)
    bias = None if module.conv.bias is None else module.conv.bias[mine]
    y = causal_conv(bx, module.conv.weight.squeeze(1)[mine], bias, call_document_ids(kwargs, call))
    if sp > 1:
        y = _heads_to_seq_local(y.unsqueeze(-1), mesh).squeeze(-1)
    return module.out_proj((c * y).contiguous())


class UlyssesShortConv(UlyssesMixerStyle):
    """Ulysses SP for one short-convolution layer (a class of :data:`SHORT_CONVS`), on the 1-D sp mesh."""

    kind, classes = "short convolution mixer", SHORT_CONVS
    check = staticmethod(check_short_conv)
    forward_fn = staticmethod(_short_conv_forward)

