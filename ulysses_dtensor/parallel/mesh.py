"""Parallel degrees and the device mesh ``(dp_replicate, dp_shard, sp)``.

The ``sp`` ranks of one group hold the same sample and the same parameters, so
parameters are sharded by FSDP2 over the flattened ``dp_shard x sp`` mesh and
replicated over ``dp_replicate``. Data is loaded per ``dp_replicate x dp_shard``
rank, and the loss (a token count) is reduced over every rank.

With ring attention (``ring > 1``, USP) the sp dim is split in two,
``sp = ring x ulysses``, and the mesh is 4-D ``(dp_replicate, dp_shard, ring,
ulysses)``: ulysses innermost, so a Ulysses group is consecutive ranks (the GPUs
of one node) and the ring runs across groups. ``sp`` is then the flattened
``ring x ulysses`` view; everything that used the sp dim uses it unchanged.

With tensor parallelism (``tp > 1``) a ``tp`` dim comes last, innermost
(consecutive ranks: NVLink): the tp ranks of a group hold the same tokens and
shard the weights (heads and MLP width). Parameters are TP-sharded over ``tp``
and FSDP-sharded over ``dp_shard x sp`` as before; tokens are counted over
every dim but ``tp`` (the tp ranks hold the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "sp")
USP_MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "ring", "ulysses")
TP_DIM_NAME = "tp"  # last and innermost when tp > 1
# Set on the flattened sp mesh of a USP ParallelMesh: shard_batch and the model
# read the ring degree (and so the sequence layout) from the mesh they are given.
_RING_ATTR = "_ulysses_dtensor_ring"


@dataclass
class ParallelDims:
    """Degrees of data replication, data sharding, sequence and tensor parallelism.

    ``dp_shard=-1`` takes whatever the world size leaves after ``dp_replicate``,
    ``sp`` and ``tp``. ``world_size`` defaults to the initialised process group's.
    ``ring`` splits sp into ``ring x ulysses`` (ring attention across the
    Ulysses groups); ``ring=1`` is plain Ulysses. ``tp`` shards the weights over
    the innermost ranks (PyTorch's ``ColwiseParallel`` / ``RowwiseParallel``).
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    world_size: int | None = None
    ring: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.world_size is None:
            if not dist.is_initialized():
                raise ValueError(
                    "ParallelDims needs world_size= when no process group is initialised"
                )
            self.world_size = dist.get_world_size()
        self._validate()

    def _validate(self) -> None:
        for name in ("dp_replicate", "sp", "ring", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallelism.{name}={value!r} must be an integer >= 1")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(
                f"parallelism.dp_shard={self.dp_shard!r} must be an integer >= 1, "
                "or -1 for what the world size leaves"
            )
        if self.sp % self.ring:
            raise ValueError(
                f"parallelism.ring={self.ring} must divide parallelism.sp={self.sp} "
                f"(sp = ring x ulysses); valid ring for sp={self.sp}: {divisors(self.sp)}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        names = "dp_replicate*sp" + ("*tp" if self.tp > 1 else "")
        values = f"{self.dp_replicate}*{self.sp}" + (f"*{self.tp}" if self.tp > 1 else "")
        if self.dp_shard == -1:
            rest = self.dp_replicate * self.sp * self.tp
            if self.world_size % rest:
                raise ValueError(
                    f"world_size={self.world_size} is not divisible by {names}={values}={rest}, so "
                    f"dp_shard=-1 cannot be resolved; use {names} among the divisors of "
                    f"{self.world_size}: {divisors(self.world_size)}"
                )
            self.dp_shard = self.world_size // rest
        product = self.dp_replicate * self.dp_shard * self.sp * self.tp
        if product != self.world_size:
            what = "dp_replicate*dp_shard*sp" + ("*tp" if self.tp > 1 else "")
            got = f"{self.dp_replicate}*{self.dp_shard}*{self.sp}" + (f"*{self.tp}" if self.tp > 1 else "")
            raise ValueError(
                f"{what} = {got} = {product} does not match world_size={self.world_size}; the "
                f"product must equal the world size (set dp_shard=-1 to fill it)"
            )

    # Degrees derived from the three named ones.
    @property
    def dp(self) -> int:
        """Number of distinct data streams (samples read in parallel)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Size of the mesh that shards parameters (dp_shard x sp)."""
        return self.dp_shard * self.sp

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1

    @property
    def ulysses(self) -> int:
        """The all-to-all degree inside sp (sp / ring)."""
        return self.sp // self.ring

    def build_mesh(self, device_type: str) -> "ParallelMesh":
        """Build the mesh (size-1 dims kept) and its flattened sub-meshes.

        3-D ``(dp_replicate, dp_shard, sp)`` when ``ring == 1``, else 4-D
        ``(dp_replicate, dp_shard, ring, ulysses)``; with ``tp > 1`` a last
        ``tp`` dim.
        """
        if self.ring == 1:
            shape, names = (self.dp_replicate, self.dp_shard, self.sp), MESH_DIM_NAMES
        else:
            shape = (self.dp_replicate, self.dp_shard, self.ring, self.ulysses)
            names = USP_MESH_DIM_NAMES
        if self.tp > 1:
            shape, names = (*shape, self.tp), (*names, TP_DIM_NAME)
        return ParallelMesh(self, init_device_mesh(device_type, shape, mesh_dim_names=names))


class ParallelMesh:
    """The mesh plus the flattened views the rest of the system uses.

    Every view is built here, up front: flattening creates process groups,
    which is collective, so building one lazily on a code path that only some
    ranks take (rank-0 logging, say) would hang the job.

    ``sp`` is the whole sequence-parallel group; with ``ring > 1`` also
    ``ring`` (ring attention) and ``ulysses`` (the all-to-all), else ``ring``
    is None and ``ulysses`` is ``sp``. ``tp`` is the tensor-parallel group (None
    when ``tp == 1``).
    """

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh):
        self.dims = dims
        self.mesh = mesh
        if dims.ring == 1:
            self.sp: DeviceMesh = mesh["sp"]
            self.ring: DeviceMesh | None = None
            self.ulysses: DeviceMesh = self.sp
            seq_dims: tuple[str, ...] = ("sp",)
        else:
            seq_dims = ("ring", "ulysses")
            self.sp = mesh[seq_dims]._flatten("sp")
            setattr(self.sp, _RING_ATTR, dims.ring)
            self.ring = mesh["ring"]
            self.ulysses = mesh["ulysses"]
        # Parameters are sharded over dp_shard x sp (sp ranks hold the same ones).
        self.fsdp: DeviceMesh = mesh[("dp_shard", *seq_dims)]._flatten("dp_shard_sp")
        # HSDP: replicate over dp_replicate, shard over dp_shard x sp.
        self.hsdp: DeviceMesh = DeviceMesh._concatenate([mesh["dp_replicate"], self.fsdp])
        # Data-loading ranks: each reads its own samples.
        self.dp: DeviceMesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        # Every rank that holds tokens of its own (all but tp), for global token counts and loss sums.
        if dims.tp > 1:
            self.tp: DeviceMesh | None = mesh[TP_DIM_NAME]
            self.loss: DeviceMesh = mesh[("dp_replicate", "dp_shard", *seq_dims)]._flatten("world_but_tp")
        else:
            self.tp = None
            self.loss = mesh._flatten("world")

    def __getitem__(self, name):
        return self.mesh[name]

    @property
    def param_mesh(self) -> DeviceMesh:
        """The mesh for ``fully_shard``: HSDP when data is also replicated."""
        return self.hsdp if self.dims.dp_replicate > 1 else self.fsdp

    @property
    def dp_rank(self) -> int:
        """Which data stream this rank reads (equal on the sp ranks of a group)."""
        return self.dp.get_local_rank()

    @property
    def sp_rank(self) -> int:
        return self.sp.get_local_rank()


def ring_degree(sp_mesh: DeviceMesh | None) -> int:
    """The ring degree of an sp mesh from :class:`ParallelMesh` (1 for any other mesh)."""
    return getattr(sp_mesh, _RING_ATTR, 1) if sp_mesh is not None else 1


def divisors(n: int) -> list[int]:
    """The valid degrees for a dimension of size n (error messages list them)."""
    return [d for d in range(1, n + 1) if n % d == 0]
