"""Full activation checkpointing that keeps the attention kernel's outputs (``save_attention``).

Full AC recomputes a whole block in backward, the attention forward included:
at long context that forward is about a fifth of the block's attention time
(forward + recompute + backward). Here the recompute runs everything again
EXCEPT the attention kernel: its output and log-sum-exp (and whatever else the
kernel returns for its backward) are kept from forward. The kernel's inputs
(q, k, v after the Ulysses exchange) are recomputed as before, so the
exchange's all-to-alls still run in the recompute; only the kernel is skipped.
Extra memory per block: the kernel's output, ``(tokens, heads/sp, head_dim)``,
the size of one block input, and one float32 per token and local head.

Mechanism: PyTorch's selective activation checkpointing
(:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`) with a
policy that saves the attention kernels below and recomputes every other op.
It works in eager mode and under ``torch.compile`` (the policy tags the graph,
and the partitioner keeps the tagged outputs), for every kernel that is one op
in the dispatcher: SDPA's flash / memory-efficient / cuDNN / CPU-flash kernels,
torch's ``varlen_attn`` (its custom op ``torch_attn::_varlen_attn``, torch 2.10
to 2.13), the flash-attn package's custom ops, and FlexAttention's higher-order
op (torch routes it to the checkpoint modes). What is NOT one op is recomputed,
as under plain full AC: the ``sdpa`` backend's explicit scores (soft-capping or
sinks), SDPA's math fallback, and FlexAttention compiled on its own and called
from an eager block (compiled code is opaque to a dispatch mode; a compiled
block traces flex as the op). :class:`AttentionKeeping` notices when a forward
kept nothing and warns once, naming these causes.

With host offload (:mod:`.offload`) the kept outputs move to host memory with
the block input: they live in the checkpoint's private storage, which
:func:`take_kept_outputs` empties and :class:`KeptOutputs` refills (its layout
differs between torch versions; both are read here, and tests pin them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "KEPT_ATTENTION_OPS",
    "AttentionKeeping",
    "attention_keeping",
    "KeptOutputs",
    "is_attention_kernel",
    "keep_attention_contexts",
    "op_name",
    "take_kept_outputs",
]

# Forward attention kernels, by qualified op name: matched by name so that
# packages registering their ops late (flash-attn on first use) are covered.
KEPT_ATTENTION_OPS = frozenset({
    # SDPA's kernels (what F.scaled_dot_product_attention dispatches to below autograd).
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_scaled_dot_product_attention_math_for_mps",
    # The kernels under them, called directly (ring attention's pair kernels, varlen).
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "aten::_cudnn_attention_forward",
    # torch.nn.attention.varlen.varlen_attn (torch 2.10 - 2.13).
    "torch_attn::_varlen_attn",
    # The flash-attn package: FlashAttention-2 (>= 2.6) and the Hopper build (FA3).
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
    "flash_attn_3::_flash_attn_forward",
    "flash_attn_3::fwd",
    # FlexAttention (a higher-order op).
    "higher_order::flex_attention",
})


def op_name(func) -> str:
    """``namespace::name`` of an op overload (``.overload`` appended unless it is
    ``default``), ``higher_order::name`` of a higher-order op."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return f"higher_order::{func.name()}"
    name = getattr(func, "name", None)
    return name() if callable(name) else str(func)


def is_attention_kernel(func) -> bool:
    """Whether ``func`` is one of :data:`KEPT_ATTENTION_OPS`."""
    return op_name(func) in KEPT_ATTENTION_OPS


def keep_attention_contexts(on_keep: Callable[[], None] | None = None):
    """torch's selective-checkpoint contexts (forward mode, recompute mode) that save
    the attention kernels' outputs and recompute every other op. ``on_keep`` is
    called once per kernel output kept (in forward, or when torch.compile traces it)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    def policy(ctx, func, *args, **kwargs):
        if is_attention_kernel(func):
            # torch 2.11 and older ask the policy again in the recompute.
            if on_keep is not None and not ctx.is_recompute:
                on_keep()
            return CheckpointPolicy.MUST_SAVE
        # PREFER: as plain full AC tags every op under torch.compile.
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class AttentionKeeping:
    """One model's ``save_attention``: the checkpoint contexts of its blocks, and a
    check that the attention kernels really were kept.

    :attr:`contexts` is the ``context_fn`` of a block's checkpoint. The first
    forward with grad after :meth:`watch` (a forward hook on the model) checks
    that some block kept an attention output; if none did, attention ran as ops
    that cannot be kept and is recomputed, and a warning says why.
    """

    def __init__(self) -> None:
        self.regions = 0  # checkpointed forwards (or traces) run under the policy
        self.kept = 0  # attention kernel outputs kept by them
        self.checked = False
        self.problem: str | None = None  # the warning's text, once a check found nothing kept

        # A plain function, not a bound method: torch.compile takes only functions
        # (or partials of constants) as a checkpoint's context_fn.
        def contexts():
            self.regions += 1
            return keep_attention_contexts(self._count)

        self.contexts = contexts

    def _count(self) -> None:
        self.kept += 1

    def check(self) -> str | None:
        """After a forward: warn (once) if checkpointed blocks ran but kept no attention output."""
        if self.checked or self.regions == 0:
            return None
        self.checked = True
        if self.kept == 0:
            self.problem = (
                f"save_attention: {self.regions} checkpointed block forwards kept no attention kernel output, so "
                "attention is recomputed in backward as under plain full activation checkpointing. It ran as ops "
                "that cannot be kept: the 'sdpa' backend's explicit scores (soft-capping or sinks; 'flex' or "
                "'flash_attn' run them as one kernel), SDPA's math fallback (e.g. float64), or FlexAttention "
                "compiled on its own inside uncompiled blocks (compile the blocks: training.compile=true)"
            )
            warnings.warn(self.problem, stacklevel=2)
        return self.problem

    def watch(self, model: nn.Module) -> None:
        """Run :meth:`check` after the model's forwards (until the first one that checked)."""

        def hook(module, args, output):
            if not self.checked:
                self.check()

        model.register_forward_hook(hook)


def attention_keeping(model: nn.Module, save_attention: bool) -> AttentionKeeping | None:
    """Set ``model.attention_keeping``: an :class:`AttentionKeeping` watching the model's
    forwards with ``save_attention``, else None; return it."""
    keep = AttentionKeeping() if save_attention else None
    if keep is not None:
        keep.watch(model)
    model.attention_keeping = keep
    return keep


# ---------------------------------------------------------------------------
# What the checkpoint keeps, moved out and back (host offload)
# ---------------------------------------------------------------------------


def _entries(storage):
    """(container, key) of every entry of a selective checkpoint's storage.

    torch 2.13 (indexed storage, pytorch#176455): ``{op key: {call index: entry}}``,
    an entry being the op's outputs wrapped in ``_VersionWrapper`` or a marker
    object (recomputed / consumed). torch 2.11 and older: ``{op: [entry, ...]}``,
    the saved calls only, popped in order by the recompute.
    """
    for per_op in storage.values():
        keys = list(per_op.keys()) if isinstance(per_op, dict) else range(len(per_op))
        for key in keys:
            yield per_op, key


def _wrapped(leaf) -> bool:
    # torch's _VersionWrapper: the cached tensor in .val, its version counter in .version.
    return hasattr(leaf, "val") and hasattr(leaf, "version") and isinstance(leaf.val, Tensor)


class KeptOutputs:
    """Tensors taken out of a selective checkpoint's storage, and where they go back.

    :meth:`hand_over` gives them away (to the host copy); :meth:`put_back` puts
    tensors of the same shapes (the copies brought back) in their places before
    the recompute reads them.
    """

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.entries = 0  # kernel calls whose outputs were taken
        self._places: list[tuple] = []  # (container, key, spec, leaves, [(leaf index, wrapped)])

    def hand_over(self) -> list[Tensor]:
        """The taken tensors; this object keeps no reference to them."""
        tensors, self.tensors = self.tensors, []
        return tensors

    def put_back(self, tensors: list[Tensor]) -> None:
        expected = sum(len(slots) for *_, slots in self._places)
        if len(tensors) != expected:
            raise RuntimeError(f"{len(tensors)} tensors for {expected} places in the checkpoint's storage")
        it = iter(tensors)
        for container, key, spec, leaves, slots in self._places:
            for i, wrapped in slots:
                t = next(it)
                if wrapped:
                    leaves[i].val = t
                    leaves[i].version = t._version  # a new tensor: its own version counter
                else:
                    leaves[i] = t
            container[key] = tree_unflatten(leaves, spec)
        self._places = []


def take_kept_outputs(storage) -> KeptOutputs:
    """Take every tensor out of a selective checkpoint's ``storage`` (its forward mode's
    ``.storage``); the storage then holds no reference to them."""
    out = KeptOutputs()
    for container, key in _entries(storage):
        leaves, spec = tree_flatten(container[key])
        slots = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                out.tensors.append(leaf)
                leaves[i] = None
                slots.append((i, False))
            elif _wrapped(leaf):
                out.tensors.append(leaf.val)
                leaf.val = None
                slots.append((i, True))
        if slots:
            container[key] = tree_unflatten(leaves, spec)
            out._places.append((container, key, spec, leaves, slots))
            out.entries += 1
    return out
