"""LoRA adapters from ``peft`` on a model this package parallelizes (transformers' or our Llama).

::

    spec = LoraSpec(rank=16, alpha=32, target_modules=("q_proj", "v_proj"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    add_lora(model, spec)                   # peft's LoRA layers; the base frozen
    parallelize_hf_model(model, pmesh, ...)   # FSDP2 shards base and adapters alike
    model.to_empty(device="cuda")
    load_transformers_weights(model, path)  # the base, by its checkpoint names
    init_lora_weights(model, seed=0)        # A kaiming-uniform, B zero: the same on every mesh

Why before parallelizing: ``fully_shard`` shards whatever parameters a module
holds when it is called, and FSDP2 keeps frozen and trainable parameters in one
group (only those with gradients are reduce-scattered); activation
checkpointing, tiled per-token blocks, host offload and compile then wrap the
layers *with* their adapters inside, so every switch that recomputes or moves a
layer recomputes or moves its adapters too (adapter weights missed by a tiled
MLP under ZeRO-3 is ArcticTraining #334). The layers are peft's own
(``peft.inject_adapter_in_model``: no ``PeftModel`` wrapper, so the model keeps
its class, its forward and its names), with these names::

    ...q_proj.base_layer.weight          the frozen base (checkpoint name: ...q_proj.weight)
    ...q_proj.lora_A.default.weight      (rank, in)   trained
    ...q_proj.lora_B.default.weight      (out, rank)  trained, zero at the start

``modules_to_save`` (peft's rule: every module whose name ends with one of them)
are trained whole under their own names (peft would keep a
frozen copy of each beside a trained one: memory for nothing here; the export
writes them as peft saves them).

Adapter initialisation is peft's rule (A kaiming-uniform with a = sqrt(5), i.e.
uniform in +-1/sqrt(in); B zeros) drawn from a generator seeded by the run seed
and the adapter's name, after ``to_empty``: each rank copies its shard of the
same full tensor, so every mesh starts from the same adapters.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .versions import check_library

__all__ = [
    "ADAPTER",
    "LORA_EXTRA_MSG",
    "LoraSpec",
    "add_lora",
    "adapter_names",
    "base_name",
    "check_lora_targets",
    "init_lora_weights",
    "is_adapter_param",
    "lora_delta",
    "store_frozen_as",
]

ADAPTER = "default"  # peft's adapter name: one adapter per model here
LORA_EXTRA_MSG = "LoRA needs the peft package: pip install 'ulysses-dtensor[lora]'"

# What wrappers put into parameter names (compile, activation checkpointing, peft's base layer).
_WRAPPERS = re.compile(r"(_orig_mod\.|_checkpoint_wrapped_module\.|base_layer\.)")
_ADAPTER_PARAM = re.compile(rf"\.lora_[AB]\.{ADAPTER}\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """The adapters: ``rank`` r, ``alpha`` (scaling alpha / r), ``dropout`` on the adapter
    input, the Linear modules they go on (``target_modules``: module names or name suffixes,
    peft's rule) and the modules trained whole beside them (``modules_to_save``)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = field(default_factory=tuple)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def base_name(name: str) -> str:
    """A parameter's name as the base checkpoint stores it (wrappers' prefixes removed)."""
    return _WRAPPERS.sub("", name)


def is_adapter_param(name: str) -> bool:
    """``name`` is a LoRA A or B matrix (which no base checkpoint holds)."""
    return bool(_ADAPTER_PARAM.search(name))


def _matches(name: str, target: str) -> bool:
    """peft's rule for target_modules: the name, or its last dotted parts."""
    return name == target or name.endswith("." + target)


def _saved(name: str, target: str) -> bool:
    """peft's rule for modules_to_save: any suffix of the name ("norm" is every *norm)."""
    return name.endswith(target)


def _describe(names) -> str:
    names = sorted(set(names))
    return ", ".join(names[:12]) + (f" ... ({len(names)} in all)" if len(names) > 12 else "") or "none"


def check_lora_targets(model: nn.Module, spec: LoraSpec, *, head: nn.Module | None = None) -> list[str]:
    """The modules ``spec`` adapts, or ValueError naming the offending value and what would be
    valid: a target or a module to save that matches nothing, a target that is not a Linear
    layer, the output head as a target (its loss is computed from its weight, in chunks),
    a tied embedding / head among ``modules_to_save``."""
    name = type(model).__name__
    if spec.rank < 1:
        raise ValueError(f"lora.rank={spec.rank} must be >= 1")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"lora.dropout={spec.dropout} must be in [0, 1)")
    modules = {base_name(n): m for n, m in model.named_modules() if n}
    linear = {n.rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear) and m is not head}
    targets = []
    for t in spec.target_modules:
        hit = [n for n in modules if _matches(n, t)]
        if not hit:
            raise ValueError(f"lora.target_modules: {t!r} matches no module of {name}; its Linear layers: "
                             f"{_describe(linear)}")
        for n in hit:
            if modules[n] is head:
                raise ValueError(
                    f"lora.target_modules: {t!r} is {name}'s output head ({n}), whose loss the trainer computes "
                    f"from its weight (sequence chunks, logit transforms): an adapter there would be skipped; "
                    f"train it whole with lora.modules_to_save, or leave it out")
            if not isinstance(modules[n], nn.Linear):
                raise ValueError(f"lora.target_modules: {t!r} matches {n}, a {type(modules[n]).__name__}; LoRA "
                                 f"adapters go on Linear layers here ({_describe(linear)})")
        targets += hit
    tied, seen = set(), set()  # parameters held under two names (tied embeddings)
    for _, p in model.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(id(p))
    for t in spec.modules_to_save:
        hit = [n for n in modules if _saved(n, t)]
        if not hit:
            raise ValueError(f"lora.modules_to_save: {t!r} matches no module of {name}")
        for n in hit:
            if any(id(p) in tied for p in modules[n].parameters()):
                raise ValueError(
                    f"lora.modules_to_save: {t!r} ({n}) shares its weight with another module of {name} (tied "
                    f"embeddings): trained under one name and saved under the other, the export would untie "
                    f"them; leave it out")
            if any(x == n or x.startswith(n + ".") or n.startswith(x + ".") for x in targets):
                raise ValueError(f"lora.modules_to_save: {t!r} ({n}) also holds a LoRA target; a module is "
                                 f"adapted or trained whole, not both")
    return sorted(set(targets))


def add_lora(model: nn.Module, spec: LoraSpec, *, head: nn.Module | None = None) -> list[str]:
    """Put peft's LoRA layers on ``spec.target_modules`` of ``model`` in place (on ``meta``
    or real tensors, before parallelizing), freeze every other parameter, train
    ``modules_to_save`` whole; return the adapted modules' names. ``head``: the output
    head, refused as a target. ValueError as :func:`check_lora_targets`."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ImportError(LORA_EXTRA_MSG) from None
    check_library("peft", user="LoRA (ulysses_dtensor.integrations.lora)")
    targets = check_lora_targets(model, spec, head=head)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
                        target_modules=list(spec.target_modules), init_lora_weights=True)
    from torch.utils._python_dispatch import _disable_current_modes

    # The adapters are made where the base is: on meta for a model about to be parallelized
    # (also under the memory planner's fake-tensor mode, which must not see them made).
    device = next(model.parameters()).device
    with _disable_current_modes(), torch.device(device):
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for n, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(n))
    for n, m in model.named_modules():
        if any(_saved(base_name(n), t) for t in spec.modules_to_save):
            m.requires_grad_(True)
    return targets


def store_frozen_as(model: nn.Module, dtype: torch.dtype) -> int:
    """Hold every frozen parameter in ``dtype`` (in place, before parallelizing; returns how
    many): a weight that is never updated needs no float32 master copy, so under bf16 compute
    the base takes half the memory (Qwen3-8B: 16 instead of 32 GB over the ranks). FSDP2 asks
    a uniform dtype of a group's trained parameters only (the adapters stay float32), and
    gathers every parameter in the compute dtype anyway. Tied weights stay one parameter."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.requires_grad or p.dtype == dtype or not p.is_floating_point():
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module._parameters[name] = done[id(p)]
    return len(done)


def adapter_names(model: nn.Module) -> list[str]:
    """Names (wrappers removed) of the LoRA matrices of ``model``."""
    return [base_name(n) for n, _ in model.named_parameters() if is_adapter_param(n)]


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/lora/{name}".encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> None:
    """peft's initialisation of every LoRA matrix, the same full values on any mesh: A uniform
    in +-1/sqrt(in) (``kaiming_uniform_(a=sqrt(5))``) from a generator seeded by ``seed`` and
    the matrix's name, B zeros. Each rank copies its shard (DTensor parameters) of the full
    (rank x in) matrix, which is small."""
    from torch.distributed.tensor import DTensor

    for n, p in model.named_parameters():
        if not is_adapter_param(n):
            continue
        name = base_name(n)
        if ".lora_B." in name:
            full = torch.zeros(p.shape)
        else:
            g = torch.Generator().manual_seed(_seed(seed, name))
            full = torch.empty(p.shape)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
        if isinstance(p, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
            full = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            local = p.to_local()
        else:
            local = p
        local.copy_(full.to(local.dtype))


def lora_delta(a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """What merging adds to the base weight: ``scaling * B @ A`` in float32, ``(out, in)``."""
    return scaling * (b.float() @ a.float())
