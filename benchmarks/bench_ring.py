"""USP attention (Ulysses x ring), forward + backward: overlap and bytes.

    python benchmarks/bench_ring.py --ring 2 --ulysses 1 --seq 4096 8192 --heads 8 --kv-heads 8 2
    python benchmarks/bench_ring.py --quick          # smoke run: ring 2, one tiny shape

For every (ring, ulysses) it spawns ``ring * ulysses`` ranks (gloo on CPU, nccl
on CUDA; or runs as the ranks of ``torchrun``) and prints ONE JSON object per
shape on stdout. On identical local q/k/v and output gradient two variants of
the same layer run round-robin in one timing loop:

* ``overlapped``: each ring step's k/v transfer (and, in backward, the dk/dv
  accumulator's) is issued before the current block is attended and waited
  for after it (``RingAttention(overlap=True)``, the default);
* ``serial``: the same transfers, waited for as soon as they are issued;
* ``transfers``: those transfers alone (same sizes, same ring pattern), no compute.

``ratios.overlapped_over_serial`` is the paired ratio (median over iterations
of t_overlapped[i] / t_serial[i], each the slowest rank's time): below 1 is
time the overlap hides; ``hidden_fraction_of_transfers`` is
median(t_serial - t_overlapped) / median(t_transfers). An untimed pass counts the collectives and bytes each
rank sent (``CollectiveCounter``) and asserts them equal to
``usp_bytes_per_rank``; both variants' outputs and gradients must agree, and
with ``--check`` equal unsharded attention.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402

from ulysses_dtensor.attention import LocalAttention, local_attention  # noqa: E402
from ulysses_dtensor.parallel.batch import shard_batch  # noqa: E402
from ulysses_dtensor.parallel.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.parallel.mesh import ParallelDims  # noqa: E402
from ulysses_dtensor.parallel.ring import (  # noqa: E402
    RingAttention,
    layout_indices,
    ring_bytes_per_rank,
    usp_bytes_per_rank,
)
from ulysses_dtensor.parallel.ulysses import UlyssesAttention, kv_replication  # noqa: E402
from ulysses_dtensor.runtime.process_group import finish_together  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK = {"ring": [2], "ulysses": [1], "seq": [256], "heads": [4], "kv_heads": [2], "head_dim": [16],
         "warmup": 1, "iters": 3}
VARIANTS = {"overlapped": True, "serial": False}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ring", nargs="+", type=int, default=[2])
    p.add_argument("--ulysses", nargs="+", type=int, default=[1])
    p.add_argument("--seq", nargs="+", type=int, default=[4096], help="GLOBAL sequence lengths")
    p.add_argument("--heads", nargs="+", type=int, default=[8])
    p.add_argument("--kv-heads", nargs="+", type=int, default=[8])
    p.add_argument("--head-dim", nargs="+", type=int, default=[64])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--documents", type=int, default=0,
                   help="packed documents per row (0: one causal document per row)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    p.add_argument("--check", action="store_true", help="also compare with unsharded attention")
    p.add_argument("--quick", action="store_true", help="smoke run: ring 2, one tiny shape")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
        a.check = True
    C.resolve_device_dtype(a)
    return a


def shapes(a) -> list[dict]:
    return [
        {"seq": s, "heads": h, "kv_heads": kv, "head_dim": d}
        for s in a.seq for h in a.heads for kv in a.kv_heads for d in a.head_dim if h % kv == 0
    ]


def _documents(batch: int, seq: int, n: int) -> torch.Tensor | None:
    """Position ids of n equal documents per row (the last one takes the rest)."""
    if n <= 1:
        return None
    size = seq // n
    row = torch.cat([torch.arange(size)] * (n - 1) + [torch.arange(seq - size * (n - 1))])
    return row.expand(batch, seq)


def run_shape(a, shape, pmesh, device) -> dict:
    ring, ulysses = pmesh.dims.ring, pmesh.dims.ulysses
    sp = ring * ulysses
    seq, heads, kv, hd = shape["seq"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    dtype = DTYPES[a.dtype]
    g = torch.Generator().manual_seed(a.seed)
    full = [torch.randn(a.batch, seq, h, hd, generator=g).to(device, dtype) for h in (heads, kv, kv, heads)]
    pos = _documents(a.batch, seq, a.documents)
    batch = {"input_ids": torch.zeros(a.batch, seq, dtype=torch.long)}
    if pos is not None:
        batch["position_ids"] = pos
    docs = shard_batch(batch, pmesh.sp)["document_ids"]
    docs = None if docs is None else docs.to(device)
    local_len = seq // sp
    mine = layout_indices(seq, ring)[pmesh.sp.get_local_rank() * local_len:][:local_len].to(device)

    layers = {}
    for name, overlap in VARIANTS.items():
        attn = parallelize_module(LocalAttention("sdpa"), pmesh.ring, RingAttention(overlap=overlap)) \
            if ring > 1 else LocalAttention("sdpa")
        layers[name] = parallelize_module(attn, pmesh.ulysses, UlyssesAttention())

    inputs = {name: [t[:, mine].clone().requires_grad_(i < 3) for i, t in enumerate(full)] for name in VARIANTS}

    def step(name):
        q, k, v, grad = inputs[name]
        for t in (q, k, v):
            t.grad = None
        out = layers[name](q, k, v, document_ids=docs)
        out.backward(grad)
        return out

    # Untimed pass: bytes, counts, agreement.
    results = {}
    counts = {}
    for name in VARIANTS:
        with CollectiveCounter() as counter:
            out = step(name)
        results[name] = [out.detach()] + [t.grad.clone() for t in inputs[name][:3]]
        counts[name] = {"collectives": counter.counts(), "sent_bytes": counter.sent_bytes()}
    elt = torch.tensor([], dtype=dtype).element_size()
    expected = usp_bytes_per_rank(a.batch, seq, heads, kv, hd, ring, ulysses, elt)
    for name, c in counts.items():
        assert c["sent_bytes"] == expected, (name, c, expected)
    agree = max((x - y).abs().max().item() for x, y in zip(results["overlapped"], results["serial"]))
    rec_check = None
    if a.check:
        ref_in = [t.detach().clone().requires_grad_() for t in full[:3]]
        ref_docs = None if pos is None else shard_batch(batch)["document_ids"].to(device)
        ref = local_attention(*ref_in, backend="sdpa", document_ids=ref_docs)
        ref.backward(full[3])
        want = [ref.detach()[:, mine]] + [t.grad[:, mine] for t in ref_in]
        rec_check = max((x - y).abs().max().item() for x, y in zip(results["overlapped"], want))

    fns = {name: (lambda n=name: step(n)) for name in VARIANTS}
    if ring > 1:
        fns["transfers"] = _transfers(pmesh.ring, inputs["serial"][1], ulysses, kv, heads)
    barrier = (lambda: torch.distributed.barrier()) if device.type == "cpu" else None
    times = C.timed_interleaved(fns, warmup=a.warmup, iters=a.iters, device=device, barrier=barrier)
    times = C.max_over_ranks(times, device)
    kv_local = kv * kv_replication(heads, kv, ulysses) // ulysses
    return {
        "bench": "ring_attention",
        **C.env_info(device),
        "config": {"ring": ring, "ulysses": ulysses, "batch": a.batch, **shape, "documents": a.documents,
                   "dtype": a.dtype, "threads_per_rank": torch.get_num_threads()},
        "variants": {name: C.summarize(t) for name, t in times.items()},
        "ratios": {"overlapped_over_serial": C.paired_ratio(times["overlapped"], times["serial"])},
        # The share of the transfer time the overlap hides: (serial - overlapped) / transfers.
        "hidden_fraction_of_transfers": _hidden(times) if ring > 1 else None,
        "sent_bytes_per_rank": counts["overlapped"]["sent_bytes"],
        "expected_sent_bytes_per_rank": expected,
        "ring_bytes_per_rank": ring_bytes_per_rank(a.batch, seq, kv_local, hd, ring, elt),
        "collectives": counts["overlapped"]["collectives"],
        "max_abs_diff_overlapped_vs_serial": agree,
        "max_abs_diff_vs_unsharded": rec_check,
    }


def _transfers(mesh, k_local, ulysses, kv, heads):
    """The ring's own transfers of one forward + backward, nothing else (sizes as the layer's)."""
    from ulysses_dtensor.parallel.ring import _send_to_next, _wait

    ring, rank = mesh.size(), mesh.get_local_rank()
    b, s_local, _, d = k_local.shape
    kv_local = kv * kv_replication(heads, kv, ulysses) // ulysses
    n = 2 * b * s_local * ulysses * kv_local * d  # k and v of one block
    kv_buf = k_local.new_empty(n)
    acc = torch.empty(n, dtype=torch.float32, device=k_local.device)
    group = mesh.get_group()

    def run():
        for _ in range(2 * (ring - 1)):  # k/v blocks: forward, and again in backward
            _wait(_send_to_next(kv_buf, group, rank, ring))
        for _ in range(ring):  # fp32 dk/dv accumulators
            _wait(_send_to_next(acc, group, rank, ring))

    return run


def _hidden(times) -> float:
    import statistics

    saved = statistics.median(s - o for s, o in zip(times["serial"], times["overlapped"]))
    return round(saved / statistics.median(times["transfers"]), 3)


def worker(rank, world, device, report, a, ring):
    pmesh = ParallelDims(dp_shard=1, sp=world, ring=ring).build_mesh(device.type)
    for shape in shapes(a):
        report(run_shape(a, shape, pmesh, device))


def _spawned_worker(rank, world, device, report, a, ring):
    worker(rank, world, device, report, a, ring)


def main(argv=None) -> int:
    a = parse_args(argv)
    tr = C.torchrun_env()
    if tr is not None:  # one rank of torchrun: sp = the world, ring = --ring[0]
        rank, world, local_rank = tr
        if a.threads:
            torch.set_num_threads(a.threads)
        out = C.stdout_for_records()
        device = C.init_distributed(a.device, rank, world, local_rank, None)
        report = (lambda r: C.emit(r, out)) if rank == 0 else (lambda r: None)
        with finish_together():
            worker(rank, world, device, report, a, a.ring[0])
        return 0
    ok = True
    for ring in a.ring:
        for ulysses in a.ulysses:
            world = ring * ulysses
            threads = a.threads or max(1, C.usable_cores() // world)
            ok &= C.launch_ranks(world, _spawned_worker, (a, ring), device_type=a.device, threads=threads)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
