"""Ulysses sequence parallelism as a composable DTensor / DeviceMesh module.

Public names load lazily so that ``import ulysses_dtensor`` stays cheap and
optional backends (flash-attn) are imported only when used.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "ParallelDims": "parallel.mesh",
    "ParallelMesh": "parallel.mesh",
    "UlyssesAttention": "parallel.ulysses",
    "seq_to_heads": "parallel.ulysses",
    "heads_to_seq": "parallel.ulysses",
    "RingAttention": "parallel.ring",
    "ring_attention": "parallel.ring",
    "shard_batch": "parallel.batch",
    "sp_cross_entropy": "parallel.loss",
    "count_valid_tokens": "parallel.loss",
    "global_loss": "parallel.loss",
    "local_attention": "attention",
    "LocalAttention": "attention",
    "CollectiveCounter": "parallel.comm_stats",
    "parallelize_llama": "models.llama_parallelize",
    "clip_grad_norm_": "models.llama_parallelize",
    "MemoryOptions": "memory.options",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'ulysses_dtensor' has no attribute {name!r}")
