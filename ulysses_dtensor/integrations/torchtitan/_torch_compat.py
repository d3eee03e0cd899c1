"""The one torch API torchtitan 0.3.0's trainer calls that the supported torch releases lack.

``Trainer.train`` shortens every process group's timeout after the first step
with ``torch.distributed.set_timeout``, which torch added after 2.13 (pytorch
PR #187387 made the private ``_set_pg_timeout`` public under that name). On
torch 2.11-2.13 the trainer would stop with an AttributeError after step 1,
so the Ulysses trainer provides the name, bound to torch's own function,
where it is missing. Nothing else is touched.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout


def ensure_set_timeout() -> bool:
    """Provide ``torch.distributed.set_timeout`` if absent; return whether it was added."""
    if hasattr(dist, "set_timeout"):
        return False
    dist.set_timeout = _set_pg_timeout
    return True
