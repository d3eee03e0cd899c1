"""The run banner's line of memory switches: what runs, without reading the config.

Every switch is named by its config key and said on or off; a count the model picks from
the shapes (``memory.mlp_tiles = 0``, ``memory.loss_chunks = 0``) is given as the model
will compute it at each stage's length on one rank (the same rules,
:func:`~ulysses_dtensor.memory.tiling.auto_num_tiles` and
:func:`~ulysses_dtensor.memory.tiling.auto_loss_chunks`); last, the CUDA allocator
setting in effect (:mod:`ulysses_dtensor.runtime.allocator`).
"""

from __future__ import annotations

from ..memory.tiling import auto_loss_chunks, auto_num_tiles
from ..runtime.allocator import allocator_banner
from .config import JobConfig

__all__ = ["memory_banner"]


def _per_stage(cfg: JobConfig, schedule, dims, count) -> str:
    """``count(rows, local_seq)`` at each stage, as "N at seq_len L" (one figure when all agree):
    ``rows`` per forward on a rank (a micro-batch, or the rank's share of the batch),
    ``local_seq`` the rank's slice of the sequence."""
    figures = []
    for stage in cfg.stages():
        rows = cfg.training.micro_batch_size or max(1, schedule.batch_size(stage.start_step) // dims.dp)
        figures.append((count(rows, max(1, stage.seq_len // dims.sp)), stage.seq_len))
    if len({n for n, _ in figures}) == 1:
        return f"{figures[0][0]}"
    return ", ".join(f"{n} at seq_len {length}" for n, length in figures)


def memory_banner(cfg: JobConfig, shape, schedule, dims, device_type: str, *, transformers: bool) -> str:
    """One line: tiled MLP (tiles), tiled loss (chunks), offloaded activations and parameters,
    save_attention, and the allocator. ``shape``: the model's sizes (``LlamaArgs`` or
    ``CausalLMShape``); ``dims``: the run's ``ParallelDims``; ``transformers``: the
    transformers implementation (its MLP tiles count the rows' tokens together; this
    package's Llama tiles each row)."""
    mem, ac = cfg.memory, cfg.activation_checkpoint
    parts = []
    if mem.tiled_mlp:
        if mem.mlp_tiles:
            parts.append(f"tiled_mlp on ({mem.mlp_tiles} tiles)")
        else:
            width = shape.ffn_dim * max(1, getattr(shape, "experts_per_token", 0))  # MoE: each chosen expert's
            tiles = _per_stage(cfg, schedule, dims, lambda rows, seq: auto_num_tiles(
                rows * seq if transformers else seq, width, shape.dim))
            parts.append(f"tiled_mlp on (tiles from the shapes: {tiles})")
    else:
        parts.append("tiled_mlp off")
    if mem.tiled_loss:
        if mem.loss_chunks:
            parts.append(f"tiled_loss on ({mem.loss_chunks} chunks)")
        else:
            chunks = _per_stage(cfg, schedule, dims, lambda rows, seq: auto_loss_chunks(rows * seq, shape.vocab_size))
            parts.append(f"tiled_loss on (chunks from the shapes: {chunks})")
    else:
        parts.append("tiled_loss off")
    parts.append("offload_activations " + ("on (layer inputs in pinned host memory)" if mem.offload_activations
                                           else "off"))
    parts.append("offload_params " + ("on (parameters, gradients and AdamW state in host memory)"
                                      if mem.offload_params else "off"))
    parts.append("save_attention " + ("on" if ac.save_attention else "off"))
    return f"memory: {', '.join(parts)}; {allocator_banner(device_type)}"
