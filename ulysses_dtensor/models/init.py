"""Mesh-independent parameter initialisation.

Each parameter is drawn in fixed blocks of rows, each from its own generator
seeded by (seed, name, block), so a rank draws only the blocks its shard
overlaps and the full weights are the same whatever the mesh (for one device
type). Nothing is materialised beyond one block per parameter at a time.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor, nn

__all__ = ["init_param"]

_BLOCK_NUMEL = 1 << 22  # elements drawn per generator (16 MiB of float32)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _local_region(param: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, local shape, global offset) of a plain or DTensor parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return param.to_local(), tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


def init_param(param: Tensor, name: str, kind: str, std: float, seed: int) -> None:
    local, shape, offset = _local_region(param)
    if local.device.type == "meta":
        raise RuntimeError(
            f"init_weights: parameter {name} is on the meta device; call "
            "model.to_empty(device=...) first"
        )
    if kind in ("ones", "zeros"):
        local.fill_(1.0 if kind == "ones" else 0.0)
        return
    if local.numel() == 0:
        return
    full_shape = tuple(param.shape)
    row_numel = math.prod(full_shape[1:])
    rows_per_block = max(1, _BLOCK_NUMEL // max(row_numel, 1))
    start, stop = offset[0], offset[0] + shape[0]
    gen = torch.Generator(device=local.device)
    pieces = []
    for block in range(start // rows_per_block, (stop - 1) // rows_per_block + 1):
        b0 = block * rows_per_block
        b1 = min(b0 + rows_per_block, full_shape[0])
        gen.manual_seed(_block_seed(seed, name, block))
        buf = torch.empty((b1 - b0, *full_shape[1:]), dtype=torch.float32, device=local.device)
        if kind == "normal":
            buf.normal_(0.0, std, generator=gen)
        elif kind == "trunc_normal":
            nn.init.trunc_normal_(buf, 0.0, std, -3 * std, 3 * std, generator=gen)
        else:
            raise ValueError(f"unknown init kind {kind!r}")
        pieces.append(buf[max(start, b0) - b0 : min(stop, b1) - b0])
    rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    # Shards along other dims (not FSDP's default, but any placement works).
    for d in range(1, len(full_shape)):
        rows = rows.narrow(d, offset[d], shape[d])
    local.copy_(rows)
