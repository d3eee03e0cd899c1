"""The run banner's line of memory switches: what runs, without reading the config.

Every switch is named by its config key and said on or off; a count the model picks from
the shapes (``memory.mlp_tiles = 0``, ``memory.loss_chunks = 0``) is given as the model
will compute it at each stage's length on one rank (the same rules,
:func:`~ulysses_dtensor.memory.tiling.auto_num_tiles` and
:func:`~ulysses_dtensor.memory.tiling.auto_loss_chunks`); with ``memory.offload_dir``, the
staging area's host bytes and the disk bytes per rank (:func:`offload_disk_plan`, which
the check before step 1 uses too); last, the CUDA allocator setting in effect
(:mod:`ulysses_dtensor.runtime.allocator`).
"""

from __future__ import annotations

from ..memory.disk_offload import staging_chunk, staging_size
from ..memory.tiling import auto_loss_chunks, auto_num_tiles
from ..runtime.allocator import allocator_banner
from .config_schema import JobConfig

__all__ = ["memory_banner", "offload_disk_plan"]


def _rows(cfg: JobConfig, schedule, dims, stage) -> int:
    """Rows per forward on a rank: a micro-batch, or the rank's share of the batch."""
    return cfg.training.micro_batch_size or max(1, schedule.batch_size(stage.start_step) // dims.dp)


def offload_disk_plan(cfg: JobConfig, shape, schedule, dims) -> tuple[int, int]:
    """(staging bytes, disk bytes) of one rank with ``memory.offload_dir``, at the stage that
    needs most: the staging area the offloader sizes to two layers' offloaded tensors, in
    chunks cut from the first stage's block input
    (:func:`~ulysses_dtensor.memory.disk_offload.staging_size`), and one forward's offloaded
    tensors: every layer's input (rows x local tokens x dim, in the parameter dtype) and,
    with ``save_attention``, each attention layer's kept kernel output (local tokens x heads
    / tp x v head dim) and its float32 log-sum-exp, exact for Ulysses (head chunks too); ring
    attention keeps one per pair kernel, at most ring of them (measured: 1.6-1.75 x at ring
    2 with packed documents), counted as ring."""
    act = 4 if cfg.training.mixed_precision_param == "float32" else 2
    heads = shape.n_heads // dims.tp
    dv = getattr(shape, "v_head_dim", 0) or shape.head_dim
    windows = getattr(shape, "attention_windows", ()) or ()
    attention_layers = sum(1 for w in windows if w != -1) if windows else shape.n_layers
    keep = cfg.activation_checkpoint.save_attention
    staging = disk = chunk = 0
    for stage in cfg.stages():
        tokens = _rows(cfg, schedule, dims, stage) * max(1, stage.seq_len // dims.sp)
        block = tokens * shape.dim * act
        kept = tokens * heads * (dv * act + 4) * dims.ring if keep and attention_layers else 0
        chunk = chunk or staging_chunk(block)
        staging = max(staging, staging_size(block + kept, chunk))
        disk = max(disk, shape.n_layers * block + attention_layers * kept)
    return staging, disk


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _per_stage(cfg: JobConfig, schedule, dims, count) -> str:
    """``count(rows, local_seq)`` at each stage, as "N at seq_len L" (one figure when all agree):
    ``rows`` per forward on a rank (a micro-batch, or the rank's share of the batch),
    ``local_seq`` the rank's slice of the sequence."""
    figures = []
    for stage in cfg.stages():
        figures.append((count(_rows(cfg, schedule, dims, stage), max(1, stage.seq_len // dims.sp)), stage.seq_len))
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
    if mem.offload_activations and mem.offload_dir:
        staging, disk = offload_disk_plan(cfg, shape, schedule, dims)
        parts.append(f"offload_activations on (layer inputs to memory.offload_dir={mem.offload_dir!r}: "
                     f"{_size(disk)} per rank on disk, through {_size(staging)} of pinned staging in host memory; "
                     f"the files unlinked at once)")
    else:
        parts.append("offload_activations " + ("on (layer inputs in pinned host memory)" if mem.offload_activations
                                               else "off"))
    parts.append("offload_params " + ("on (parameters, gradients and AdamW state in host memory)"
                                      if mem.offload_params else "off"))
    parts.append("save_attention " + ("on" if ac.save_attention else "off"))
    return f"memory: {', '.join(parts)}; {allocator_banner(device_type)}"
