"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) under Ulysses SP equal the model unsharded.

Tiny random configs in fp32: a gated delta-net layer (4 key heads, 8 value
heads, key dim 8, value dim 16: the exchange carries tensors of three head
dims) and a full-attention layer (q projected twice as wide for its output
gate), MoE MLPs for Qwen3-Next and Qwen3.5-MoE. Two global batches of 2 rows x 149 tokens
(149 is not a multiple of 2 or 4: every mesh pads; three recurrence chunks of
64): packed documents starting mid-chunk and exactly at a chunk start, and one
document per row. The reference is transformers' own unsharded model, each
document run alone, so its convolution and recurrence start from zero at every
document; loss and every parameter's gradient must match on sp 2, sp 4,
dp_shard 2 x sp 2 and dp_shard 2 x sp 1, with the all-to-alls of each layer
counted exactly. (The family matrix runs these families too, on 29 tokens: one
recurrence chunk; here the state crosses chunks, with the options on top.)
"""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

# Checked without importing it: the pooled ranks import transformers, this process need not.
if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

from distributed import run_ranks  # noqa: E402
from test_hf_integration import build_pmesh, registry_restored  # noqa: E402

from ulysses_dtensor.parallel.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.parallel.loss import (  # noqa: E402
    IGNORE_INDEX,
    count_valid_tokens,
    global_loss,
    sp_cross_entropy,
)
from ulysses_dtensor.parallel.mesh import ParallelDims  # noqa: E402

VOCAB, SEQ, ROWS = 64, 149, 2
# Document starts per row: mid-chunk resets (37, 100, 130) and one at a chunk start (64).
DOC_STARTS = [[0, 37, 100], [0, 64, 130]]
K_HEADS, V_HEADS, K_DIM, V_DIM, HEADS, KV_HEADS, HEAD_DIM = 4, 8, 8, 16, 4, 2, 8
LAYER_TYPES = ["linear_attention", "full_attention"]
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
    linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS, linear_key_head_dim=K_DIM,
    linear_value_head_dim=V_DIM, linear_conv_kernel_dim=4, max_position_embeddings=256,
    attention_dropout=0.0, tie_word_embeddings=False, initializer_range=0.1,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
# Qwen3.5's multimodal rope sections must cover the rotary frequencies of a head_dim of 8.
ROPE_3_5 = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [1, 1, 0]})
FAMILIES = {
    # name: (config class, extra config, what the case covers)
    "qwen3_next": ("Qwen3NextConfig", dict(MOE, decoder_sparse_step=1),
                   "gated delta-net (key heads != value heads) + gated full attention, MoE MLPs"),
    "qwen3_5": ("Qwen3_5TextConfig", dict(ROPE_3_5), "gated delta-net with separate projections + gated full attention"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(ROPE_3_5, **MOE),
                    "gated delta-net with separate projections + gated full attention, MoE MLPs"),
}
# (family, (dp_replicate, dp_shard, sp), options), by the ranks they run on: the two-rank
# ones are the quick tier's (the smallest meshes), the four-rank ones the rest.
CASES = {
    2: [
        ("qwen3_next", (1, 2, 1), {}),  # no exchange: documents still restart the state
        ("qwen3_5", (1, 1, 2), {"ac_mode": "selective"}),
    ],
    4: [
        ("qwen3_next", (1, 1, 4), {"ac_mode": "full"}),
        ("qwen3_next", (1, 2, 2), {"pack_qkv": True}),
        ("qwen3_5_moe", (1, 2, 2), {}),
    ],
}
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def make_model(family: str, **overrides):
    import transformers

    cls_name, extra, _ = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def global_batches() -> list[dict]:
    """Two global batches: packed documents, and one document per row."""
    g = torch.Generator().manual_seed(7)
    pos = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r, row in enumerate(DOC_STARTS):
        for a, b in zip(row, row[1:] + [SEQ]):
            pos[r, a:b] = torch.arange(b - a)
    out = []
    for position_ids in (pos, torch.arange(SEQ).expand(ROWS, SEQ)):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        labels[:, 3] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels, "position_ids": position_ids.contiguous()})
    return out


def reference(model, batch, split: bool = True) -> torch.Tensor:
    """Token-mean next-token loss; with ``split`` each document runs through the model alone."""
    total, count = 0.0, 0
    for r in range(ROWS):
        pos = batch["position_ids"][r].tolist()
        starts = ([t for t in range(SEQ) if pos[t] == 0] if split else [0]) + [SEQ]
        for a, b in zip(starts, starts[1:]):
            logits = model(input_ids=batch["input_ids"][r : r + 1, a:b]).logits[0]
            target = batch["labels"][r, a + 1 : b].clone()
            if not split:  # the same targets: none across a document boundary
                target[[t - a - 1 for t in range(a + 1, b) if pos[t] == 0]] = IGNORE_INDEX
            total = total + F.cross_entropy(logits[:-1], target, ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((target != IGNORE_INDEX).sum())
    return total / count


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


def _exchange_bytes(rows: int, padded: int, sp: int) -> int:
    """Bytes one rank sends in one forward: per linear layer q, k, v, b, a in and the
    output back; per full-attention layer q, k, v (kv heads replicated up to sp) and the output."""
    tokens = rows * padded // sp
    linear = tokens * (2 * K_HEADS * K_DIM + V_HEADS * V_DIM + 2 * V_HEADS + V_HEADS * V_DIM)
    kv = KV_HEADS * max(1, sp // KV_HEADS)
    full = tokens * HEAD_DIM * (2 * HEADS + 2 * kv)
    n_linear = LAYER_TYPES.count("linear_attention")
    return (n_linear * linear + (len(LAYER_TYPES) - n_linear) * full) * 4 * (sp - 1) // sp


def _parity_worker(rank: int, world: int) -> list[dict]:
    from ulysses_dtensor.integrations.hf import parallelize_hf_model, shard_hf_batch

    batches = global_batches()
    refs, results = {}, []
    with registry_restored():
        for family, dims, opts in CASES[world]:
            model = make_model(family)
            model_class = type(model).__name__  # before FSDP renames it
            if family not in refs:
                ref = copy.deepcopy(model)
                losses = [reference(ref, b) for b in batches]
                sum(losses).backward()
                refs[family] = ([x.item() for x in losses], {n: p.grad.clone() for n, p in ref.named_parameters()})
                # Documents matter: the packed rows run whole give another loss, far beyond the tolerance.
                with torch.no_grad():
                    crossing = reference(ref, batches[0], split=False).item()
                assert abs(crossing - losses[0].item()) > 20 * LOSS_RTOL * abs(losses[0].item()), (family, crossing)
            ref_losses, ref_grads = refs[family]

            pmesh, _ = build_pmesh(world, dims)
            parallelize_hf_model(model, pmesh, attn_backend="sdpa", **opts)
            rows = ROWS // pmesh.dims.dp
            mine = slice(pmesh.dp_rank * rows, (pmesh.dp_rank + 1) * rows)
            total, losses = 0, []
            for i, b in enumerate(batches):
                inputs, labels = shard_hf_batch({k: v[mine] for k, v in b.items()}, pmesh.sp)
                n = count_valid_tokens(labels, pmesh.loss)
                with CollectiveCounter() as fwd:
                    logits = model(**inputs).logits
                loss = sp_cross_entropy(logits, labels, num_valid_tokens=n)
                total = total + loss
                losses.append(global_loss(loss, pmesh.loss).item())
                if i == 0:
                    fwd_counts, fwd_bytes = fwd.counts(), fwd.sent_bytes()
            with CollectiveCounter() as bwd:
                total.backward()

            sp, n_linear = dims[2], LAYER_TYPES.count("linear_attention")
            # Linear layers: one all-to-all in (q, k, v, b, a), one out. Full attention: q, k, v
            # (packed: one) and the output.
            a2a = 2 * n_linear + (2 if opts.get("pack_qkv") else 4) * (len(LAYER_TYPES) - n_linear)
            assert fwd_counts == ({"all_to_all_single": a2a} if sp > 1 else {}), (family, dims, fwd_counts)
            replay = 2 if opts.get("ac_mode") == "full" else 1  # full AC replays the exchanges
            want_bwd = {"all_to_all_single": a2a * len(batches) * replay} if sp > 1 else {}
            assert bwd.counts() == want_bwd, (family, dims, bwd.counts())
            padded = -(-SEQ // sp) * sp
            assert fwd_bytes == _exchange_bytes(rows, padded, sp), (family, dims, fwd_bytes)

            loss_rel = max(abs(g - r) / abs(r) for g, r in zip(losses, ref_losses))
            grad_rel, compared = 0.0, 0
            for name, p in model.named_parameters():
                name = name.replace("_checkpoint_wrapped_module.", "")
                rel = _rel(p.grad.full_tensor(), ref_grads[name])
                assert rel <= GRAD_RTOL, (family, dims, opts, name, rel)
                grad_rel = max(grad_rel, rel)
                compared += 1
            assert compared == len(ref_grads), (family, compared, sorted(ref_grads))
            assert loss_rel <= LOSS_RTOL, (family, dims, losses, ref_losses)
            results.append(dict(family=family, model_class=model_class, model_type=model.config.model_type,
                                dims=list(dims), opts=opts, loss_rel=loss_rel, grad_rel=grad_rel,
                                counts={"forward": fwd_counts, "backward": bwd.counts()}))
    return results


@pytest.mark.parametrize("world", sorted(CASES))
def test_hybrid_models_match_unsharded_on_every_mesh(world):
    results = run_ranks(world, _parity_worker)
    for r in results[0]:
        print(f"{r['family']:10s} dims={tuple(r['dims'])} {r['opts']}: loss rel {r['loss_rel']:.1e}, "
              f"grad rel {r['grad_rel']:.1e}, fwd {r['counts']['forward']} bwd {r['counts']['backward']}")
    assert len(results[0]) == len(CASES[world])


# ---------------------------------------------------------------------------
# The document-restarting convolution and recurrence against transformers' own, per document
# ---------------------------------------------------------------------------


def _kernels_worker(rank: int, world: int) -> dict:
    from transformers.models.qwen3_next import modeling_qwen3_next as own

    from ulysses_dtensor.mixers.gated_delta import (
        causal_conv_documents,
        chunk_gated_delta_rule_documents,
    )
    from ulysses_dtensor.attention.documents import segment_ids

    # Small chunks (8) so that 37 tokens cross several: resets mid-chunk, at a chunk
    # start (16, 24), and a one-token document (8).
    batch, seq, chunk = 2, 37, 8
    starts = [[0, 5, 16, 30], [0, 8, 9, 24]]
    docs = torch.zeros(batch, seq, dtype=torch.long)
    for r, row in enumerate(starts):
        for i, (a, b) in enumerate(zip(row, row[1:] + [seq])):
            docs[r, a:b] = i
    segments = segment_ids(docs)
    g = torch.Generator().manual_seed(rank)
    shapes = [(K_HEADS // 2, K_DIM), (K_HEADS // 2, K_DIM), (V_HEADS // 2, V_DIM)]
    q, k, v = (torch.randn(batch, seq, h, d, generator=g, dtype=torch.float64) for h, d in shapes)
    decay = -2 * torch.rand(batch, seq, V_HEADS // 2, generator=g, dtype=torch.float64)
    beta = torch.rand(batch, seq, V_HEADS // 2, generator=g, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, decay, beta)]
    x = torch.randn(batch, seq, 12, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 4, generator=g, dtype=torch.float64, requires_grad=True)

    out = chunk_gated_delta_rule_documents(*inputs, segments, chunk_size=chunk)
    conv = causal_conv_documents(x, weight, None, segments, F.silu)
    ref, ref_conv = torch.zeros_like(out), torch.zeros_like(conv)
    for r, row in enumerate(starts):
        for a, b in zip(row, row[1:] + [seq]):
            part = [t[r : r + 1, a:b] for t in inputs]
            ref[r, a:b] = own.torch_chunk_gated_delta_rule(
                *part[:3], g=part[3], beta=part[4], chunk_size=chunk, use_qk_l2norm_in_kernel=True)[0][0]
            ref_conv[r, a:b] = own.causal_conv1d_fn(x[r : r + 1, a:b].transpose(1, 2), weight, None, "silu")[0].T
    whole = own.torch_chunk_gated_delta_rule(*inputs[:3], g=decay, beta=beta, chunk_size=chunk,
                                             use_qk_l2norm_in_kernel=True)[0]
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    wc = torch.randn(conv.shape, generator=g, dtype=torch.float64)
    params = [*inputs, x, weight]
    got = torch.autograd.grad((out * w).sum() + (conv * wc).sum(), params)
    want = torch.autograd.grad((ref * w).sum() + (ref_conv * wc).sum(), params)
    return {
        "out": (out - ref).abs().max().item(), "conv": (conv - ref_conv).abs().max().item(),
        "grads": max((a - b).abs().max().item() for a, b in zip(got, want)),
        "crossing": (whole - ref).abs().max().item(), "scale": ref.abs().max().item(),
    }


def test_gated_delta_restarts_equal_each_document_alone():
    """fp64 (the recurrence computes in fp32 inside both): outputs and input gradients match."""
    r = run_ranks(4, _kernels_worker)[0]
    print(r)
    assert r["out"] < 1e-5 * r["scale"] and r["conv"] < 1e-12 and r["grads"] < 1e-5, r
    assert r["crossing"] > 1e-2 * r["scale"], r  # without the restarts the documents would mix


# ---------------------------------------------------------------------------
# Refusals: other hybrids and heads sp cannot place, named before anything runs
# ---------------------------------------------------------------------------


def _raises(fn, *words) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert all(w in msg for w in words), (words, msg)
        return msg
    raise AssertionError(f"no error; expected one naming {words}")


def _refusals_worker(rank: int, world: int) -> list[str]:
    import transformers as T

    from ulysses_dtensor.integrations.hf import parallelize_hf_model

    auto = T.AutoModelForCausalLM.from_config
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    msgs = []

    def refuse(model, sp, *words):
        stand_in = SimpleNamespace(dims=ParallelDims(sp=sp, dp_shard=1, world_size=sp))
        msgs.append(_raises(lambda: parallelize_hf_model(model, stand_in), type(model).__name__, *words))

    with registry_restored():
        refuse(make_model("qwen3_next", linear_num_key_heads=2, linear_num_value_heads=4), 4,
               "linear_num_key_heads=2", "sp=4", "valid sp: [1, 2]")
        refuse(auto(T.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, state_size=4)), 2,
               "['linear_attention']", "MambaMixer")
        refuse(auto(T.MiniMaxConfig(**small, num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                    layer_types=["linear_attention", "full_attention"])), 2, "['linear_attention']")
        refuse(auto(T.OlmoHybridConfig(**small, num_attention_heads=4)), 2,
               "['linear_attention']", "OlmoHybridGatedDeltaNet")
        # Mixers that run (Mamba-2, here) refuse an sp their heads / groups cannot take, naming the valid ones.
        refuse(auto(T.GraniteMoeHybridConfig(**small, num_attention_heads=4, layer_types=["mamba", "attention"],
                                             mamba_d_state=8, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=3,
                                             mamba_expand=3)), 2,
               "GraniteMoeHybridMambaLayer has 6 heads in 3 groups", "valid sp: [1, 3, 6]")
    return msgs


def test_other_hybrids_are_refused_by_class_and_layer_type():
    print("\n".join(run_ranks(4, _refusals_worker)[0]))
