"""The memory switches of a long-context step, as one object.

Every switch that trades compute or host memory for device memory lives here:
activation checkpointing and what it keeps, sequence tiling of the MLP and the
loss, host offload of the checkpointed layer inputs and of the parameter state,
and attention by chunks of heads. ``parallelize_llama``, ``parallelize_hf_model``,
``UlyssesArguments``, the trainer's ``[memory]`` / ``[activation_checkpoint]``
sections and the memory planner all build or take a :class:`MemoryOptions`,
so a new switch is a field here, its use, and its test -- not a keyword threaded
through every signature. The old keywords (``tiled_mlp=True``, ...) keep working:
:meth:`MemoryOptions.merged` folds them in.

The rules between switches are checked once, when the object is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["AC_MODES", "MemoryOptions", "parse_selective_ac"]

AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class MemoryOptions:
    """What a step keeps on the device, and where the rest goes.

    Attributes:
        ac_mode: activation checkpointing of each block: ``"none"``, ``"full"``
            (every block keeps only its input) or ``"selective"``.
        selective_ac: with ``"selective"``: ``"op"`` (matmul and attention outputs
            saved, the rest recomputed) or an int k (every k-th block fully).
        save_attention: with full AC, keep each block's attention kernel outputs
            (output, log-sum-exp) instead of recomputing them.
        tiled_mlp, mlp_tiles: the MLP (or MoE block) over tiles of the tokens;
            None: the count from the shapes.
        tiled_loss, loss_chunks: logits and loss over chunks of the sequence;
            None: the count from the shapes.
        offload_activations: with full AC, the checkpointed block inputs (and the
            kept attention outputs) in pinned host memory between forward and backward.
        offload_dir: with ``offload_activations``, a directory on a local disk (NVMe)
            the offloaded tensors go to, through a bounded pinned staging area in host
            memory (:mod:`~ulysses_dtensor.memory.disk_offload`); None: host memory only.
        offload_params: parameter shards, gradients and optimizer state in host
            memory (FSDP2 ``CPUOffloadPolicy``; the optimizer steps on the CPU).
        head_chunks: the exchange and attention over chunks of a rank's heads; None:
            from the shapes, 1: none.
    """

    ac_mode: str = "none"
    selective_ac: str | int = "op"
    save_attention: bool = False
    tiled_mlp: bool = False
    mlp_tiles: int | None = None
    tiled_loss: bool = False
    loss_chunks: int | None = None
    offload_activations: bool = False
    offload_dir: str | None = None
    offload_params: bool = False
    head_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.ac_mode not in AC_MODES:
            raise ValueError(f"ac_mode={self.ac_mode!r} must be one of {AC_MODES}")
        if self.ac_mode == "selective":
            parse_selective_ac(self.selective_ac)
        for name in ("mlp_tiles", "loss_chunks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer, or None for automatic")
        h = self.head_chunks
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ValueError(f"head_chunks={h!r} must be a positive integer (1: no chunks) or None")
        if self.offload_activations and self.ac_mode != "full":
            raise ValueError(
                f"offload_activations=True needs ac_mode='full' (it offloads the block inputs that "
                f"full checkpointing keeps), got ac_mode={self.ac_mode!r}"
            )
        if self.offload_dir is not None and not self.offload_activations:
            raise ValueError(
                f"offload_dir={self.offload_dir!r} needs offload_activations=True (the disk tier holds the "
                f"offloaded layer inputs)"
            )
        if self.offload_dir is not None and (not isinstance(self.offload_dir, str) or not self.offload_dir):
            raise ValueError(f"offload_dir={self.offload_dir!r} must be a directory path, or None for host memory only")
        if self.save_attention and self.ac_mode != "full":
            raise ValueError(
                f"save_attention=True needs ac_mode='full' (it keeps the attention outputs that full checkpointing "
                f"would recompute; ac_mode='selective' with selective_ac='op' keeps them already), got "
                f"ac_mode={self.ac_mode!r}"
            )

    @property
    def every_k(self) -> int | None:
        """Selective AC's block interval (None: op-level, or not selective)."""
        return parse_selective_ac(self.selective_ac) if self.ac_mode == "selective" else None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def merged(cls, memory: MemoryOptions | None, switches: dict, where: str) -> MemoryOptions:
        """``memory`` (None: the defaults) with the keyword switches of ``where`` folded
        in; a keyword that names no switch is refused as Python refuses an unknown
        keyword, naming the valid ones."""
        unknown = sorted(set(switches) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"{where}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"memory switches: {', '.join(cls.field_names())}")
        base = memory if memory is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"{where}(memory=...) takes a MemoryOptions, got {type(base).__name__}")
        return dataclasses.replace(base, **switches) if switches else base

    def describe(self) -> str:
        """The switches that differ from the defaults, for messages and banners."""
        default = MemoryOptions()
        changed = [f"{f}={getattr(self, f)!r}" for f in self.field_names() if getattr(self, f) != getattr(default, f)]
        return ", ".join(changed) or "defaults (nothing kept off the device)"


def parse_selective_ac(value) -> int | None:
    """``"op"`` -> None; a positive int (or its string) -> that int; else ValueError."""
    if value == "op":
        return None
    try:
        k = int(value)
    except (TypeError, ValueError):
        k = 0
    if isinstance(value, bool) or k < 1:
        raise ValueError(
            f"selective_ac={value!r} must be 'op' or a positive integer k (checkpoint every "
            "k-th block)"
        )
    return k
