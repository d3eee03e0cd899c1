"""Ulysses sequence parallelism as a composable DTensor / DeviceMesh module.

Public names load lazily so that ``import ulysses_dtensor`` stays cheap and
optional backends (flash-attn) are imported only when used.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "ParallelDims": "mesh",
    "ParallelMesh": "mesh",
    "UlyssesAttention": "ulysses",
    "seq_to_heads": "ulysses",
    "heads_to_seq": "ulysses",
    "RingAttention": "ring",
    "ring_attention": "ring",
    "shard_batch": "batch",
    "sp_cross_entropy": "loss",
    "count_valid_tokens": "loss",
    "global_loss": "loss",
    "local_attention": "attention",
    "LocalAttention": "attention",
    "CollectiveCounter": "comm_stats",
    "parallelize_llama": "parallelize",
    "clip_grad_norm_": "parallelize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'ulysses_dtensor' has no attribute {name!r}")
