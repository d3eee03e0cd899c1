"""q / k norms (Qwen3) under full activation checkpointing keep the block's normed input,
not their own: the projections' outputs are recomputed in the norms' backward.

* One attention module (no exchange), grad enabled: the bytes saved for backward, parameters
  aside, fall by exactly the q and k projection outputs and their norms' rstd.
* The same numbers: loss and every gradient bitwise equal with and without it, on sp 2
  (the send layout, head chunks, ``save_attention``, offloaded layer inputs) and without
  the exchange (sp 1).
"""

from __future__ import annotations

import torch
from distributed import run_ranks
from test_layout_copies import llama_step

from ulysses_dtensor.models.llama import Attention, llama_args

QWEN_LIKE = dict(qk_norm=True)  # on the debug flavor: 8 heads of 8, 4 kv heads, dim 64


def _saved_bytes(attn: Attention, x: torch.Tensor, cos, sin) -> int:
    """Bytes of the distinct storages, parameters aside, autograd keeps for the module's backward."""
    storages = {}
    params = {p.untyped_storage().data_ptr() for p in attn.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x, cos, sin)
    return sum(storages.values())


def test_the_norms_keep_the_normed_input_not_the_projections():
    args = llama_args("debug", **QWEN_LIKE)
    torch.manual_seed(0)
    attn = Attention(args)
    seq = 32
    x = torch.randn(1, seq, args.dim, requires_grad=True)
    angles = torch.rand(1, seq, args.head_dim // 2)
    cos, sin = angles.cos(), angles.sin()
    kept = _saved_bytes(attn, x, cos, sin)
    attn.recompute_qk_norm_inputs = True
    recomputed = _saved_bytes(attn, x, cos, sin)
    # The float32 projection outputs and the norms' per-head rstd.
    q_and_k = seq * (args.n_heads + args.n_kv_heads) * (args.head_dim + 1) * 4
    assert kept - recomputed == q_and_k, (kept, recomputed, q_and_k)


CASES = [
    ({"ac_mode": "full", "save_attention": True, "head_chunks": 2}, True),
    ({"ac_mode": "full", "offload_activations": True}, True),
    ({"ac_mode": "full"}, False),
]


def _worker(rank, world):
    from ulysses_dtensor.parallel.mesh import ParallelDims

    out = []
    for sp in (2, 1):
        pmesh = ParallelDims(sp=sp, dp_shard=world // sp).build_mesh("cpu")
        for opts, grouped in CASES:
            args = llama_args("debug", **QWEN_LIKE)
            kept = llama_step(pmesh, args, opts, 1, recompute_qk_norm_inputs=False, grouped_qkv=grouped)
            recomputed = llama_step(pmesh, args, opts, 1, recompute_qk_norm_inputs=True, grouped_qkv=grouped)
            same = kept[0] == recomputed[0] and all(torch.equal(g, recomputed[1][k]) for k, g in kept[1].items())
            out.append((sp, str(opts), grouped, same, len(kept[1])))
    return out


def test_recomputed_norm_inputs_change_no_number():
    rows = run_ranks(2, _worker)[0]
    assert len(rows) == 2 * len(CASES)
    assert all(same for *_, same, _ in rows), rows
    assert all(n > 10 for *_, n in rows)  # every parameter's gradient compared
