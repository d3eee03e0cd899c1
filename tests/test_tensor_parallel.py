"""Tensor parallelism (tp) under Ulysses for transformers models, and what it refuses.

Our Llama's tp meshes (tp 2 x sp 2, dp_shard 2 x tp 2 with every memory switch,
dp_shard 2 x sp 2 x tp 2 and ring 2 x ulysses 2 x tp 2 on 8 ranks) are in
tests/test_parallelize.py against one process. Here transformers' own models
split by their own ``base_model_tp_plan``: Llama, Qwen3 (q/k norms whose weight
gradients are summed over tp) with tiled MLPs and full activation checkpointing,
and Gemma2 (sliding windows and soft-capping, per head) on dp_shard 2 x tp 2:
loss and every gradient equal transformers' unsharded model (the references and
tolerances of tests/test_hf_integration.py), with the collectives of a step
counted against the plan: per layer, the Ulysses all-to-alls of heads / tp heads
and one all-reduce of (B, S/sp, dim) per row-wise module forward and per
column-wise module (plus each summed norm weight) backward.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

import test_hf_integration as plain  # noqa: E402
import test_hf_linear_attention as hybrid  # noqa: E402
import test_hf_memory as memory  # noqa: E402
from distributed import run_ranks  # noqa: E402

from ulysses_dtensor.parallel.mesh import ParallelDims  # noqa: E402

# Qwen3 with 2 kv heads (the parity file's has 1, which tp 2 cannot split). Registered
# in the rank processes only: the parity file's own test compares its ranks' results
# with the FAMILIES table of the pytest process.
QWEN3_KV2 = dataclasses.replace(plain.FAMILIES["qwen3"], config="Qwen3Config",
                                extra={**plain.FAMILIES["qwen3"].extra, "num_key_value_heads": 2})
# (family, (dp_shard, sp, tp), options)
CASES = [
    ("llama", (1, 2, 2), {}),
    ("qwen3_kv2", (1, 2, 2), {}),
    ("gemma2", (2, 1, 2), {"ac_mode": "full", "tiled_mlp": True, "mlp_tiles": 2, "offload_params": True}),
]


def _parity_worker(rank: int, world: int) -> list[dict]:
    out = []
    plain.FAMILIES["qwen3_kv2"] = QWEN3_KV2  # removed again below: the pooled ranks run later tasks
    try:
        with plain.registry_restored():
            refs = memory._references(sorted({f for f, _, _ in CASES}), rank, world)
            for family, (dp_shard, sp, tp), opts in CASES:
                pmesh = ParallelDims(1, dp_shard, sp, world_size=world, tp=tp).build_mesh("cpu")
                r = memory._run(family, pmesh, opts, count=True)
                value, grads, info = r
                out.append({**memory._check(family, opts, f"dp_shard {dp_shard} x sp {sp} x tp {tp}", value,
                                            grads, *refs[family]), "info": info, "sp": sp, "tp": tp})
    finally:
        plain.FAMILIES.pop("qwen3_kv2", None)
    return out


def test_transformers_models_under_tp_match_unsharded_with_counted_collectives():
    from ulysses_dtensor.parallel.tensor_parallel import tp_all_reduces

    results = run_ranks(4, _parity_worker)[0]
    for r in results:
        info = r["info"]
        print(f"{r['family']:10s} {r['where']} {r['opts']}: loss {r['loss_rel']:.1e}, grad {r['grad_rel']:.1e}, "
              f"fwd {info['fwd']} bwd {info['bwd']}")
        if r["opts"]:
            continue  # tiles and recomputation repeat the collectives: counted on the plain cases
        layers, plan = info["layers"], info["tp_plan"]
        rowwise, colwise = tp_all_reduces(plan)
        summed_norms = list(plan.values()).count("replicated_with_grad_allreduce")
        a2a = 4 * layers
        assert info["fwd"] == {"all_to_all_single": a2a, "all_reduce": rowwise * layers}, info
        assert info["bwd"] == {"all_to_all_single": a2a, "all_reduce": (colwise + summed_norms) * layers}, info
        # Each forward all-reduce carries this rank's (B, S/sp, dim) fp32 activations.
        assert info["fwd_all_reduce_bytes"] == rowwise * layers * info["local_tokens"] * 32 * 4


def _refusals_worker(rank: int, world: int) -> list[str]:
    from ulysses_dtensor.integrations.hf import parallelize_hf_model

    msgs = []

    def refuse(model, dims, *words):
        try:
            parallelize_hf_model(model, SimpleNamespace(dims=dims))
        except ValueError as e:
            assert all(w in str(e) for w in words), (words, str(e))
            msgs.append(str(e))
            return
        raise AssertionError(f"no error; expected one naming {words}")

    tp2 = ParallelDims(sp=2, tp=2, world_size=4)
    with plain.registry_restored():
        # kv heads tp cannot split (1 kv head), named with the valid tp.
        refuse(plain.make_model("qwen3"), tp2, "Qwen3ForCausalLM", "tp=2 must divide", "kv heads (1)", "valid tp: [1]")
        # heads / tp that the ulysses ranks cannot place: 4 heads, tp 2 x sp 4.
        refuse(plain.make_model("llama"), ParallelDims(sp=4, tp=2, world_size=8), "LlamaForCausalLM with tp=2",
               "heads % sp == 0")
        # Styles this package does not run, named with the key.
        refuse(plain.make_model("olmo2"), tp2, "Olmo2ForCausalLM", "'colwise_gather_output'", "use tp=1")
        refuse(plain.make_model("qwen3_moe"), tp2, "Qwen3MoeForCausalLM", "'packed_colwise'", "experts")
        # No plan at all.
        bare = plain.make_model("llama")
        bare.config.base_model_tp_plan = {}
        refuse(bare, tp2, "LlamaForCausalLM has no base_model_tp_plan")
        # Linear-attention layers are not split over tp.
        refuse(hybrid.make_model("qwen3_next"), tp2, "Qwen3NextForCausalLM with tp=2", "gated delta-nets")
    return msgs


def test_what_tp_cannot_split_is_refused_by_name():
    print("\n".join(run_ranks(2, _refusals_worker)[0]))
