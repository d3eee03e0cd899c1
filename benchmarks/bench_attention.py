"""Ulysses SP attention, forward + backward, per sp degree and shape.

One entry point sweeps sp degrees, sequence lengths, head counts and GQA
ratios and prints ONE JSON object per configuration on stdout::

    python benchmarks/bench_attention.py --sp 1 2 4 --seq 2048 4096 \\
        --heads 8 --kv-heads 8 2 --head-dim 64 --batch 1

For each sp it spawns ``sp`` ranks (gloo on CPU, nccl on CUDA) that run every
shape. Per configuration, on identical local q/k/v and output gradient, the
variants below run round-robin in one timing loop (ratios between them are
the figures to quote; absolute CPU times are noisy):

* ``ours_separate``  ``UlyssesAttention(pack_qkv=False)``: one all-to-all per q, k, v, out
* ``ours_packed``    ``UlyssesAttention(pack_qkv=True)``: q, k, v in one all-to-all
* ``deepspeed``      ``deepspeed.sequence.layer.DistributedAttention`` (when installed)
* ``local``          sp=1 only: ``local_attention`` called directly, no SP layer

All of them wrap the same local attention (``local_attention``, sdpa backend).
An untimed pass per variant counts collectives and bytes (functional ones with
``CollectiveCounter``; DeepSpeed's plain ``torch.distributed`` calls with
``C10dCounter``) and measures peak memory; our byte count is asserted equal to
``exchange_bytes_per_rank`` with no all-gather. The outputs and gradients of
that pass are compared across variants (``agreement``).

``--bench layout`` times, in this process, the rank-local layout work around
the exchange (the reshapes/permutes/copies of our seq<->heads switch, forward
and backward, with the all-to-all replaced by the identity) against the local
attention that runs at the same sp: the SP layer's compute overhead with
communication excluded.

Under ``torchrun --nproc_per_node=N`` the script runs as one of the N ranks
(sp = N) instead of spawning. See benchmarks/README.md for every field.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402

from ulysses_dtensor.attention import local_attention  # noqa: E402
from ulysses_dtensor.parallel import ulysses as U  # noqa: E402
from ulysses_dtensor.parallel.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.runtime.process_group import finish_together  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUICK = {"sp": [1, 2], "seq": [256], "heads": [4], "kv_heads": [1], "head_dim": [16], "warmup": 1, "iters": 3}
OURS = ("ours_separate", "ours_packed")


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", type=int, nargs="+", help="sp degrees (ranks launched per degree); default 1 2 4")
    p.add_argument("--seq", type=int, nargs="+", help="global sequence lengths; default 2048 4096")
    p.add_argument("--heads", type=int, nargs="+", help="query heads; default 8")
    p.add_argument("--kv-heads", type=int, nargs="+", help="key/value heads (GQA/MQA); default 8 2")
    p.add_argument("--head-dim", type=int, nargs="+", help="default 64")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backend", default="sdpa", help="local attention backend (default sdpa)")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--warmup", type=int, help="untimed rounds after the measuring pass; default 1")
    p.add_argument("--iters", type=int, help="timed rounds (median reported); default 5")
    p.add_argument("--threads", type=int, help="torch threads per rank; default max(1, cores // sp)")
    p.add_argument("--deepspeed", choices=["auto", "on", "off"], default="auto",
                   help="compare with DeepSpeed's DistributedAttention (auto: when importable)")
    p.add_argument("--no-local", dest="local", action="store_false", help="skip the direct local_attention variant at sp=1")
    p.add_argument("--check", action="store_true",
                   help="also compare with full-sequence local attention on every rank (costs one unsharded fwd+bwd)")
    p.add_argument("--profile-ops", action="store_true", help="add a per-variant table of copy-like ops (PyTorch profiler)")
    p.add_argument("--bench", nargs="+", choices=["sp", "layout"], default=["sp"],
                   help="sp: the distributed sweep; layout: in-process layout-overhead timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny smoke run: " + str(QUICK))
    a = p.parse_args(argv)
    base = QUICK if a.quick else {"sp": [1, 2, 4], "seq": [2048, 4096], "heads": [8], "kv_heads": [8, 2],
                                   "head_dim": [64], "warmup": 1, "iters": 5}
    for key, value in base.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    C.resolve_device_dtype(a)
    return a


def shapes(a) -> list[dict]:
    return [
        {"batch": b, "seq": s, "heads": h, "kv_heads": kv, "head_dim": d}
        for b, s, h, kv, d in itertools.product(a.batch, a.seq, a.heads, a.kv_heads, a.head_dim)
    ]


def want_deepspeed(a) -> bool:
    if a.deepspeed == "off":
        return False
    # find_spec, not import: importing deepspeed logs to stdout, which stays JSON-only
    if importlib.util.find_spec("deepspeed") is None:
        if a.deepspeed == "on":
            raise SystemExit("--deepspeed on: deepspeed is not importable (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
        return False
    return True


# --------------------------------------------------------------------------- #
# One configuration on one rank
# --------------------------------------------------------------------------- #


class _Inner(torch.nn.Module):
    """The local attention every variant wraps (same kernel, same arguments)."""

    def __init__(self, backend: str, causal: bool):
        super().__init__()
        self.backend, self.causal = backend, causal

    def forward(self, q, k, v, *args, **kwargs):
        return local_attention(q, k, v, backend=self.backend, causal=self.causal)


def _global_inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    b, s, h, kv, d = (shape[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
    make = lambda heads: torch.randn(b, s, heads, d, generator=g).to(dtype)  # noqa: E731
    return make(h), make(kv), make(kv), make(h)


def run_config(a, shape, rank, sp, device, mesh, ds_group, use_ds) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    dtype = DTYPES[a.dtype]
    esize = torch.empty((), dtype=dtype).element_size()
    b, s, h, kv, d = (shape[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
    record = {"bench": "attention", **C.env_info(device), "world_size": sp,
              "threads_per_rank": torch.get_num_threads(),
              "config": {"sp": sp, **shape, "dtype": a.dtype, "backend": a.backend, "causal": a.causal,
                         "warmup": a.warmup, "iters": a.iters}}
    try:
        if s % sp:
            raise ValueError(f"seq={s} is not divisible by sp={sp}")
        repeat = U.kv_replication(h, kv, sp)
    except ValueError as e:
        record["skipped"] = str(e)
        return record
    expected = U.exchange_bytes_per_rank(b, s, h, kv, d, sp, esize)
    record["kv_replication"] = repeat
    record["expected_sent_bytes_per_rank"] = expected

    # identical data on every rank; this rank keeps its sequence slice
    gq, gk, gv, gg = _global_inputs(shape, dtype, a.seed)
    sl = slice(rank * s // sp, (rank + 1) * s // sp)
    q, k, v = (t[:, sl].contiguous().to(device).requires_grad_() for t in (gq, gk, gv))
    grad_out = gg[:, sl].contiguous().to(device)

    fwd = {}
    for name, pack in (("ours_separate", False), ("ours_packed", True)):
        fwd[name] = parallelize_module(_Inner(a.backend, a.causal), mesh, U.UlyssesAttention(pack_qkv=pack))
    ds_prerepeat = 1
    if use_ds:
        from deepspeed.sequence.layer import DistributedAttention

        ds = DistributedAttention(_Inner(a.backend, a.causal), ds_group, scatter_idx=2, gather_idx=1)
        # DeepSpeed needs kv_heads >= sp; below that, repeat kv heads first (as we do inside).
        ds_prerepeat = repeat
        if ds_prerepeat > 1:
            fwd["deepspeed"] = lambda q, k, v: ds(
                q, k.repeat_interleave(ds_prerepeat, dim=2), v.repeat_interleave(ds_prerepeat, dim=2), batch_dim_idx=0
            )
        else:
            fwd["deepspeed"] = lambda q, k, v: ds(q, k, v, batch_dim_idx=0)
    if sp == 1 and a.local:
        inner = _Inner(a.backend, a.causal)
        fwd["local"] = inner

    def step(fn):
        q.grad = k.grad = v.grad = None
        out = fn(q, k, v)
        if isinstance(out, AsyncCollectiveTensor):
            # at sp=1 our output is still a view of the (one-rank) all-to-all's
            # result; a real consumer (o_proj) would wait on it, so do that here
            out.trigger_wait()
        out.backward(grad_out)
        return out

    times = C.timed_interleaved(
        {name: (lambda fn=fn: step(fn)) for name, fn in fwd.items()},
        warmup=a.warmup, iters=a.iters, device=device, barrier=dist.barrier,
    )
    times = C.max_over_ranks(times, device)
    # measuring pass, untimed and after the timed rounds (every variant warm):
    # collectives, bytes, peak memory, outputs
    variants, results, copies = {}, {}, {}
    for name, fn in fwd.items():
        q.grad = k.grad = v.grad = out = None  # freed before, not inside, the measured region
        with CollectiveCounter() as fc, C.C10dCounter() as cc, C.PeakMemory(device) as pm:
            out = step(fn)
        results[name] = [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
        counts = {**fc.counts(), **cc.counts()}
        sent = fc.sent_bytes() + cc.sent_bytes()
        variants[name] = {"peak_mem_bytes": pm.peak_bytes, "sent_bytes_per_rank": sent, "collectives": counts}
        if name in OURS:
            n_a2a = fc.counts().get("all_to_all_single", 0)
            # At sp=1 the style leaves the module alone: no collective at all.
            want = 0 if sp == 1 else 4 if name == "ours_packed" else 8
            ok = sent == expected and n_a2a == want and set(counts) <= {"all_to_all_single"}
            variants[name]["bytes_match"] = ok
            if not ok:
                raise AssertionError(
                    f"{name} sp={sp} {shape}: sent {sent} B in {counts}, expected {expected} B in "
                    f"{want} all_to_all_single and nothing else"
                )
        elif name == "deepspeed":
            variants[name]["bytes_match"] = sent == expected
            variants[name]["kv_prerepeat"] = ds_prerepeat
    q.grad = k.grad = v.grad = out = None
    if a.profile_ops:
        for name, fn in fwd.items():
            copies[name] = C.profile_ops(lambda fn=fn: step(fn), esize)
            q.grad = k.grad = v.grad = None

    # agreement with ours_separate (max |diff| over ranks)
    keys = ("out", "dq", "dk", "dv")
    agreement = {}
    if a.check:
        results["reference"] = _reference(a, gq, gk, gv, gg, sl, device)
    for name, res in results.items():
        if name == "ours_separate":
            continue
        diffs = torch.tensor([(x.float() - y.float()).abs().max().item() for x, y in zip(res, results["ours_separate"])],
                             dtype=torch.float64, device=device)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        agreement[f"{name}_vs_ours_separate"] = dict(zip(keys, diffs.tolist()))
    del results

    for name, t in times.items():
        variants[name] = {**C.summarize(t), **variants[name], "times_ms": [round(x * 1e3, 3) for x in t]}
    record["variants"] = variants
    pairs = [("ours_packed", "ours_separate")]
    pairs += [(o, "deepspeed") for o in OURS if "deepspeed" in times]
    pairs += [(o, "local") for o in OURS if "local" in times]
    record["ratios"] = {f"{x}/{y}": C.ratio_of_medians(times[x], times[y]) for x, y in pairs}
    record["ratios_paired"] = {f"{x}/{y}": C.paired_ratio(times[x], times[y]) for x, y in pairs}
    record["agreement"] = agreement
    if copies:
        record["copies"] = copies
    return record


def _reference(a, gq, gk, gv, gg, sl, device):
    q, k, v = (t.to(device).requires_grad_() for t in (gq, gk, gv))
    out = local_attention(q, k, v, backend=a.backend, causal=a.causal)
    out.backward(gg.to(device))
    return [out.detach()[:, sl], q.grad[:, sl], k.grad[:, sl], v.grad[:, sl]]


def worker(rank, sp, device, report, a, use_ds):
    from ulysses_dtensor.parallel.mesh import ParallelDims

    mesh = ParallelDims(sp=sp, world_size=sp).build_mesh(device.type).sp
    ds_group = None
    if use_ds:
        import deepspeed

        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        ds_group = mesh.get_group()
    for shape in shapes(a):
        report(run_config(a, shape, rank, sp, device, mesh, ds_group, use_ds))


# --------------------------------------------------------------------------- #
# Layout overhead, in process (communication excluded)
# --------------------------------------------------------------------------- #


class _StubMesh:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def layout_records(a) -> list[dict]:
    """Per (sp, shape): rank-local layout work of the exchange vs local attention.

    The all-to-all is replaced by the identity (same shapes in and out), so
    what is timed is exactly the reshapes, permutes and copies one rank does
    around its exchanges, forward and backward, for the separate and packed
    paths; ``attn`` is the local attention fwd+bwd a rank runs at that sp
    (full sequence, heads/sp heads).
    """
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    threads = a.threads or C.usable_cores()
    torch.set_num_threads(threads)
    dtype = DTYPES[a.dtype]
    out = []
    for sp, shape in itertools.product(a.sp, shapes(a)):
        b, s, h, kv, d = (shape[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
        rec = {"bench": "attention_layout", **C.env_info(device), "threads": threads,
               "config": {"sp": sp, **shape, "dtype": a.dtype, "backend": a.backend, "causal": a.causal,
                          "warmup": a.warmup, "iters": a.iters}}
        try:
            repeat = U.kv_replication(h, kv, sp)
            if s % sp:
                raise ValueError(f"seq={s} is not divisible by sp={sp}")
        except ValueError as e:
            rec["skipped"] = str(e)
            out.append(rec)
            continue
        kvx = kv * repeat
        mesh = _StubMesh(sp)
        mk = lambda *shp: torch.randn(*shp, dtype=dtype, device=device)  # noqa: E731
        q, k, v = mk(b, s // sp, h, d).requires_grad_(), mk(b, s // sp, kv, d).requires_grad_(), mk(b, s // sp, kv, d).requires_grad_()
        # what local_attention hands back: output and q/k/v grads (B, S, h, D),
        # contiguous in that order (the layout SDPA's CPU flash kernel and the
        # CUDA kernels allocate; checked on CPU)
        o_src = mk(b, s, h // sp, d).requires_grad_()
        g_out = mk(b, s // sp, h, d)
        g_q, g_k, g_v = (mk(b, s, n // sp, d) for n in (h, kvx, kvx))
        # local attention at this sp
        qa, ka, va = mk(b, s, h // sp, d).requires_grad_(), mk(b, s, kvx // sp, d).requires_grad_(), mk(b, s, kvx // sp, d).requires_grad_()
        ga = mk(b, s, h // sp, d)

        def layout(pack):
            q.grad = k.grad = v.grad = o_src.grad = None
            kk, vv = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (k, v))
            if pack:
                qh, kh, vh = U._seq_to_heads_local([q, kk, vv], mesh)
            else:
                (qh,), (kh,), (vh,) = (U._seq_to_heads_local([t], mesh) for t in (q, kk, vv))
            o = U._heads_to_seq_local(o_src, mesh)
            torch.autograd.backward([o, qh, kh, vh], [g_out, g_q, g_k, g_v])

        def attn():
            qa.grad = ka.grad = va.grad = None
            local_attention(qa, ka, va, backend=a.backend, causal=a.causal).backward(ga)

        with mock.patch.object(U, "_all_to_all", lambda x, mesh: x):
            times = C.timed_interleaved(
                {"layout_separate": lambda: layout(False), "layout_packed": lambda: layout(True), "attn": attn},
                warmup=a.warmup + 1, iters=a.iters, device=device,
            )
        rec["kv_replication"] = repeat
        rec["variants"] = {n: {**C.summarize(t), "times_ms": [round(x * 1e3, 3) for x in t]} for n, t in times.items()}
        pairs = [("layout_separate", "attn"), ("layout_packed", "attn"), ("layout_packed", "layout_separate")]
        rec["ratios"] = {f"{x}/{y}": C.ratio_of_medians(times[x], times[y], 5) for x, y in pairs}
        rec["ratios_paired"] = {f"{x}/{y}": C.paired_ratio(times[x], times[y], 5) for x, y in pairs}
        out.append(rec)
    return out


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def main(argv=None) -> int:
    a = parse_args(argv)
    ok = True
    if "sp" in a.bench:
        use_ds = want_deepspeed(a)
        tr = C.torchrun_env()
        if tr is not None:
            rank, world, local_rank = tr
            if a.threads:
                torch.set_num_threads(a.threads)
            out = C.stdout_for_records()  # rank logs (and DeepSpeed's) go to stderr from here
            device = C.init_distributed(a.device, rank, world, local_rank, None)
            report = (lambda r: C.emit(r, out)) if rank == 0 else (lambda r: None)
            with finish_together():
                worker(rank, world, device, report, a, use_ds)
            return 0
        if a.device == "cuda" and max(a.sp) > torch.cuda.device_count():
            raise SystemExit(f"--sp {max(a.sp)} needs as many GPUs, found {torch.cuda.device_count()}")
        for sp in a.sp:
            threads = a.threads or max(1, C.usable_cores() // sp)
            ok &= C.launch_ranks(sp, _spawned_worker, (a, use_ds), device_type=a.device, threads=threads)
    if "layout" in a.bench:
        for rec in layout_records(a):
            C.emit(rec)
    return 0 if ok else 1


def _spawned_worker(rank, sp, device, report, a, use_ds):
    worker(rank, sp, device, report, a, use_ds)


if __name__ == "__main__":
    sys.exit(main())
