"""The trainer's ``[activation_checkpoint]`` and ``[memory]`` sections as the library's
:class:`~ulysses_dtensor.memory.options.MemoryOptions`: what the trainer, the transformers
path and the memory planner hand to ``parallelize_llama`` / ``parallelize_hf_model``."""

from __future__ import annotations

from ..memory.options import MemoryOptions

__all__ = ["memory_options"]


def memory_options(cfg) -> MemoryOptions:
    """The :class:`~ulysses_dtensor.memory.options.MemoryOptions` of ``[activation_checkpoint]``
    and ``[memory]`` (0 in a count: from the shapes)."""
    ac, mem = cfg.activation_checkpoint, cfg.memory
    return MemoryOptions(
        ac_mode=ac.mode,
        selective_ac=ac.selective if ac.selective == "op" else int(ac.selective),
        save_attention=ac.save_attention,
        tiled_mlp=mem.tiled_mlp,
        mlp_tiles=mem.mlp_tiles or None,
        tiled_loss=mem.tiled_loss,
        loss_chunks=mem.loss_chunks or None,
        offload_activations=mem.offload_activations,
        offload_dir=mem.offload_dir or None,
        offload_params=mem.offload_params,
        head_chunks=mem.head_chunks or None,
    )
