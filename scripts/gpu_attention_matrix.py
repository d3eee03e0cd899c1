"""Every attention backend x pattern x head dim x dtype, and the ring with packed
documents, against a float64 reference: what ran, one JSON line per row.

    python scripts/gpu_attention_matrix.py local                 # every backend x pattern x head dim x dtype
    python scripts/gpu_attention_matrix.py local --backends flex --dtypes bfloat16
    python scripts/gpu_attention_matrix.py ring                  # 2 ring ranks sharing one GPU (gloo)

``local`` rows: ``local_attention`` forward and backward on 2 rows of 320 tokens
(packed documents that straddle flex's 128-token blocks; GQA 8:2), each
pattern with documents: ``documents`` (plain causal), ``window``, ``softcap``,
``sinks``, ``mla`` (q/k head dim 1.5x v's, as DeepSeek's 192/128), ``vwide``
(v twice as wide as q/k, with a sliding window and a 0.3 scale: the kernels
then pad q and k, and the scale is not the head dim's). ``ring``
rows: ``ring_attention`` over 2 ranks on one device (gloo carries the blocks),
random packed documents, causal, GQA, the gradient of ``out.sum()`` too (an
expanded, stride-0 upstream gradient); rank 0 prints.

Each row: ``backend`` (asked: every name, ``cudnn`` and ``fa4`` included), ``ran``
(what ``auto`` resolved to by the kernel table; the ring's kernels, ``cudnn`` for
its plain pairs where the table gives plain causal attention to cuDNN), ``pattern``, ``head_dim``, ``v_head_dim``, ``dtype``, ``status``
(``passed``; ``refused`` with the ``reason`` a named backend gave before
running; ``unavailable`` when its package is not installed; ``failed`` with the ``error`` or the errors over tolerance),
``out_err`` / ``grad_err`` (max abs error vs the reference over its max abs
value; the worst of q, k, v, sinks), ``seconds``, and the
``device``, ``torch`` and ``cudnn`` that ran it. Rows are flushed as they finish, so a
run cut short still records what ran; the exit status is 1 when a row failed.
``scripts/gpu_check.sh`` runs both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_dtensor.attention import BACKENDS, local_attention  # noqa: E402
from ulysses_dtensor.attention.capabilities import fa4_installed  # noqa: E402
from ulysses_dtensor.attention.pattern import check_pattern  # noqa: E402
from ulysses_dtensor.attention.select import resolve_backend  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATTERNS = ("documents", "window", "softcap", "sinks", "mla", "vwide")
HEAD_DIMS = (64, 80, 96, 128, 36)  # 36: not a multiple of 8 (padded for torch's flash kernels)
# Error allowed vs float64, relative to the reference's largest magnitude: (output, gradients).
TOLERANCE = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (2e-2, 3e-2)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["local", "ring"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seq", type=int, default=320, help="tokens per row (ring: the whole sequence)")
    return p.parse_args(argv)


def reference(q, k, v, docs, window=None, softcap=None, sinks=None, scale=None):
    """Causal attention within documents, in float64, (B, S, H, D) layout: the
    semantics of ``attention/pattern.py`` written out, sharing no backend code."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 2), v.double().repeat_interleave(rep, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (d**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s, device=q.device)
    allowed = (i[None, :] <= i[:, None]) & (docs[:, :, None] == docs[:, None, :])[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.double().view(1, h, 1, 1).expand(b, h, s, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def _documents(seq: int, device) -> torch.Tensor:
    """Two rows of packed documents: short ones, one over flex's 128-token blocks, a 1-token one."""
    rows = [[seq // 64, seq // 32, seq // 3], [seq * 5 // 8, 1]]
    rows = [[*r, seq - sum(r)] for r in rows]
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows]).to(device)


def _reference_grads(inputs, cot, **kw):
    """The reference output and its gradients, from float64 copies of the inputs."""
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    q, k, v, *sinks = ref_in
    ref = reference(q, k, v, sinks=sinks[0] if sinks else None, **kw)
    return ref.detach(), torch.autograd.grad((ref * cot).sum(), ref_in)


def _relative(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _errors(out, ref, inputs, want_grads, dtype):
    out_err = _relative(out, ref)
    grad_err = max(_relative(a.grad, w) for a, w in zip(inputs, want_grads))
    tol_out, tol_grad = TOLERANCE[dtype]
    ok = out_err <= tol_out and grad_err <= tol_grad
    return {"out_err": out_err, "grad_err": grad_err, "status": "passed" if ok else "failed",
            **({} if ok else {"error": f"over tolerance (out {tol_out}, grads {tol_grad})"})}


def local_row(backend, pattern, head_dim, dtype, device, seq) -> dict:
    g = torch.Generator().manual_seed(head_dim)
    dv = head_dim * 2 if pattern == "vwide" else head_dim
    d = head_dim * 3 // 2 if pattern == "mla" else head_dim
    shapes = [(2, seq, 8, d), (2, seq, 2, d), (2, seq, 2, dv)]
    q, k, v = (torch.randn(sh, generator=g).to(device, dtype).requires_grad_() for sh in shapes)
    docs = _documents(seq, device)
    opts = {"window": dict(window=48), "softcap": dict(softcap=20.0), "vwide": dict(window=48, scale=0.3),
            "sinks": dict(sinks=torch.randn(8, generator=g).to(device).requires_grad_())}.get(pattern, {})
    row = {"what": "local", "backend": backend, "pattern": pattern, "head_dim": d, "v_head_dim": dv,
           "dtype": str(dtype).removeprefix("torch.")}
    features = check_pattern(True, opts.get("window"), opts.get("softcap"), opts.get("sinks"), 8).features()
    if backend == "fa4" and not fa4_installed():
        return {**row, "status": "unavailable", "reason": "the flash-attn-4 package is not installed"}
    try:
        row["ran"] = resolve_backend(backend, features, torch.device(device), dtype, d, v_head_dim=dv, documents=True)
    except ValueError as e:
        return {**row, "status": "refused", "reason": str(e)}
    if row["ran"] == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return {**row, "status": "unavailable", "reason": "the flash-attn package is not installed"}
    inputs = [q, k, v, *([opts["sinks"]] if "sinks" in opts else [])]
    cot = torch.randn(2, seq, 8, dv, generator=g).to(device, torch.float64)
    ref, want = _reference_grads(inputs, cot, docs=docs, **{n: o for n, o in opts.items() if n != "sinks"})
    t0 = time.perf_counter()
    try:
        out = local_attention(q, k, v, backend=backend, document_ids=docs, **opts)
        (out.double() * cot).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a row records what failed and the matrix goes on
        return {**row, "status": "failed", "error": f"{type(e).__name__}: {e}"[:2000],
                "seconds": round(time.perf_counter() - t0, 3)}
    return {**row, **_errors(out, ref, inputs, want, dtype), "seconds": round(time.perf_counter() - t0, 3)}


# --------------------------------------------------------------------------- #
# The ring: 2 ranks on one device
# --------------------------------------------------------------------------- #


def _random_documents(seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(1, seq, (2, 6), generator=g)
    docs = torch.zeros(2, seq, dtype=torch.long)
    for row in range(2):
        for c in cuts[row].tolist():
            docs[row, c:] += 1
    return docs


def ring_rows(rank, mesh, a, device, emit) -> None:
    from ulysses_dtensor.parallel.ring import layout_indices, ring_attention
    from ulysses_dtensor.parallel.ring_steps import _pair_kernels

    ring, seq = mesh.size(), a.seq
    order = layout_indices(seq, ring).to(device)
    mine = order[rank * seq // ring : (rank + 1) * seq // ring]
    for dtype_name in a.dtypes:
        dtype = DTYPES[dtype_name]
        for head_dim in a.head_dims:
            for upstream in ("random", "sum"):
                row = {"what": "ring", "ring": ring, "backend": "sdpa", "pattern": "documents",
                       "upstream_grad": upstream, "head_dim": head_dim, "v_head_dim": head_dim, "dtype": dtype_name}
                t0 = time.perf_counter()
                try:
                    g = torch.Generator().manual_seed(head_dim)
                    full = [torch.randn(2, seq, h, head_dim, generator=g).to(device, dtype) for h in (8, 2, 2)]
                    docs = _random_documents(seq, head_dim).to(device)
                    local = [t[:, mine].clone().requires_grad_() for t in full]
                    kernels = _pair_kernels(local[0].transpose(1, 2))  # what the ring runs, for the record
                    row["ran"] = {"plain": kernels[0].name, "documents": kernels[1].name}
                    cot = torch.randn(2, seq, 8, head_dim, generator=g).to(device, torch.float64)
                    if upstream == "sum":
                        cot = torch.ones_like(cot)
                    ref, want = _reference_grads(full, cot, docs=docs)
                    out = ring_attention(*local, mesh, causal=True, document_ids=docs[:, order])
                    if upstream == "sum":
                        out.sum().backward()  # an expanded gradient: stride 0 everywhere
                    else:
                        out.backward(cot[:, mine].to(dtype))
                    res = _errors(out, ref[:, mine], local, [w[:, mine] for w in want], dtype)
                except Exception as e:  # noqa: BLE001 - recorded; the other rank fails alike or times out
                    res = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
                emit({**row, **res, "seconds": round(time.perf_counter() - t0, 3)})


def _ring_rank(rank, store, a):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    # gloo, not nccl: NCCL refuses two ranks on one GPU; gloo moves CUDA tensors through the host.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=180))
    failed = []

    def emit(row):  # rank 0 prints each row as it finishes (stdout is the parent's)
        failed.append(row["status"] == "failed")
        if rank == 0:
            print(json.dumps({**row, **_env(device)}), flush=True)

    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ring",))  # groups only; the tensors stay on device
        ring_rows(rank, mesh, a, device, emit)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if any(failed):
        sys.exit(1)


def _env(device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}


def run_ring(a) -> bool:
    """Two spawned ranks; True when every row passed (a rank exits 1 otherwise)."""
    import torch.multiprocessing as mp

    sys.stdout.flush()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_ring_rank, args=(os.path.join(tmp, "store"), a), nprocs=2, start_method="spawn")
        except mp.ProcessExitedException:
            return False
    return True


def run_local(a, out=sys.stdout) -> bool:
    """Every row, printed as it finishes; True when none failed."""
    device = torch.device(a.device)
    rows = []
    for dtype_name in a.dtypes:
        for backend in a.backends:
            for pattern in a.patterns:
                for head_dim in a.head_dims:
                    try:
                        row = local_row(backend, pattern, head_dim, DTYPES[dtype_name], a.device, a.seq)
                    except Exception as e:  # noqa: BLE001 - setting the row up failed: recorded too
                        row = {"what": "local", "backend": backend, "pattern": pattern, "head_dim": head_dim,
                               "dtype": dtype_name, "status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
                    row = {**row, **_env(device)}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    rows.append(row)
    return not any(r["status"] == "failed" for r in rows)


def main(argv=None) -> int:
    """Exit status 1 when a row failed (refused rows are answers, not failures)."""
    a = parse_args(argv)
    try:
        ok = (run_local if a.what == "local" else run_ring)(a)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
