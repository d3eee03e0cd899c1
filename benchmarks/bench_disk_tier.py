"""The disk tier's bandwidth as the offloader sees it (issue 54): layer-sized tensors
written to a file in a directory and read back through :class:`DiskStore`, the store
``offload_dir`` uses (pinned staging area, one I/O thread).

Three figures, each over the same bytes:

* ``write_gbps``: until the writes are queued and done (the page cache takes them: what
  the forward waits for);
* ``write_sync_gbps``: until they are on the disk (``fsync``);
* ``read_gbps``: reading them back, last layer first as backward does, with the file's
  cached pages dropped first (from the disk, where the kernel honours the advice).

    python benchmarks/bench_disk_tier.py --dir /local/nvme --gib 8

GPU: device tensors, copies on a side stream. CPU: host tensors (the smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ulysses_dtensor.memory.disk_offload import DiskStore  # noqa: E402
from ulysses_dtensor.memory.offload_dir import free_bytes  # noqa: E402

GB = 1e9


def filesystem(directory: str) -> str:
    """The file system type of ``directory`` (the longest mount point above it in /proc/mounts)."""
    path, best = os.path.realpath(directory), ("", "unknown")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, kind)
    except OSError:
        pass
    return best[1]


def measure(directory: str, total_bytes: int, layer_bytes: int, device: torch.device) -> dict:
    """Write ``total_bytes`` as layers of ``layer_bytes`` into ``directory`` and read them back."""
    layers = max(1, total_bytes // layer_bytes)
    x = torch.randn(layer_bytes // 2, dtype=torch.bfloat16, device=device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    store = DiskStore(directory)
    store.new_step(layer_bytes, layers * layer_bytes)
    t0 = time.perf_counter()
    records = [store.put(x, stream) for _ in range(layers)]
    store.sync(fsync=False)  # the writes done, in the page cache
    written = time.perf_counter() - t0
    store.sync(drop_cache=True)
    synced = time.perf_counter() - t0
    t0 = time.perf_counter()
    for record in reversed(records):
        out, event = store.wait(store.get(record, device, stream))
        if event is not None:
            event.synchronize()
    read = time.perf_counter() - t0
    ok = bool(torch.equal(out, x))
    staging = store.staging_bytes
    store.close()
    n = layers * layer_bytes
    return {
        "bench": "disk_tier", "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "directory": directory, "filesystem": filesystem(directory), "free_bytes": free_bytes(directory),
        "bytes": n, "layers": layers, "layer_bytes": layer_bytes, "staging_bytes": staging,
        "write_s": round(written, 4), "write_sync_s": round(synced, 4), "read_s": round(read, 4),
        "write_gbps": round(n / written / GB, 3), "write_sync_gbps": round(n / synced / GB, 3),
        "read_gbps": round(n / read / GB, 3), "read_back_equal": ok,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the disk to measure (a file there, unlinked)")
    p.add_argument("--gib", type=float, default=8.0, help="bytes to write and read, GiB (default 8)")
    p.add_argument("--layer-mib", type=float, default=512.0, help="one layer's offloaded bytes, MiB (default 512)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", help="also write the record here")
    a = p.parse_args(argv)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    os.makedirs(a.dir, exist_ok=True)
    rec = measure(a.dir, int(a.gib * 2**30), int(a.layer_mib * 2**20), device)
    print(json.dumps(rec), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rec) + "\n")
    return 0 if rec["read_back_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
