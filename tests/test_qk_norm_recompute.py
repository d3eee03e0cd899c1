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


def _step(pmesh, opts: dict, recompute: bool, grouped: bool):
    import test_parallelize as tp

    from ulysses_dtensor.models.llama import Llama
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import global_loss, sp_cross_entropy

    with torch.device("meta"):
        model = Llama(llama_args("debug", **QWEN_LIKE))
    parallelize_llama(model, pmesh, **opts)
    for m in model.modules():
        if isinstance(m, Attention):
            m.recompute_qk_norm_inputs, m.grouped_qkv = recompute, grouped
    model.to_empty(device="cpu")
    model.init_weights(tp.SEED)
    batch = {k: v[:1] for k, v in tp.global_batch(0, model.args.vocab_size).items()}
    local = shard_batch(batch, pmesh.sp)
    logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
    loss = sp_cross_entropy(logits, local["labels"], pmesh.loss)
    loss.backward()
    grads = {tp.canonical(n): p.grad.to_local().clone() for n, p in model.named_parameters()}
    return global_loss(loss.detach(), pmesh.loss).item(), grads


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
            kept = _step(pmesh, opts, False, grouped)
            recomputed = _step(pmesh, opts, True, grouped)
            same = kept[0] == recomputed[0] and all(torch.equal(g, recomputed[1][k]) for k, g in kept[1].items())
            out.append((sp, str(opts), grouped, same, len(kept[1])))
    return out


def test_recomputed_norm_inputs_change_no_number():
    rows = run_ranks(2, _worker)[0]
    assert len(rows) == 2 * len(CASES)
    assert all(same for *_, same, _ in rows), rows
    assert all(n > 10 for *_, n in rows)  # every parameter's gradient compared
