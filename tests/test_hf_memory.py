"""ALST's memory switches and USP (ring x ulysses) on unmodified transformers models.

Every switch -- the tiled per-token block (dense MLP or MoE block), host-offloaded
layer inputs, host-offloaded parameters -- alone on sp 2 and all together on
dp_shard 2 x sp 2, for a dense family (Llama, GQA), an MoE family with its router
loss and sliding windows with sinks (gpt-oss), and a hybrid with gated delta-nets
and MoE MLPs (Qwen3-Next); and ring x ulysses meshes for the causal families
(Llama, Qwen3-MoE with its router loss, DeepSeek-V3's MLA with a v head dim of its
own, the Qwen2.5-VL text path with multimodal rope ids). Each case's loss and every
parameter's gradient must equal transformers' own unsharded model (the references
and tolerances of tests/test_hf_integration.py: fp32, packed documents, 29 tokens
that no mesh divides). What the ring cannot run and what tiling cannot see are
refused before anything runs, by name.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

import test_hf_integration as plain  # noqa: E402
import test_hf_linear_attention as hybrid  # noqa: E402
import torch  # noqa: E402
from distributed import run_ranks  # noqa: E402
from test_hf_integration import (  # noqa: E402
    GRAD_RTOL,
    LOSS_RTOL,
    _rel,
    _router_loss_fn,
    build_pmesh,
    registry_restored,
)

from ulysses_dtensor.parallel.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.parallel.loss import (  # noqa: E402
    count_valid_tokens,
    global_loss,
    sp_cross_entropy,
)
from ulysses_dtensor.parallel.mesh import ParallelDims, ParallelMesh  # noqa: E402

TILED = {"tiled_mlp": True, "mlp_tiles": 3}
OFFLOAD = {"ac_mode": "full", "offload_activations": True}
PARAMS = {"offload_params": True}
ALL = {**TILED, **OFFLOAD, **PARAMS}
SWITCH_CASES = [((1, 1, 2), TILED), ((1, 1, 2), OFFLOAD), ((1, 1, 2), PARAMS), ((1, 2, 2), ALL)]
MEMORY_FAMILIES = ("llama", "gpt_oss", "qwen3_next")
# (family, (dp_shard, ring, ulysses), options)
RING_CASES = [
    ("llama", (1, 2, 2), {}),
    ("llama", (2, 2, 1), {"ac_mode": "full", **TILED}),
    ("qwen3_moe", (1, 2, 2), {"pack_qkv": True}),
    ("qwen3_moe", (2, 2, 1), {}),
    ("deepseek_v3", (1, 2, 2), {}),
    ("qwen2_5_vl", (1, 2, 2), {}),
]


def _kit(family: str):
    """(test module, its packed batch, whether the family trains with its router loss)."""
    if family in hybrid.FAMILIES:
        return hybrid, hybrid.global_batches()[0], False
    return plain, plain.global_batches()[0], plain.FAMILIES[family].moe


def _reference(family: str) -> tuple[float, dict]:
    """transformers' own unsharded model, each document alone: (loss, every gradient)."""
    module, batch, _ = _kit(family)
    if module is plain:
        return plain.reference(plain.make_model(family), batch, family)
    model = hybrid.make_model(family)
    loss = hybrid.reference(model, batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _references(families, rank: int, world: int) -> dict:
    """Each rank computes every world-th family's reference; then all hold all of them."""
    import torch.distributed as dist

    mine = {f: _reference(f) for i, f in enumerate(families) if i % world == rank}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return {f: r for part in gathered for f, r in part.items()}


def _usp_pmesh(world: int, dp_shard: int, ring: int, ulysses: int) -> ParallelMesh:
    return ParallelDims(1, dp_shard, ring * ulysses, world_size=world, ring=ring).build_mesh("cpu")


def _run(family: str, pmesh: ParallelMesh, opts: dict, count: bool = False) -> tuple[float, dict, dict]:
    """Loss, every gradient (full) and what the step did, of ``family`` parallelized with
    ``opts``; ``count`` also counts backward's collectives and notes the tp plan."""
    from ulysses_dtensor.integrations.hf import parallelize_hf_model, shard_hf_batch

    module, batch, moe = _kit(family)
    model = module.make_model(family)
    parallelize_hf_model(model, pmesh, attn_backend="sdpa", **opts)
    rows = module.ROWS // pmesh.dims.dp
    mine = slice(pmesh.dp_rank * rows, (pmesh.dp_rank + 1) * rows)
    local = {k: v[mine] for k, v in batch.items()}
    if family == "qwen2_5_vl":
        local["position_ids"] = local["position_ids"].expand(3, -1, -1)  # multimodal rope ids
    inputs, labels = shard_hf_batch(local, pmesh.sp)
    n = count_valid_tokens(labels, pmesh.loss)
    kwargs = {"output_router_logits": True} if moe else {}
    with CollectiveCounter() as fwd:
        out = model(**inputs, **kwargs)
    loss = sp_cross_entropy(out.logits, labels, num_valid_tokens=n)
    if moe:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
        if opts.get("tiled_mlp"):
            # The router ran tile by tile: three runs of rows per layer, in row order.
            layers = model.config.get_text_config().num_hidden_layers
            assert len(out.router_logits) == 3 * layers, len(out.router_logits)
    with CollectiveCounter() as bwd:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()
             for n, p in model.named_parameters() if p.grad is not None}
    info = {"fwd": fwd.counts(), "layers": model.config.get_text_config().num_hidden_layers,
            "local_tokens": labels.numel()}
    if count:
        from ulysses_dtensor.parallel.tensor_parallel import hf_tp_plan

        info.update(bwd=bwd.counts(), fwd_all_reduce_bytes=fwd.input_bytes("all_reduce"),
                    tp_plan=hf_tp_plan(model, "layers.*.") if pmesh.dims.tp > 1 else {})
    if opts.get("offload_activations"):
        info["offloaded"] = model.offloader.offloaded_bytes
        info["held"] = model.offloader.held
    if opts.get("save_attention"):
        text = model.config.get_text_config()
        info.update(kept=model.attention_keeping.kept, problem=model.attention_keeping.problem,
                    heads=text.num_attention_heads,
                    head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    if opts.get("offload_params"):
        info["host_params"] = all(p.to_local().is_cpu for p in model.parameters())
    return global_loss(loss.detach(), pmesh.loss).item(), grads, info


def _check(family, opts, where, value, grads, ref_loss, ref_grads) -> dict:
    loss_rel = abs(value - ref_loss) / abs(ref_loss)
    assert loss_rel <= LOSS_RTOL, (family, where, opts, value, ref_loss)
    worst = 0.0
    for name, want in ref_grads.items():
        got = grads.get(name)
        assert got is not None or not want.any(), (family, where, opts, name)
        rel = 0.0 if got is None else _rel(got, want)
        assert rel <= GRAD_RTOL, (family, where, opts, name, rel)
        worst = max(worst, rel)
    return {"family": family, "where": where, "opts": opts, "loss_rel": loss_rel, "grad_rel": worst}


def _memory_worker(rank: int, world: int) -> list[dict]:
    out = []
    with registry_restored():
        refs = _references(MEMORY_FAMILIES, rank, world)
        for family in MEMORY_FAMILIES:
            for dims, opts in SWITCH_CASES:
                pmesh, replica = build_pmesh(world, dims)
                if replica:
                    continue
                value, grads, info = _run(family, pmesh, opts)
                r = _check(family, opts, dims, value, grads, *refs[family])
                if "offloaded" in info:
                    # Every decoder layer's input (fp32, hidden 32) went to the host, and backward took each back.
                    assert info["offloaded"] == info["layers"] * info["local_tokens"] * 32 * 4, (family, info)
                    assert info["held"] == 0, (family, info)
                if "host_params" in info:
                    assert info["host_params"], family
                out.append(r)
    return out


def test_memory_switches_match_unsharded_for_dense_moe_window_and_hybrid_families():
    results = run_ranks(4, _memory_worker)[0]
    for r in results:
        print(f"{r['family']:11s} {r['where']} {r['opts']}: loss {r['loss_rel']:.1e}, grad {r['grad_rel']:.1e}")
    assert len(results) == len(MEMORY_FAMILIES) * len(SWITCH_CASES)


# save_attention: full AC that keeps the attention kernel's outputs (tests/test_save_attention.py
# has the mechanism). Llama and Qwen3 (one kv head, replicated over sp) keep them; gpt-oss's sinks
# under the sdpa backend are explicit scores, not one kernel: recomputed, with a warning.
SAVE = {"ac_mode": "full", "save_attention": True}
SAVE_CASES = [SAVE, {**SAVE, "offload_activations": True}]
SAVE_FAMILIES = ("llama", "qwen3", "gpt_oss")


def _save_attention_worker(rank: int, world: int) -> list[dict]:
    import warnings

    from test_save_attention import KernelCounter

    out = []
    with registry_restored():
        refs = _references(SAVE_FAMILIES, rank, world)
        pmesh = ParallelDims(sp=world).build_mesh("cpu")  # FSDP2 over the two sp ranks
        for family in SAVE_FAMILIES:
            for opts in SAVE_CASES:
                with KernelCounter() as count, warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    value, grads, info = _run(family, pmesh, opts)
                r = _check(family, opts, "sp 2", value, grads, *refs[family])
                layers = info["layers"]
                warned = [str(w.message) for w in caught if "save_attention" in str(w.message)]
                if family == "gpt_oss":
                    # No kernel to keep: attention ran (and was recomputed) as explicit scores.
                    assert count.kernels == 0 and info["kept"] == 0, (family, opts, count.kernels, info)
                    assert info["problem"] and len(warned) == 1 and "sinks" in warned[0], (info, warned)
                else:
                    # Once per layer: the recompute read the kept output.
                    assert count.kernels == layers and info["kept"] == layers, (family, opts, count.kernels, info)
                    assert info["problem"] is None and not warned, warned
                if "offloaded" in info:
                    # The layer inputs (fp32, hidden 32) and, after the exchange, the kept outputs:
                    # (rows, heads / sp, padded sequence, head dim) and the float32 lse.
                    tokens = info["local_tokens"]
                    kept = (tokens * world) * (info["heads"] // world) * (info["head_dim"] + 1) * 4
                    kept = kept if family != "gpt_oss" else 0
                    assert info["offloaded"] == layers * (tokens * 32 * 4 + kept), (family, info)
                    assert info["held"] == 0, (family, info)
                out.append(r)
    return out


def test_save_attention_matches_unsharded_and_keeps_the_kernel_outputs():
    results = run_ranks(2, _save_attention_worker)[0]
    for r in results:
        print(f"{r['family']:11s} {r['where']} {r['opts']}: loss {r['loss_rel']:.1e}, grad {r['grad_rel']:.1e}")
    assert len(results) == len(SAVE_FAMILIES) * len(SAVE_CASES)


def _ring_worker(rank: int, world: int) -> list[dict]:
    out = []
    with registry_restored():
        refs = _references(sorted({f for f, _, _ in RING_CASES}), rank, world)
        for family, (dp_shard, ring, ulysses), opts in RING_CASES:
            pmesh = _usp_pmesh(world, dp_shard, ring, ulysses)
            value, grads, info = _run(family, pmesh, opts)
            a2a = 0 if ulysses == 1 else (2 if opts.get("pack_qkv") else 4) * info["layers"]
            # The ring's k/v transfers are all-to-alls too: ring - 1 per layer forward.
            assert info["fwd"].get("all_to_all_single", 0) == a2a + (ring - 1) * info["layers"], (family, info)
            out.append(_check(family, opts, f"dp_shard {dp_shard} x ring {ring} x ulysses {ulysses}",
                              value, grads, *refs[family]))
    return out


def test_usp_ring_matches_unsharded_for_causal_families():
    results = run_ranks(4, _ring_worker)[0]
    for r in results:
        print(f"{r['family']:11s} {r['where']} {r['opts']}: loss {r['loss_rel']:.1e}, grad {r['grad_rel']:.1e}")
    assert len(results) == len(RING_CASES)


def _refusals_worker(rank: int, world: int) -> list[str]:
    from types import SimpleNamespace

    from ulysses_dtensor.integrations.hf import parallelize_hf_model

    msgs = []

    def refuse(model, dims, opts, *words):
        stand_in = SimpleNamespace(dims=dims)
        try:
            parallelize_hf_model(model, stand_in, **opts)
        except (ValueError, TypeError) as e:
            assert all(w in str(e) for w in words), (words, str(e))
            msgs.append(str(e))
            return
        raise AssertionError(f"no error; expected one naming {words}")

    usp = ParallelDims(sp=4, ring=2, world_size=4)
    with registry_restored():
        refuse(plain.make_model("gpt_oss"), usp, {}, "GptOssForCausalLM with ring=2", "sliding window")
        refuse(plain.make_model("gemma2"), usp, {}, "Gemma2ForCausalLM with ring=2", "ring=1")
        refuse(hybrid.make_model("qwen3_next"), usp, {}, "Qwen3NextForCausalLM with ring=2", "gated delta-nets")
        refuse(plain.make_model("llama"), usp, {"attn_backend": "flex"}, "LlamaForCausalLM with ring=2", "'flex'")
        sp2 = ParallelDims(sp=2, world_size=2)
        refuse(plain.make_model("llama"), sp2, {"offload_activations": True}, "offload_activations", "ac_mode='full'")
        refuse(plain.make_model("llama"), sp2, {"save_attention": True}, "save_attention=True needs ac_mode='full'",
               "got ac_mode='none'")
        refuse(plain.make_model("llama"), sp2, {"tiled_mlp": True, "mlp_tiles": 0}, "mlp_tiles=0")
        two = plain.make_model("llama")
        two.model.layers[0].feed_forward = two.model.layers[0].mlp  # which of the two is the block?
        refuse(two, sp2, {"tiled_mlp": True}, "memory.tiled_mlp", "LlamaDecoderLayer", "more than one",
               "mlp, feed_forward")
        msgs.append(_lean_norms_found())
    return msgs


def _lean_norms_found() -> str:
    """Which RMSNorms parallelize_hf_model swaps for the lean one: every norm proven
    bitwise to be one of rms_norm's formulas, no other."""
    from torch import nn

    from ulysses_dtensor.integrations.hf.memory_switches import LeanRMSNorm, lean_norms

    class NotANorm(nn.Module):  # an RMSNorm's shape and attributes, another forward
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(32)), 1e-6

        def forward(self, x):
            return x * self.weight

    found = {}
    for family, make in (("llama", plain.make_model), ("gemma2", plain.make_model), ("gpt_oss", plain.make_model),
                         ("qwen3_next", hybrid.make_model)):
        model = make(family)
        model.odd = NotANorm()
        lean_norms(model)
        kinds = {type(m).__mro__[2 if isinstance(m, LeanRMSNorm) else 0].__name__: isinstance(m, LeanRMSNorm)
                 for m in model.modules() if "Norm" in type(m).__name__ and m is not model.odd}
        assert not isinstance(model.odd, LeanRMSNorm), family
        found[family] = kinds
    assert found["llama"] == {"LlamaRMSNorm": True}, found
    assert found["gemma2"] == {"Gemma2RMSNorm": True}  # 1 + weight, in float32
    assert found["gpt_oss"] == {"GptOssRMSNorm": True}  # weight in float32, then cast
    assert found["qwen3_next"] == {"Qwen3NextRMSNorm": True, "Qwen3NextRMSNormGated": False}
    return f"lean norms: {found}"


def test_what_the_ring_and_tiling_cannot_run_is_refused_by_name():
    print("\n".join(run_ranks(2, _refusals_worker)[0]))
