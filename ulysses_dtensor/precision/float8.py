"""FP8 linear layers (torchao's float8 training) under sequence parallelism.

``convert_to_float8`` swaps a model's ``nn.Linear`` layers for torchao's
``Float8Linear`` before the model is parallelized (as torchtitan does): their
matmuls then run in float8 with dynamic scales, the weights stay in their own
precision.

Why SP needs a thought here. A dynamic scale is ``amax(|x|)`` over some part of
the tensor being cast:

* ``rowwise`` (and ``rowwise_with_gw_hp``) scale each row -- each token -- by its
  own amax, so a rank's slice of the sequence casts exactly as the same tokens
  inside the whole sequence: SP computes what one process computes, nothing to do.
* ``tensorwise`` scales the whole activation (and the whole gradient of the
  output) by one amax. Under SP a rank sees ``seq / sp`` tokens, so its scale, and
  so its rounding, would depend on the mesh. Here the amax of the inputs and of
  the output gradients is taken over the sp group (a MAX all-reduce of one
  scalar per cast), forward and backward, so the scale is the whole sequence's:
  a dp x sp mesh then equals one process that runs each data-parallel rank's rows
  as one micro-batch. The weights are whole on every rank at compute time (FSDP
  gathers them), so their amax needs nothing.

torchao's linear takes operands already cast to FP8 as they are: the tensorwise
layers here (:class:`SPFloat8Linear`) cast their input with the amax reduced over the
sp mesh before the matmul, and their output's gradient the same way in backward (an
identity in forward), so torchao's GEMMs run on scales that do not depend on the mesh.
Nothing of torchao is patched, and the casts are traceable by ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention.planning import planning_target

__all__ = ["RECIPES", "Float8Options", "Float8Report", "convert_to_float8", "precompute_fp8_weight_scales",
           "FLOAT8_EXTRA_MSG"]

RECIPES = ("rowwise", "rowwise_with_gw_hp", "tensorwise")
# Left in high precision by default: the output head (its logits feed the loss whole) and
# MoE routers (a small matmul whose rounding moves tokens between experts).
DEFAULT_FILTER = ("output", "lm_head", "gate", "router")
FLOAT8_EXTRA_MSG = ("FP8 training needs torchao (the 'float8' extra): pip install 'ulysses-dtensor[float8]'")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) onward


@dataclass(frozen=True)
class Float8Options:
    """FP8 linear layers, as torchtitan names the switches.

    Attributes:
        enable: convert the model's linear layers to FP8 compute.
        recipe_name: ``rowwise`` (default: per-token scales), ``rowwise_with_gw_hp``
            (the weight gradient in high precision), or ``tensorwise`` (one scale per
            tensor: amax over the sp group under SP).
        filter_fqns: modules left in high precision: a name matches a module whose
            qualified name has it as one of its dotted parts (``output``, ``gate``) or
            begins with it (``layers.0.attention``).
        emulate: torchao's emulation of FP8 matmuls (any device; for tests only).
        enable_fsdp_float8_all_gather: FSDP2 all-gathers the weights in FP8 (half the
            bf16 bytes), their scales computed once per step after the optimizer
            (:func:`precompute_fp8_weight_scales`); tensorwise only (torchao's FSDP
            path casts whole tensors).
    """

    enable: bool = False
    recipe_name: str = "rowwise"
    filter_fqns: tuple[str, ...] = field(default=DEFAULT_FILTER)
    emulate: bool = False
    enable_fsdp_float8_all_gather: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "filter_fqns", tuple(self.filter_fqns))
        if self.recipe_name not in RECIPES:
            raise ValueError(f"float8 recipe_name={self.recipe_name!r}; valid: {', '.join(RECIPES)}")
        if self.enable_fsdp_float8_all_gather and self.recipe_name != "tensorwise":
            raise ValueError(
                f"float8 enable_fsdp_float8_all_gather=true needs recipe_name='tensorwise' (torchao casts whole "
                f"weights for the all-gather), got recipe_name={self.recipe_name!r}")

    def filtered(self, fqn: str) -> bool:
        parts = fqn.split(".")
        return any(f in parts or fqn == f or fqn.startswith(f + ".") for f in self.filter_fqns)


@dataclass
class Float8Report:
    """What :func:`convert_to_float8` did, for the banner."""

    recipe: str
    converted: int = 0
    filtered: list[str] = field(default_factory=list)
    wrong_size: list[str] = field(default_factory=list)  # a dimension FP8 GEMMs cannot take (not % 16)
    emulate: bool = False
    fsdp_float8_all_gather: bool = False

    def describe(self) -> str:
        if not self.converted:
            return "float8 off"
        left = len(self.filtered) + len(self.wrong_size)
        parts = [f"float8 {self.recipe}{' (emulated: tests only)' if self.emulate else ''}: {self.converted} linear "
                 f"layers in FP8"]
        if left:
            parts.append(f"{left} left in high precision ({len(self.filtered)} by filter_fqns, "
                         f"{len(self.wrong_size)} with a size not divisible by 16)")
        if self.fsdp_float8_all_gather:
            parts.append("weights all-gathered in FP8")
        return "; ".join(parts)


def _import_torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(FLOAT8_EXTRA_MSG) from e
    return Float8LinearConfig, convert_to_float8_training


def check_float8_device(options: Float8Options, device: torch.device) -> None:
    """FP8 compute needs an sm89+ GPU; ``emulate`` runs anywhere, with a warning."""
    device = torch.device(device)
    if options.emulate:
        warnings.warn("float8 emulate=true emulates FP8 matmuls in high precision: for tests, not for training "
                      "speed", stacklevel=3)
        return
    target = planning_target()
    if target is not None and target.cuda:
        # The memory planner traces a GPU's step on CPU fake tensors (FP8 matmuls included,
        # by their shape functions); it refuses a target without FP8 before tracing.
        return
    if device.type != "cuda":
        raise ValueError(f"float8 on {device.type}: FP8 matmuls need a GPU of compute capability "
                         f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (L4, L40, H100, H200, B200); "
                         f"float8 emulate=true emulates them on any device, for tests")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"float8 on {name} (sm{cap[0]}{cap[1]}): FP8 matmuls need compute capability "
                         f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (L4, L40, H100, H200, B200); "
                         f"set float8 enable=false here")


def _fused_experts(model: nn.Module) -> list[str]:
    """MoE expert modules that hold their experts' weights as one 3-D parameter (transformers'
    fused experts): torchao's linear swap cannot reach them."""
    return [name for name, m in model.named_modules()
            if any(p.dim() == 3 for p in m.parameters(recurse=False))]


def convert_to_float8(model: nn.Module, options: Float8Options, *, device, sp_mesh=None) -> Float8Report:
    """Swap ``model``'s eligible ``nn.Linear`` layers for FP8 ones, in place, before it is
    parallelized; return what was converted and what was left in high precision.

    ``sp_mesh``: the model's sp mesh (its ulysses x ring ranks); with ``tensorwise`` the
    amax of inputs and output gradients is reduced over it. Raises ImportError naming the
    extra without torchao, ValueError for a device without FP8, a recipe that cannot
    run, or MoE experts FP8 cannot reach (named, with the filter that leaves them in
    high precision).
    """
    report = Float8Report(options.recipe_name, emulate=options.emulate,
                          fsdp_float8_all_gather=options.enable_fsdp_float8_all_gather)
    if not options.enable:
        return report
    Float8LinearConfig, convert = _import_torchao()
    check_float8_device(options, device)
    experts = [n for n in _fused_experts(model) if not options.filtered(n)]
    if experts:
        raise ValueError(
            f"float8: {len(experts)} MoE expert modules hold their experts as fused 3-D weights (first: "
            f"{experts[0]!r}), which torchao's FP8 linear swap does not cover (its grouped-GEMM path is not used "
            f"here); leave them in high precision with float8 filter_fqns += [{experts[0].split('.')[-1]!r}]")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(options.recipe_name), emulate=options.emulate,
                                 enable_fsdp_float8_all_gather=options.enable_fsdp_float8_all_gather)

    def eligible(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if options.filtered(fqn) or "lora_" in fqn:  # LoRA adapters stay in high precision
            report.filtered.append(fqn)
            return False
        if module.in_features % 16 or module.out_features % 16:
            report.wrong_size.append(fqn)
            return False
        report.converted += 1
        return True

    convert(model, module_filter_fn=eligible, config=config)
    if options.recipe_name == "tensorwise" and sp_mesh is not None and sp_mesh.size() > 1:
        layer_class = _sp_float8_linear()
        for module in model.modules():
            if _is_float8_linear(module):
                module.__class__ = layer_class
                module.amax_mesh = sp_mesh
    model.float8_report = report
    return report


def precompute_fp8_weight_scales(model: nn.Module) -> None:
    """After each optimizer step, with ``enable_fsdp_float8_all_gather``: every FP8 weight's
    scale for the next step's all-gather, in one all-reduce."""
    report = getattr(model, "float8_report", None)
    if report is None or not report.fsdp_float8_all_gather:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


# --------------------------------------------------------------------------- #
# Tensorwise: the amax over the sp group
# --------------------------------------------------------------------------- #


@functools.cache
def _sp_float8_linear() -> type:
    """:class:`SPFloat8Linear`, made on first use (torchao imports lazily)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import tensor_to_scale

    tensorwise = ScalingGranularity.TENSORWISE

    class GradToFloat8OverMesh(torch.autograd.Function):
        """Forward: identity. Backward: the output's gradient cast to FP8 with its amax
        reduced over the sp mesh (torchao's matmul backward then uses it as it is)."""

        @staticmethod
        def forward(ctx, out, mesh, dtype, mm_config, power_of_2):
            ctx.mesh, ctx.dtype, ctx.mm_config, ctx.power_of_2 = mesh, dtype, mm_config, power_of_2
            return out

        @staticmethod
        def backward(ctx, grad):
            scale = tensor_to_scale(grad, ctx.dtype, reduce_amax=True, device_mesh=ctx.mesh,
                                    scaling_granularity=tensorwise, round_scales_to_power_of_2=ctx.power_of_2)
            return (hp_tensor_and_scale_to_float8(grad, scale, ctx.dtype, ctx.mm_config, GemmInputRole.GRAD_OUTPUT),
                    None, None, None, None)

    class SPFloat8Linear(Float8Linear):
        """A tensorwise FP8 linear layer whose activation and output-gradient scales are
        the whole sequence's: their amax is reduced over ``amax_mesh`` (the sp ranks)."""

        amax_mesh = None

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            c = self.config
            x8 = hp_tensor_to_float8_dynamic(
                input, c.cast_config_input.target_dtype, self.linear_mm_config, reduce_amax=True,
                gemm_input_role=GemmInputRole.INPUT, device_mesh=self.amax_mesh, scaling_granularity=tensorwise,
                round_scales_to_power_of_2=c.round_scales_to_power_of_2)
            out = matmul_with_hp_or_float8_args.apply(x8, self.weight.t(), self.linear_mm_config, c)
            out = GradToFloat8OverMesh.apply(out, self.amax_mesh, c.cast_config_grad_output.target_dtype,
                                             self.linear_mm_config, c.round_scales_to_power_of_2)
            return out if self.bias is None else out + self.bias.to(out.dtype)

    return SPFloat8Linear
