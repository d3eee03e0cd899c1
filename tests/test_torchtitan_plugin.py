"""The torchtitan plug-in: torchtitan 0.3.0's own Llama-3 / Qwen3 under our Ulysses.

Parity (CPU, gloo, fp32): torchtitan's Llama-3 and Qwen3 decoders (their
debug-model architecture, shrunk to 2 layers, dim 64, 8 heads and 2 kv heads so
that kv heads < sp 4) parallelized by the plug-in's ``parallelize_fn`` (our
Ulysses at ``layers.*.attention.inner_attention``, then torchtitan's own AC and
FSDP2 over dp_shard x sp) under sp 2, sp 4, dp_shard 2 x sp 2 and HSDP 2 x sp 2,
fed by the plug-in's batch step and torchtitan's own token-weighted loss, give
the loss and every parameter gradient of the same model unsharded in one
process. Sequences of 29 tokens (divisible by neither 2 nor 4), packed
documents, ignored labels; our inner attention and torchtitan's own SDPA. The
collective count and bytes per layer are the Ulysses minimum.

With torchtitan's own parallelisms on the same 4 gloo ranks, against the same
unsharded reference: its TP plan (tp 2 x sp 2: llama3, qwen3), its expert
parallelism (qwen3 MoE at tp 2 x ep 2 x sp 2 and dp_shard 2 x ep 2 x sp 2;
deepseek_v3's MLA + MoE at dp_shard 2 x ep 2 x sp 2) and its pipeline
schedules (pp 2 x sp 2: 1F1B, InterleavedZeroBubble, ZBVZeroBubble). The
collectives are counted per mesh: Ulysses bytes of ``heads / tp`` heads over
sp on every layer, torchtitan's TP all-gathers / reduce-scatters /
all-reduces, five EP all-to-alls per MoE layer, nothing else.

torchtitan's trainer itself needs CUDA: the ``gpu`` test runs it through our
module (``scripts/torchtitan_check.py``, which also runs it on CPU ranks through
a harness, too slow for this suite).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
from distributed import run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="needs the torchtitan extra: pip install 'ulysses-dtensor[torchtitan]'",
)

SEED = 1234
BATCH, SEQ = 2, 29
VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 128, 64, 8, 2, 2
EXPERTS = 4
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
# torchtitan's GroupedExperts computes in bfloat16 whatever the parameters' dtype, in the
# reference too; token order differs per rank: torch.testing's bfloat16 tolerance.
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")


# ---------------------------------------------------------------------------
# torchtitan's decoders, small
# ---------------------------------------------------------------------------


def tiny_model_config(family: str, attention: str, parallelism=None):
    """torchtitan's debug-model architecture at test size; ``attention``: ours ('sdpa') or 'model' (its SDPA).

    ``parallelism``: a ``ParallelismConfig`` whose sharding (TP plan, EP) the
    config takes, as torchtitan's trainer does before its overrides run.
    """
    from functools import partial

    from torch import nn
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.common import (
        ComplexRoPE,
        CosSinRoPE,
        Embedding,
        Linear,
        RMSNorm,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.param_init import skip_param_init

    from ulysses_dtensor.integrations.torchtitan.attention import OVERRIDE_TARGET

    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    if family == "llama3":
        from torchtitan.models.llama3 import _build_llama3_layers
        from torchtitan.models.llama3.model import Llama3Model

        cfg = Llama3Model.Config(
            dim=DIM, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
            layers=_build_llama3_layers(
                n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=128,
                rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
                attn_backend="flex",
            ),
        )
    elif family in ("qwen3", "qwen3_moe"):
        from torchtitan.models.qwen3 import (
            _build_qwen3_layers,
            _build_qwen3_moe_layers,
            _qwen3_norm,
        )
        from torchtitan.models.qwen3.model import Qwen3Model

        head_dim = 16  # Qwen3: heads * head_dim != dim, q/k norms, tied embeddings (dense)
        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6)
        shape = dict(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim,
                     attn_backend="flex", rope=rope)
        layers = (_build_qwen3_layers(hidden_dim=128, **shape) if family == "qwen3" else
                  _build_qwen3_moe_layers(moe_hidden_dim=32, num_experts=EXPERTS, top_k=2,
                                          moe_comm_backend="standard", **shape))
        cfg = Qwen3Model.Config(
            dim=DIM, vocab_size=VOCAB, norm=_qwen3_norm(DIM), enable_weight_tying=family == "qwen3",
            tok_embeddings=Embedding.Config(
                num_embeddings=VOCAB, embedding_dim=DIM,
                param_init={"weight": skip_param_init} if family == "qwen3" else init,
            ),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
            layers=layers,
        )
    else:  # deepseek_v3: MLA (v head dim != q/k head dim), one dense layer, then MoE with shared experts
        from torchtitan.models.deepseek_v3 import _build_dsv3_layers
        from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

        rope = ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0)
        cfg = DeepSeekV3Model.Config(
            dim=DIM, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
            norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
            lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
            layers=_build_dsv3_layers(
                n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=128,
                moe_hidden_dim=32, num_experts=EXPERTS, num_shared_experts=1, router_top_k=2,
                router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
                non_blocking_capacity_factor=None, rope=rope,
            ),
        )
    if parallelism is not None:
        from types import SimpleNamespace

        cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    if attention == "model":  # torchtitan's own SDPA (causal, no document masks)
        for layer in cfg.layers:
            sharding = layer.attention.inner_attention.sharding_config
            layer.attention.inner_attention = ScaledDotProductAttention.Config(sharding_config=sharding)
    else:  # ours, installed by the plug-in's torchtitan override
        replaced = apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, {"backend": attention})]), cfg)
        assert len(replaced) == LAYERS, replaced
    return cfg


def global_batch(docs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and positions as torchtitan's text dataset yields them.

    Labels are shifted within each document (input = doc[:-1], label =
    doc[1:]); a few labels are ignored (as its chat dataset masks prompts).
    """
    g = torch.Generator().manual_seed(7)
    inputs, labels, positions = [], [], []
    for _ in range(BATCH):
        n_cuts = 2 if docs else 0
        cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:n_cuts].add(1).tolist())
        bounds = [0, *cuts, SEQ]
        row_in, row_lab, row_pos = [], [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            doc = torch.randint(0, VOCAB, (b - a + 1,), generator=g)
            row_in.append(doc[:-1])
            row_lab.append(doc[1:])
            row_pos.append(torch.arange(b - a))
        inputs.append(torch.cat(row_in))
        labels.append(torch.cat(row_lab))
        positions.append(torch.cat(row_pos))
    labels = torch.stack(labels)
    labels[:, 3] = -100
    return torch.stack(inputs), labels, torch.stack(positions)


def canonical(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@functools.lru_cache(maxsize=None)
def reference(family: str, attention: str, docs: bool) -> dict:
    """Loss and gradients of the unsharded model in this process (and its initial weights)."""
    from torchtitan.components.loss import CrossEntropyLoss

    from ulysses_dtensor.integrations.torchtitan.sp_batch import shard_for_sp

    torch.manual_seed(SEED)
    model = tiny_model_config(family, attention).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, labels, positions = global_batch(docs)
    inputs, labels, extra, _ = shard_for_sp(inputs, labels, {"positions": positions}, model=model)
    pred = model(inputs, **extra)
    loss, _ = CrossEntropyLoss.Config().build()(pred, labels, (labels != -100).sum())
    loss.backward()
    return {"init": init, "loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


# ---------------------------------------------------------------------------
# The plug-in on torchtitan's ParallelDims (cp axis = sp), every rank
# ---------------------------------------------------------------------------


def build_parallel_dims(world: int, dp_replicate: int, dp_shard: int, sp: int, tp: int = 1, ep: int = 1, pp: int = 1):
    import torchtitan.distributed.parallel_dims as pd

    dims = pd.ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=sp, tp=tp, pp=pp, ep=ep, world_size=world,
        spmd_backend="partial_dtensor",
    )
    # torchtitan picks its device type at import ("cuda" where none is found).
    with mock.patch.object(pd, "device_type", "cpu"):
        dims.build_mesh()
    return dims


def run_case(world: int, case: dict, meshes: dict) -> dict:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.protocols.model_spec import ModelSpec

    from ulysses_dtensor.integrations.torchtitan.parallelize import ulysses_model_spec
    from ulysses_dtensor.integrations.torchtitan.sp_batch import shard_for_sp
    from ulysses_dtensor.parallel.comm_stats import CollectiveCounter
    from ulysses_dtensor.parallel.ulysses import exchange_bytes_per_rank

    family, attention, docs = case["model"], case.get("attention", "sdpa"), case.get("docs", True)
    sp, pack = case["sp"], case.get("pack_qkv", False)
    tp, ep = case.get("tp", 1), case.get("ep", 1)
    degrees = (case.get("dp_replicate", 1), case.get("dp_shard", 1), sp, tp, ep)
    if degrees not in meshes:  # process groups are costly: one set per mesh and task
        meshes[degrees] = build_parallel_dims(world, *degrees)
    dims = meshes[degrees]
    ref = reference(family, attention, docs)

    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor", context_parallel_load_balancer=None, tensor_parallel_degree=tp,
        expert_parallel_degree=ep,
    )
    cfg = tiny_model_config(family, attention, parallelism)
    with torch.device("meta"):
        model = cfg.build()
    spec = ModelSpec(name=family, flavor="tiny", model=cfg, parallelize_fn=None, pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    ac = {"selective": SelectiveAC.Config(), "full": FullAC.Config()}.get(case.get("ac"))
    ulysses_model_spec(spec, pack_qkv=pack).parallelize_fn(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False),
        ac_config=ac,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # buffers (rope caches)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name  # FSDP2 over dp_shard x sp (HSDP: x dp_replicate)
            full = ref["init"][canonical(name)]
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())

    # The trainer's step: this data rank's rows, global valid-token count over
    # the batch mesh, then the plug-in's sp slice.
    inputs, labels, positions = global_batch(docs)
    batch_mesh = dims.get_optional_mesh("batch")
    if batch_mesh is not None:
        per = BATCH // batch_mesh.size()
        rows = slice(batch_mesh.get_local_rank() * per, (batch_mesh.get_local_rank() + 1) * per)
        inputs, labels, positions = inputs[rows], labels[rows], positions[rows]
    valid = (labels != -100).sum()
    if batch_mesh is not None:
        valid = funcol.all_reduce(valid, "sum", batch_mesh.get_group()).wait()
    sp_mesh = dims.get_optional_mesh("cp")
    local_in, local_lab, extra, _ = shard_for_sp(
        inputs, labels, {"positions": positions}, model=model, sp_mesh=sp_mesh, tp_size=tp
    )

    with CollectiveCounter() as counter:
        pred = model(local_in, **extra)
        loss, _ = CrossEntropyLoss.Config().build()(pred, local_lab, valid)
        loss.backward()
    total = funcol.all_reduce(loss.detach(), "sum", dims.get_mesh("loss").get_group()).wait().item()

    figures = {"case": case, "loss_rel": abs(total - ref["loss"]) / abs(ref["loss"])}
    grads = {canonical(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    assert set(grads) == set(ref["grads"]), (case, set(grads) ^ set(ref["grads"]))
    figures["grad_abs"] = max((grads[n] - g).abs().max().item() for n, g in ref["grads"].items())
    assert figures["loss_rel"] < 1e-5, (case, total, ref["loss"])
    tol = BF16_TOL if family in MOE_FAMILIES else GRAD_TOL
    for n, g in ref["grads"].items():
        torch.testing.assert_close(grads[n], g, **tol, msg=lambda m: f"{case}: grad {n}: {m}")

    # Ulysses minimum per layer over sp: q, k, v and the output forward (q, k,
    # v in one with pack_qkv), the same backward, each O(n d / P) bytes of the
    # heads / tp a tp rank holds; nothing else on the sp ranks (no all-gather
    # of the sequence), on EVERY layer (also the dense ones of an MoE model
    # under ep > 1). torchtitan's selective AC saves the exchanged tensors (no
    # replay); full AC replays the forward exchanges in backward.
    by_mesh = collectives_by_mesh(counter, meshes)
    forward = 2 if pack else 4
    per_layer = 2 * forward + (forward if case.get("ac") == "full" else 0)
    expected = {("cp", "all_to_all_single"): per_layer * LAYERS}
    shape = (local_in.shape[0], local_in.shape[1] * sp, *attention_heads(family, tp), sp, 4)
    v_head_dim = 16 if family == "deepseek_v3" else None
    ulysses_bytes = LAYERS * exchange_bytes_per_rank(*shape, v_head_dim=v_head_dim)
    if case.get("ac") == "full":
        ulysses_bytes += LAYERS * exchange_bytes_per_rank(*shape, backward=False, v_head_dim=v_head_dim)
    assert sum(r.sent_bytes for r in by_mesh.get(("cp", "all_to_all_single"), [])) == ulysses_bytes, case
    if tp > 1:  # torchtitan's own TP plan with its sequence parallelism
        tokens = local_in.numel()  # this sp rank's (padded) slice
        for op, (count, nbytes) in tp_collectives(family, tokens, tp).items():
            expected[("tp", op)] = count
            if nbytes is not None:
                assert {r.input_bytes for r in by_mesh.get(("tp", op), [])} == {nbytes}, (case, op)
    if ep > 1:  # per MoE layer: token counts, dispatch, combine forward; combine and dispatch backward
        expected[("ep", "all_to_all_single")] = 5 * sum(family != "deepseek_v3" or i > 0 for i in range(LAYERS))
    figures["collectives"] = {f"{m}.{op}": len(v) for (m, op), v in sorted(by_mesh.items())}
    assert {k: len(v) for k, v in by_mesh.items()} == expected, (case, figures["collectives"])
    return figures


def attention_heads(family: str, tp: int) -> tuple[int, int, int]:
    """(heads, kv heads, q/k head dim) a tp rank computes and Ulysses exchanges."""
    if family == "deepseek_v3":  # MLA: k and v per head; q/k head dim nope 16 + rope 8
        return HEADS // tp, HEADS // tp, 24
    return HEADS // tp, KV_HEADS // tp, DIM // HEADS if family == "llama3" else 16


def tp_collectives(family: str, tokens: int, tp: int) -> dict[str, tuple[int, int | None]]:
    """torchtitan's TP (with sequence parallelism) per step: op -> (count, input bytes per call).

    Per block, forward: an all-gather of the tp rank's share of the sequence
    in front of each tensor-parallel sub-block (attention; a dense MLP; an MoE
    keeps its routed tokens sharded), a reduce-scatter after it; backward the
    same reversed; each norm weight's (and router gate's) gradient
    all-reduced. Outside the blocks: the embedding's reduce-scatter and the
    final norm's all-gather (and their backward), its weight's all-reduce,
    and the vocab-parallel loss's three all-reduces.
    """
    sub_blocks = LAYERS * (1 if family in MOE_FAMILIES else 2)
    # attention and MLP norms; Qwen3's q/k norms; the MoE router's gate
    norms = LAYERS * {"llama3": 2, "qwen3": 4, "qwen3_moe": 5}[family]
    return {
        "all_gather_into_tensor": (2 * sub_blocks + 2, tokens // tp * DIM * 4),
        "reduce_scatter_tensor": (2 * sub_blocks + 2, tokens * DIM * 4),
        "all_reduce": (norms + 1 + 3, None),
    }


def collectives_by_mesh(counter, meshes: dict) -> dict[tuple[str, str], list]:
    """The counted collectives by (mesh dim, op). DTensor may reuse an equal mesh of an earlier
    case of the task (its groups are alive, the same ranks), so every case's groups are named."""
    names = {}
    for dims in meshes.values():
        for dim in ("cp", "tp", "ep"):
            mesh = dims.get_optional_mesh(dim)
            if mesh is not None:
                names[mesh.get_group().group_name] = dim
    out: dict[tuple[str, str], list] = {}
    for record in counter.records:
        out.setdefault((names.get(record.group_name, record.group_name), record.op), []).append(record)
    return out


def run_pipeline_case(world: int, case: dict, meshes: dict) -> dict:
    """pp x sp: torchtitan's ``pipeline_llm`` cuts the model, our parallelize function runs on each
    stage, torchtitan's schedule runs one step of ``BATCH`` micro-batches (one row each)."""
    import contextlib

    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.protocols.model_spec import ModelSpec

    from ulysses_dtensor.integrations.torchtitan._torch_compat import (
        ensure_microbatch_step,
    )
    from ulysses_dtensor.integrations.torchtitan.parallelize import ulysses_model_spec
    from ulysses_dtensor.integrations.torchtitan.sp_batch import shard_for_sp
    from ulysses_dtensor.parallel.comm_stats import CollectiveCounter

    family, attention, sp, pp = case["model"], case.get("attention", "sdpa"), case["sp"], case["pp"]
    degrees = (1, 1, sp, 1, 1, pp)
    if degrees not in meshes:
        meshes[degrees] = build_parallel_dims(world, *degrees)
    dims = meshes[degrees]
    ref = reference(family, attention, True)

    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor", context_parallel_load_balancer=None, pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=case["schedule"],
    )
    cfg = tiny_model_config(family, attention, parallelism)
    with torch.device("meta"):
        model = cfg.build()
    spec = ModelSpec(name=family, flavor="tiny", model=cfg, parallelize_fn=None, pipelining_fn=None,
                     post_optimizer_build_fn=None, state_dict_adapter=None)
    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32", local_batch_size=BATCH),
        parallelism=parallelism, compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="",
        device=torch.device("cpu"), model_config=cfg, parallelize_fn=ulysses_model_spec(spec).parallelize_fn,
        loss_fn=CrossEntropyLoss.Config().build(),
    )
    ensure_microbatch_step(schedule)
    for part in parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
            for name, p in part.named_parameters():
                full = ref["init"][canonical(name)]
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())

    inputs, labels, positions = global_batch(True)
    valid = (labels != -100).sum()
    args, kwargs, targets = [], [], []
    for row in range(BATCH):  # the trainer's micro-batches, each through the plug-in's sp slice
        local_in, local_lab, extra, _ = shard_for_sp(
            inputs[row:row + 1], labels[row:row + 1], {"positions": positions[row:row + 1]},
            model=parts[0], sp_mesh=dims.get_mesh("cp"),
        )
        args.append((local_in,))
        kwargs.append(extra)
        targets.append(local_lab)
    # Two steps: torch's first one also infers the stages' shapes (running
    # each stage once more); the second is the steady state, counted.
    for counter in (contextlib.nullcontext(), CollectiveCounter()):
        for part in parts:
            part.zero_grad()
        losses = [] if last else None
        with counter:
            schedule.step(arg_mbs=args if first else None, kwarg_mbs=kwargs, target_mbs=targets if last else None,
                          losses=losses, loss_kwargs={"global_valid_tokens": valid}, return_outputs=False)

    figures = {"case": case, "stage_layers": [len(part.layers) for part in parts]}
    if last:
        share = torch.stack(losses).sum()
        total = funcol.all_reduce(share, "sum", dims.get_mesh("loss").get_group()).wait().item()
        figures["loss_rel"] = abs(total - ref["loss"]) / abs(ref["loss"])
        assert figures["loss_rel"] < 1e-5, (case, total, ref["loss"])
    # this rank's stages: their parameters (the pp ranks together hold them all)
    grads = {canonical(n): p.grad.full_tensor() for part in parts for n, p in part.named_parameters()}
    figures["grad_abs"] = max((g - ref["grads"][n]).abs().max().item() for n, g in grads.items())
    for n, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][n], **GRAD_TOL, msg=lambda m: f"{case}: grad {n}: {m}")
    # Ulysses per layer of this rank's stages and micro-batch, nothing else (send / recv are not
    # functional collectives; FSDP's are not counted).
    layers = sum(len(part.layers) for part in parts)
    assert counter.counts() == ({"all_to_all_single": 8 * layers * BATCH} if layers else {}), (case, counter.counts())
    return figures


def parity_worker(rank: int, world: int, cases: list) -> list:
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    previous = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    try:
        out, meshes = [], {}
        for case in cases:
            t0 = time.perf_counter()
            figures = (run_pipeline_case if "pp" in case else run_case)(world, case, meshes)
            figures["s"] = round(time.perf_counter() - t0, 2)
            out.append(figures)
        return out
    finally:
        set_spmd_backend(previous)
        # torchtitan's AC turns dynamo's LRU cache off process-wide.
        torch._C._dynamo.eval_frame._set_lru_cache(True)


def _report(results: list) -> None:
    for figures in results[0]:
        print(figures)


def test_parity_sp2():
    results = run_ranks(2, parity_worker, [
        {"model": "llama3", "sp": 2},  # packed documents, kv heads split
        {"model": "qwen3", "sp": 2, "pack_qkv": True},
        {"model": "llama3", "sp": 2, "attention": "model", "docs": False},  # torchtitan's own SDPA
    ])
    _report(results)


def test_parity_sp4_dp2_sp2_hsdp():
    results = run_ranks(4, parity_worker, [
        {"model": "llama3", "sp": 4},  # kv heads 2 < sp 4: replicated
        {"model": "qwen3", "sp": 4, "ac": "selective"},
        {"model": "llama3", "dp_shard": 2, "sp": 2, "ac": "full"},
        {"model": "qwen3", "dp_shard": 2, "sp": 2},
        {"model": "qwen3", "dp_replicate": 2, "sp": 2, "pack_qkv": True},  # HSDP
    ])
    _report(results)


def test_parity_with_torchtitan_tp_ep_pp():
    """torchtitan's own TP plan, expert parallelism and pipeline schedules, each with our Ulysses on cp."""
    results = run_ranks(4, parity_worker, [
        {"model": "llama3", "sp": 2, "tp": 2},  # a tp rank's 1 kv head < sp 2: replicated
        # torchtitan's SDPA inside its local_map; Qwen3's q/k norms; sp slice 15 -> 16 for tp
        {"model": "qwen3", "sp": 2, "tp": 2, "attention": "model", "docs": False, "pack_qkv": True},
        {"model": "qwen3_moe", "sp": 2, "tp": 2, "ep": 2},
        {"model": "qwen3_moe", "dp_shard": 2, "sp": 2, "ep": 2},
        {"model": "deepseek_v3", "dp_shard": 2, "sp": 2, "ep": 2},  # MLA; layer 0 dense, layer 1 MoE
        {"model": "llama3", "sp": 2, "pp": 2, "schedule": "1F1B"},
        {"model": "llama3", "sp": 2, "pp": 2, "schedule": "InterleavedZeroBubble"},  # split backward
        {"model": "llama3", "sp": 2, "pp": 2, "schedule": "ZBVZeroBubble"},  # V: pp rank 1 holds both layers
    ])
    _report(results)


# ---------------------------------------------------------------------------
# Configs: stock torchtitan configs with Ulysses on; clear errors
# ---------------------------------------------------------------------------


def config_worker(rank: int, world: int) -> dict | None:
    """On rank 0 of a live gloo world (torchtitan already imported there): configs and their errors."""
    if rank != 0:
        return None
    import contextlib
    import dataclasses
    import io
    from types import SimpleNamespace

    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ulysses_dtensor.integrations.torchtitan import config_registry as registry
    from ulysses_dtensor.integrations.torchtitan.attention import (
        OVERRIDE_TARGET,
        UlyssesInnerAttention,
    )
    from ulysses_dtensor.integrations.torchtitan.metrics_processor import (
        max_loss_config,
    )
    from ulysses_dtensor.integrations.torchtitan.parallelize import parallelize_ulysses
    from ulysses_dtensor.integrations.torchtitan.trainer import (
        UlyssesConfig,
        UlyssesTorchtitanTrainer,
        prepare_config,
    )

    out: dict = {}
    module = ["--module", "ulysses_dtensor.integrations.torchtitan", "--config", "llama3_debugmodel_ulysses"]
    cfg = ConfigManager().parse_args(
        module + ["--ulysses.degree", "4", "--ulysses.attention_backend", "sdpa", "--ulysses.pack_qkv"]
    )
    stock = llama3_debugmodel()
    out["parsed"] = {
        "type": type(cfg).__qualname__,
        "ulysses": dataclasses.asdict(cfg.ulysses),
        "validator": type(cfg.validator).__qualname__,
        "spmd_backend": cfg.parallelism.spmd_backend,
        "load_balancer": cfg.parallelism.context_parallel_load_balancer,
        "cuda_graphs_off": cfg.training.disable_cuda_graphs,
        # Everything else is torchtitan's stock debug config.
        "stock_training": dataclasses.replace(cfg.training, disable_cuda_graphs=stock.training.disable_cuda_graphs)
        == stock.training,
        "stock_rest": all(
            getattr(cfg, f) == getattr(stock, f)
            for f in ("optimizer", "lr_scheduler", "dataloader", "activation_checkpoint", "loss")
        ),
        "stock_model": (cfg.model_spec.name, cfg.model_spec.flavor) == ("llama3", "debugmodel"),
    }

    # What UlyssesTorchtitanTrainer.__init__ does, then what torchtitan's Trainer.__init__
    # does with the override imports (before it builds the model).
    out["metrics"] = {  # torchtitan's stock metrics settings, in the Ulysses processor's config
        "type": type(cfg.metrics).__qualname__,
        "stock_fields": all(getattr(cfg.metrics, f.name) == getattr(stock.metrics, f.name)
                            for f in dataclasses.fields(stock.metrics)),
        # a hand-made config with torchtitan's own is converted too
        "converted": type(max_loss_config(stock.metrics)).__qualname__,
    }
    prepare_config(cfg)
    applied = apply_overrides(cfg.override, cfg)
    inner = [layer.attention.inner_attention for layer in cfg.model_spec.model.layers]
    fn = cfg.model_spec.parallelize_fn
    out["prepared"] = {
        "overrides": len(applied),
        "fqns_ok": all("model_spec.model.layers." in line for line in applied),
        "inner_ok": all(isinstance(i, UlyssesInnerAttention.Config) and i.backend == "sdpa" for i in inner),
        "parallelize_ok": fn.func is parallelize_ulysses and fn.keywords == {"pack_qkv": True},
    }
    out["registry"] = {}  # (ulysses.degree, torchtitan's tp, ep) of each config
    for name in registry.__all__:
        if name != "ulysses_config":
            made = getattr(registry, name)()
            out["registry"][name] = (made.ulysses.degree, made.parallelism.tensor_parallel_degree,
                                     made.parallelism.expert_parallel_degree)

    # torchtitan's ParallelDims with the Ulysses degree on its cp axis (this
    # world has 2 ranks; the process group exists, so nothing is initialised).
    base = registry.llama3_debugmodel_ulysses()
    dims = UlyssesTorchtitanTrainer.init_distributed(SimpleNamespace(config=base))
    out["dims"] = {"cp": dims.cp, "dp_shard": dims.dp_shard, "world": dims.world_size}

    def error(make) -> str:
        try:
            make()
        except (ValueError, NotImplementedError) as e:
            return str(e)
        return "no error"

    class OtherMetrics(MetricsProcessor):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

    par, train = base.parallelism, base.training
    out["errors"] = {
        "metrics": error(lambda: max_loss_config(OtherMetrics.Config())),
        "cp": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, context_parallel_degree=2))),
        "balancer": error(lambda: dataclasses.replace(
            base, parallelism=dataclasses.replace(par, context_parallel_load_balancer="headtail"))),
        "spmd": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, spmd_backend="spmd_types"))),
        "tp_heads": error(lambda: dataclasses.replace(
            base, ulysses=UlyssesConfig(degree=8), parallelism=dataclasses.replace(par, tensor_parallel_degree=4))),
        "tp_divides": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, tensor_parallel_degree=3))),
        "ep_dense": error(lambda: dataclasses.replace(base, parallelism=dataclasses.replace(par, expert_parallel_degree=2))),
        "seq_len_tp": error(lambda: dataclasses.replace(
            base, training=dataclasses.replace(train, seq_len=2044),
            parallelism=dataclasses.replace(par, tensor_parallel_degree=2))),
        "world_tp": error(lambda: UlyssesTorchtitanTrainer.init_distributed(SimpleNamespace(config=dataclasses.replace(
            base, parallelism=dataclasses.replace(par, tensor_parallel_degree=2))))),
        "heads": error(lambda: dataclasses.replace(base, ulysses=UlyssesConfig(degree=3))),
        "backend": error(lambda: UlyssesConfig(attention_backend="flash")),
        "cuda_graphs": error(lambda: dataclasses.replace(
            base, training=dataclasses.replace(train, disable_cuda_graphs=False))),
        "seq_len": error(lambda: dataclasses.replace(base, training=dataclasses.replace(train, seq_len=2046))),
        "override": error(lambda: dataclasses.replace(
            base, override=dataclasses.replace(base.override, imports=[OVERRIDE_TARGET]))),
        "world": error(lambda: UlyssesTorchtitanTrainer.init_distributed(
            SimpleNamespace(config=dataclasses.replace(base, ulysses=UlyssesConfig(degree=4))))),
    }
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.suppress(SystemExit):
        ConfigManager().parse_args(module + ["--parallelism.context_parallel_degree", "2"])
    out["cli_error"] = stderr.getvalue()
    return out


def test_configs_and_errors():
    out = run_ranks(2, config_worker)[0]
    parsed = out["parsed"]
    assert parsed["type"] == "UlyssesTorchtitanTrainer.Config"
    assert parsed["ulysses"] == {"degree": 4, "attention_backend": "sdpa", "pack_qkv": True}
    assert parsed["validator"] == "UlyssesValidator.Config"
    assert (parsed["spmd_backend"], parsed["load_balancer"], parsed["cuda_graphs_off"]) == ("partial_dtensor", None, True)
    assert parsed["stock_training"] and parsed["stock_rest"] and parsed["stock_model"], parsed
    assert out["prepared"] == {"overrides": 6, "fqns_ok": True, "inner_ok": True, "parallelize_ok": True}
    assert out["registry"] == {
        "llama3_debugmodel_ulysses": (2, 1, 1), "llama3_8b_ulysses": (8, 1, 1), "qwen3_debugmodel_ulysses": (2, 1, 1),
        "qwen3_1_7b_ulysses": (8, 1, 1), "qwen3_14b_ulysses": (8, 1, 1), "llama3_70b_ulysses": (4, 8, 1),
        "qwen3_moe_debug_ulysses": (2, 1, 1), "qwen3_30b_a3b_ulysses": (8, 1, 8),
        "deepseek_v3_debugmodel_ulysses": (2, 1, 1), "deepseek_v3_16b_ulysses": (8, 1, 8),
    }
    assert out["dims"] == {"cp": 2, "dp_shard": 1, "world": 2}
    assert out["metrics"] == {"type": "UlyssesMetricsProcessor.Config", "stock_fields": True,
                              "converted": "UlyssesMetricsProcessor.Config"}

    errors = out["errors"]
    expected = {
        "metrics": ["OtherMetrics.Config would log torchtitan's max loss", "UlyssesMetricsProcessor",
                    "MetricsProcessor.Config"],
        "cp": ["context_parallel_degree=2", "ulysses.degree"],
        "balancer": ["context_parallel_load_balancer='headtail'", "set it to None"],
        "spmd": ["spmd_backend='spmd_types'", "'partial_dtensor'"],
        "tp_heads": ["layers.0.attention under parallelism.tensor_parallel_degree x ulysses.degree", "tp=4", "the 4 heads and 4 kv heads of a tp rank over ulysses=8",
                     "valid sp for 4 heads: [1, 2, 4]"],
        "tp_divides": ["tp=3 must divide the heads (16) and the kv heads (16)", "valid tp: [1, 2, 4, 8, 16]"],
        "ep_dense": ["expert_parallel_degree=2", "no MoE layer", "qwen3 MoE, deepseek_v3"],
        "seq_len_tp": ["training.seq_len=2044", "(2 * ulysses.degree = 4) x (parallelism.tensor_parallel_degree = 2",
                       ") = 8", "2040 or 2048"],
        "world_tp": ["world size 2", "ulysses.degree=2 x tensor_parallel_degree=2"],
        "heads": ["ulysses.degree=3", "heads=16", "valid sp for 16 heads: [1, 2, 4, 8, 16]"],
        "backend": ["ulysses.attention_backend", "'flash'", "flash_attn"],
        "cuda_graphs": ["disable_cuda_graphs=False", "set training.disable_cuda_graphs=True"],
        "seq_len": ["training.seq_len=2046", "2 * ulysses.degree = 4: e.g. 2044 or 2048"],
        "override": [OVERRIDE_TARGET_NAME, "ulysses.attention_backend"],
        "world": ["world size 2", "ulysses.degree=4"],
    }
    for name, fragments in expected.items():
        for fragment in fragments:
            assert fragment in errors[name], (name, errors[name])
    assert "context_parallel_degree=2" in " ".join(out["cli_error"].split()), out["cli_error"]


OVERRIDE_TARGET_NAME = "ulysses_dtensor.integrations.torchtitan.attention.ulysses_inner_attention"


def test_torchtitan_version_errors(monkeypatch):
    from ulysses_dtensor.integrations import versions
    from ulysses_dtensor.integrations.torchtitan._requirements import (
        check_torchtitan_version,
    )

    monkeypatch.setattr(versions, "_found", {})
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    check_torchtitan_version("0.3.0")
    with pytest.raises(ImportError, match=r"needs torchtitan==0\.3\.0, which is not installed: pip install"):
        check_torchtitan_version(None)
    # Another version with the plug-in's hooks all there (this torchtitan's): a warning.
    with pytest.warns(versions.UntestedVersionWarning, match=r"torchtitan==0\.4\.0 is installed; .* tested with "
                      r"torchtitan==0\.3\.0"):
        check_torchtitan_version("0.4.0")
    # One gone: refused, by name (not an ImportError, which torchtitan's --module lookup would swallow).
    gone = versions.Member("torchtitan.trainer:Trainer.post_dataloading_process_gone")
    monkeypatch.setitem(versions.PRIVATE_MEMBERS, "torchtitan", {"plug-in": (gone,)})
    monkeypatch.setattr(versions, "_found", {})
    with pytest.raises(versions.UntestedVersionError, match=r"Trainer\.post_dataloading_process_gone \(gone\)"):
        check_torchtitan_version("0.4.0")


# ---------------------------------------------------------------------------
# torchtitan's trainer (CUDA): the launch of docs/torchtitan.md through our module
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torchtitan's trainer needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "model"])  # ours (flash_attn / varlen), torchtitan's flex
def test_gpu_trainer_through_our_module(backend):
    """torchrun -m torchtitan.train --module <ours>: sp N (GPUs, a power of 2 up to 8) follows sp 1 from one seed checkpoint."""
    nproc = 1 << (min(torch.cuda.device_count(), 8).bit_length() - 1)  # divides the debug model's 16 heads
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "torchtitan_check.py")
    done = subprocess.run(
        [sys.executable, script, "--nproc", str(nproc), "--bf16", "--steps", "3", "--attention-backend", backend],
        capture_output=True, text=True, timeout=3000,
    )
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

