"""Bytes moved by layout copies around the Ulysses exchange, per attention layer.

One JSON object per configuration (sp, heads, kv heads, batch) on stdout::

    python benchmarks/bench_layout_copies.py --sp 2 4

For each sp it spawns ``sp`` gloo ranks. Rank 0 runs one attention layer
forward and backward per variant on identical inputs and counts, below
dispatch (a ``TorchDispatchMode``), every op that writes a copy of existing
data -- ``copy_``, ``clone`` (``contiguous``, copying ``reshape``), ``cat`` /
``stack``, ``_to_copy``, ``index_select`` / ``index`` / ``gather`` /
``repeat`` (head repetition, reorders), ``constant_pad_nd`` and the
``*_copy`` / ``*_scatter`` ops -- by the bytes it writes. The collective's own
buffers (the all-to-all's output, DeepSpeed's ``empty_like`` receive buffer)
are allocations, not copies, and are not counted. Copies made inside a kernel
(below the op the mode sees) are not visible to any variant.

Variants, each a full layer (q/k/v projections, rope on q and k, the exchange,
SDPA, the exchange back, the o-projection):

* ``ours``     our Llama ``Attention`` under ``UlyssesAttention``, as
  ``parallelize_llama`` applies it: the projections write the send layout.
* ``ours_4d``  the same module with ``grouped_qkv = False``: q/k/v handed to the
  exchange as ``(B, S/P, H, D)`` tensors, the public contract's path (the exchange
  as it was before 2026-12-06, but for replicated kv heads: now one copy, not two).
* ``deepspeed`` ``deepspeed.sequence.layer.DistributedAttention`` between the
  same projections (``batch_dim_idx=0``), when importable (``--deepspeed``).
* ``hf``       transformers' ``LlamaAttention`` through our attention function
  (``--hf``): its projections are transformers' own.

The rope rotation writes a new tensor (compute, the same in every variant): its
bytes are listed under ``excluded`` and not in the totals. Every copy is
attributed to the innermost package frame (or, in backward, to autograd's
node) in ``sites``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# A Llama-3-8B layer's proportions scaled down for CPU: 4 query heads per kv head; and 2 kv
# heads, fewer than sp 4 (replicated before the exchange, as Llama-3-8B's 8 on sp 16).
SHAPES = {
    "gqa": {"heads": 16, "kv_heads": 4, "head_dim": 64, "dim": 1024},
    "gqa_kv2": {"heads": 16, "kv_heads": 2, "head_dim": 64, "dim": 1024},
    "mha": {"heads": 16, "kv_heads": 16, "head_dim": 64, "dim": 1024},
}
QUICK = {"seq_per_rank": 8, "shapes": {"gqa": {"heads": 8, "kv_heads": 2, "head_dim": 4, "dim": 32},
                                       "mha": {"heads": 8, "kv_heads": 8, "head_dim": 4, "dim": 32}}}


# --------------------------------------------------------------------------- #
# The counter
# --------------------------------------------------------------------------- #

# Ops that write a copy of data that exists already. In-place ones are counted by
# their destination's bytes, the rest by their outputs'.
_INPLACE = {"copy_", "index_put_", "masked_scatter_"}
_COPY = {
    "copy_", "clone", "_to_copy", "cat", "stack", "index_select", "index", "gather", "repeat",
    "repeat_interleave", "constant_pad_nd", "slice_scatter", "select_scatter", "diagonal_scatter",
    "as_strided_scatter", "index_put", "index_put_", "masked_scatter", "flip", "roll",
    "expand_copy", "permute_copy", "transpose_copy", "view_copy", "_reshape_copy", "narrow_copy",
    "as_strided_copy", "split_copy", "split_with_sizes_copy", "unbind_copy", "alias_copy",
    "t_copy", "squeeze_copy", "unsqueeze_copy", "unfold_copy", "diagonal_copy",
}
# Files whose copies are compute, the same in every variant: the rope rotation writes
# its result as a new tensor (stack / cat of the rotated halves).
EXCLUDED = {
    os.path.join("ulysses_dtensor", "models", "rope.py"): "rope",
    os.path.join("ulysses_dtensor", "models", "norm.py"): "norm",  # q/k norms (qk_norm), not run here
    os.path.join("transformers", "models", "llama", "modeling_llama.py") + ":rotate_half": "rope",
}
_PACKAGES = ("ulysses_dtensor", "deepspeed", "transformers")
_HERE = os.path.abspath(__file__)


def _site() -> str:
    """The innermost frame of a package (or of this script's layers) that issued the op,
    else (in backward) autograd's node; '?' if neither."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path == _HERE:
            if f.f_code.co_name.startswith("_layer"):
                return f"bench:{f.f_code.co_name}"
        elif f"{os.sep}torch{os.sep}" not in path:
            for pkg in _PACKAGES:
                i = path.rfind(os.sep + pkg + os.sep)
                if i >= 0:
                    return f"{path[i + 1:]}:{f.f_code.co_name}"
        elif f.f_code.co_name == "_engine_run_backward" and path.endswith(os.path.join("autograd", "graph.py")):
            break  # the backward call: what runs below it is autograd's own node
        f = f.f_back
    node = torch._C._current_autograd_node()
    return f"autograd:{node.name()}" if node is not None else "?"


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy ops, per phase (forward / backward) and site."""

    def __init__(self):
        super().__init__()
        self.rows: dict = defaultdict(int)  # (phase, site, op) -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace == "aten" and name in _COPY:
            written = _nbytes(args[0]) if name in _INPLACE else _nbytes(out)
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.rows[(phase, _site(), name)] += written
        return out

    def summary(self) -> dict:
        """{forward, backward, total}: counted bytes; ``excluded``: compute copies (rope);
        ``sites``: 'phase site op' -> bytes, every copy."""
        counted = {"forward": 0, "backward": 0}
        excluded = defaultdict(int)
        sites = {}
        for (phase, site, op), n in sorted(self.rows.items()):
            why = _excluded(site)
            if why is None:
                counted[phase] += n
            else:
                excluded[f"{phase} {why}"] += n
            sites[f"{phase} {site} {op}"] = n
        return {**counted, "total": counted["forward"] + counted["backward"], "excluded": dict(excluded),
                "sites": sites}


def _excluded(site: str) -> str | None:
    for key, why in EXCLUDED.items():
        if key in site:
            return why
    return None


def count_copies(step) -> dict:
    """``step()`` (a forward and backward) under :class:`CopyCounter`: its summary."""
    with CopyCounter() as counter:
        step()
    return counter.summary()


# --------------------------------------------------------------------------- #
# The layers
# --------------------------------------------------------------------------- #


def _llama_args(shape: dict):
    from ulysses_dtensor.models.llama import LlamaArgs

    return LlamaArgs(dim=shape["dim"], n_layers=1, n_heads=shape["heads"], n_kv_heads=shape["kv_heads"],
                     vocab_size=8, ffn_dim=8, attn_backend="sdpa", explicit_head_dim=shape["head_dim"])


def _llama_attention(shape: dict, mesh, grouped: bool, seed: int, dtype, head_chunks: int = 1, pack: bool = False):
    from torch.distributed.tensor.parallel import parallelize_module

    from ulysses_dtensor.models.llama import Attention
    from ulysses_dtensor.parallel.ulysses import UlyssesAttention

    torch.manual_seed(seed)
    attn = Attention(_llama_args(shape)).to(dtype)
    parallelize_module(attn.inner, mesh, UlyssesAttention(head_chunks=head_chunks, pack_qkv=pack))
    attn.grouped_qkv = grouped
    return attn


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v, *args, **kwargs):
        from ulysses_dtensor.attention import local_attention

        return local_attention(q, k, v, backend="sdpa", causal=True)


def _layer_deepspeed(attn, dist_attn, repeat: int, x, cos, sin):
    """Our projections and rope, DeepSpeed's exchange, our o-projection."""
    from ulysses_dtensor.models.rope import apply_rope

    b, s, _ = x.shape
    q = apply_rope(attn.wq(x).view(b, s, -1, attn.head_dim), cos, sin, attn.rope_layout)
    k = apply_rope(attn.wk(x).view(b, s, -1, attn.head_dim), cos, sin, attn.rope_layout)
    v = attn.wv(x).view(b, s, -1, attn.head_dim)
    if repeat > 1:  # DeepSpeed splits kv heads only when sp divides them: repeat first, as we do
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    out = dist_attn(q, k, v, batch_dim_idx=0)
    return attn.wo(out.reshape(b, s, -1))


def _layer_ours(attn, x, cos, sin):
    return attn(x, cos, sin)


def _layer_hf(hf_attn, x, position_embeddings):
    return hf_attn(x, position_embeddings=position_embeddings, attention_mask=None)[0]


def _hf_attention(shape: dict, mesh, seed: int, dtype):
    """transformers' LlamaAttention with our Ulysses attention function (as parallelize_hf_model sets it)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from ulysses_dtensor.integrations.hf.attention_function import ATTN_IMPLEMENTATION, UlyssesCore
    from ulysses_dtensor.integrations.hf.parallelize_model import register_ulysses_attention
    from ulysses_dtensor.parallel.ulysses import UlyssesAttention

    register_ulysses_attention()
    cfg = LlamaConfig(hidden_size=shape["dim"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], attention_dropout=0.0)
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    torch.manual_seed(seed)
    attn = LlamaAttention(cfg, layer_idx=0).to(dtype)
    attn.ulysses = parallelize_module(UlyssesCore("sdpa", "LlamaAttention", mesh.size()), mesh, UlyssesAttention())
    return attn


# --------------------------------------------------------------------------- #
# One configuration
# --------------------------------------------------------------------------- #


def run_config(a, name: str, shape: dict, batch: int, rank: int, sp: int, mesh, use_ds: bool) -> dict:
    from ulysses_dtensor.models.rope import rope_cos_sin
    from ulysses_dtensor.parallel.ulysses import kv_replication

    dtype = DTYPES[a.dtype]
    s = a.seq_per_rank
    record = {"bench": "layout_copies", **C.env_info(torch.device("cpu")), "world_size": sp,
              "config": {"name": name, "sp": sp, "batch": batch, "seq": s * sp, "seq_per_rank": s, **shape,
                         "dtype": a.dtype, "head_chunks": a.head_chunks, "pack_qkv": a.pack_qkv}}
    try:
        repeat = kv_replication(shape["heads"], shape["kv_heads"], sp)
    except ValueError as e:
        record["skipped"] = str(e)
        return record
    record["kv_replication"] = repeat
    g = torch.Generator().manual_seed(a.seed + rank)
    x = torch.randn(batch, s, shape["dim"], generator=g).to(dtype).requires_grad_()
    grad = torch.randn(batch, s, shape["dim"], generator=g).to(dtype)
    pos = torch.arange(rank * s, (rank + 1) * s).expand(batch, s)
    inv = 1.0 / (10000.0 ** (torch.arange(0, shape["head_dim"], 2, dtype=torch.float64) / shape["head_dim"]))
    cos, sin = rope_cos_sin(pos, inv)

    layers = {}
    ours = _llama_attention(shape, mesh, True, a.seed, dtype, a.head_chunks, a.pack_qkv)
    layers["ours"] = lambda: _layer_ours(ours, x, cos, sin)
    four_d = _llama_attention(shape, mesh, False, a.seed, dtype, a.head_chunks, a.pack_qkv)
    layers["ours_4d"] = lambda: _layer_ours(four_d, x, cos, sin)
    if use_ds:
        from deepspeed.sequence.layer import DistributedAttention

        ds = DistributedAttention(_Sdpa(), mesh.get_group(), scatter_idx=2, gather_idx=1)
        layers["deepspeed"] = lambda: _layer_deepspeed(four_d, ds, repeat, x, cos, sin)
    if a.hf:
        hf = _hf_attention(shape, mesh, a.seed, dtype)
        # transformers' rope layout ("half"): cos/sin repeated over the two halves
        emb = (torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype))
        layers["hf"] = lambda: _layer_hf(hf, x, emb)

    variants, outs = {}, {}
    for vname, layer in layers.items():
        def step(layer=layer):
            x.grad = None
            out = layer()
            out.backward(grad)
            return out

        step()  # warm: lazily built state (document caches, kernels) is not a per-layer copy
        result = {}

        def counted(step=step):
            result["out"] = step()

        variants[vname] = count_copies(counted)
        outs[vname] = (result["out"].detach(), x.grad.clone())
    # Same weights and inputs: the variants agree (hf has its own weights). Relative: the largest
    # difference of the output and of x's gradient over the largest value of the other's.
    agree = {}
    for vname in ("ours_4d", "deepspeed"):
        if vname in outs:
            agree[f"ours_vs_{vname}"] = max(((u.float() - w.float()).abs().max() / w.float().abs().max()).item()
                                            for u, w in zip(outs["ours"], outs[vname]))
    record["variants"] = variants
    record["agreement"] = agree
    record["expected"] = expected_bytes(shape, batch, s, sp, torch.empty((), dtype=dtype).element_size())
    return record


def expected_bytes(shape: dict, batch: int, seq_per_rank: int, sp: int, esize: int) -> dict:
    """What each variant copies per layer, from the shapes (unchunked, unpacked; v's head dim
    is q's). ``q``: one rank's q (or output) slice in bytes, ``kvx``: its k (or v) after
    replication (``r`` > 1 when kv heads < sp), ``hq``, ``hk``: heads per rank after the exchange.

    * ``ours``, batch 1: nothing, but the replication of k and v (``2 kvx`` forward, when
      ``r`` > 1); batch > 1: ``2 q + 2 kvx`` each way (q, k, v arrive, the output leaves,
      and their gradients) plus the replication.
    * ``ours_4d``, batch 1: forward ``2 q + 2 kvx`` (q, k, v into the send layout, the
      replication with them, the output out of the received one); backward the output's
      gradient into its send layout (``q``), q's gradient back (``q`` when ``hq`` > 1; with
      one head per rank the rope's backward reads it as it is) and, kv heads split, v's (and
      k's when ``hk`` > 1); replicated, the sum over the copies lands in place.
    * ``deepspeed``, batch 1: ``2 q + 2 kvx`` each way (a permute copy per tensor in, one out),
      plus the replication done before its layer (``kv_heads`` < sp: it splits kv heads only).
    """
    from ulysses_dtensor.parallel.ulysses import kv_replication

    h, kv, d = shape["heads"], shape["kv_heads"], shape["head_dim"]
    r = kv_replication(h, kv, sp)
    hq, hk = h // sp, kv * r // sp
    tokens = batch * seq_per_rank
    q = tokens * h * d * esize
    kvx = tokens * kv * r * d * esize
    rep = 2 * kvx if r > 1 else 0
    if batch > 1:
        return {"ours": {"forward": 2 * q + 2 * kvx + rep, "backward": 2 * q + 2 * kvx}}
    four_bwd = q + q * (hq > 1) + (kvx * ((hk > 1) + 1) if r == 1 else 0)
    return {
        "ours": {"forward": rep, "backward": 0},
        "ours_4d": {"forward": 2 * q + 2 * kvx, "backward": four_bwd},
        "deepspeed": {"forward": 2 * q + 2 * kvx + rep, "backward": 2 * q + 2 * kvx},
    }


# --------------------------------------------------------------------------- #
# Ranks and main
# --------------------------------------------------------------------------- #


def configs(a) -> list[tuple[str, dict, int]]:
    return [(name, shape, b) for name, shape in a.shapes.items() for b in a.batch]


def worker(rank, sp, device, report, a, use_ds):
    from ulysses_dtensor.parallel.mesh import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(sp=sp, world_size=sp).build_mesh("cpu").sp
    if use_ds:
        import deepspeed

        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    for name, shape, batch in configs(a):
        report(run_config(a, name, shape, batch, rank, sp, mesh, use_ds))


def want_deepspeed(a) -> bool:
    if a.deepspeed == "off":
        return False
    # find_spec, not import: importing deepspeed logs to stdout, which stays JSON-only
    if importlib.util.find_spec("deepspeed") is None:
        if a.deepspeed == "on":
            raise SystemExit("--deepspeed on: deepspeed is not importable "
                             "(DS_BUILD_OPS=0 pip install deepspeed==0.19.8)")
        return False
    return True


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-per-rank", type=int, default=256, help="tokens per rank (default 256)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--deepspeed", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--head-chunks", type=int, default=1, help="UlyssesAttention(head_chunks=) of our variants")
    p.add_argument("--pack-qkv", action="store_true", help="UlyssesAttention(pack_qkv=True) for our variants")
    p.add_argument("--hf", action="store_true", help="also transformers' LlamaAttention through our function")
    p.add_argument("--quick", action="store_true", help="tiny shapes (what tests/test_layout_copies.py runs)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        a.seq_per_rank = QUICK["seq_per_rank"]
        a.shapes = {k: QUICK["shapes"][k] for k in a.shapes if k in QUICK["shapes"]}
    else:
        a.shapes = {k: SHAPES[k] for k in a.shapes}
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    use_ds = want_deepspeed(a)
    ok = True
    for sp in a.sp:
        ok &= C.launch_ranks(sp, worker, (a, use_ds))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
