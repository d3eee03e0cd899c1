"""``save_attention``: full activation checkpointing that keeps the attention kernel's outputs.

What is proven here (CPU, gloo, our Llama; the transformers path is in
tests/test_hf_memory.py, the planner in tests/test_estimate.py):

* the kept ops are every attention kernel our backends run (each aten attention
  kernel this torch registers, varlen_attn's custom op, FlexAttention's
  higher-order op, which torch routes to the checkpoint modes);
* the private parts of torch's selective checkpoint that the host offload reads
  (the forward mode's ``storage`` and its entries) are what this torch has;
* at sp 2 with FSDP2, packed documents: loss and every gradient equal those of
  no AC and of full AC, eagerly and compiled, with and without host offload;
  the attention kernel runs once per layer per step (full AC: twice), the
  exchange's all-to-alls still run in the recompute, and offload moves the
  block inputs plus the kept outputs (exact bytes);
* ``save_attention`` without full AC is refused, by the library and the config.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_dtensor.memory.offload import HostOffloader, OffloadedCheckpointBlock
from ulysses_dtensor.memory.saved_attention import (
    KEPT_ATTENTION_OPS,
    AttentionKeeping,
    is_attention_kernel,
    keep_attention_contexts,
    op_name,
    take_kept_outputs,
)

# Registered attention ops that are not kernels to keep, and why.
NOT_KERNELS = {
    "aten::scaled_dot_product_attention": "composite: decomposes into the kernels below autograd",
    "aten::_scaled_dot_product_attention_math": "composite: the math fallback is many ops",
    "aten::_fused_sdp_choice": "picks a kernel, computes nothing",
    "aten::_flash_attention_forward_no_dropout_inplace": "writes into its out argument: a cache cannot replay a write",
    "aten::_native_multi_head_attention": "nn.MultiheadAttention's fast path, not run by any backend here",
    "aten::_triton_multi_head_attention": "legacy, not run by any backend here",
    "aten::_triton_scaled_dot_attention": "legacy, not run by any backend here",
}


class KernelCounter(TorchDispatchMode):
    """Attention kernel calls and all-to-alls that really run (a cached output is not a call)."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.kernels = 0
        self.a2a = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # count what compiled code runs, not what tracing does

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inner = func
        # Compiled graphs run a recomputed random op (SDPA's kernel takes a dropout seed) inside
        # these higher-order ops, which hide it from the mode: look inside.
        if op_name(func) == "higher_order::run_and_save_rng_state":
            inner = args[0]
        elif op_name(func) == "higher_order::run_with_rng_state":
            inner = args[1]
        if is_attention_kernel(inner):
            self.kernels += 1
        elif op_name(func) == "_c10d_functional::all_to_all_single":
            self.a2a += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------
# Which ops are kept
# ---------------------------------------------------------------------------


def test_kept_ops_cover_every_attention_kernel_of_this_torch():
    import torch.nn.attention.varlen  # registers torch_attn

    registered = {n for n in torch._C._dispatch_get_all_op_names() if "." not in n}
    kernels = {n for n in registered if n.startswith("aten::") and "attention" in n and "backward" not in n}
    assert kernels - set(NOT_KERNELS) <= KEPT_ATTENTION_OPS, kernels - set(NOT_KERNELS) - KEPT_ATTENTION_OPS
    assert "aten::_scaled_dot_product_cudnn_attention" in KEPT_ATTENTION_OPS  # the coming cudnn backend's op
    # Every aten name kept exists here (no misspelt name silently matching nothing).
    assert {n for n in KEPT_ATTENTION_OPS if n.startswith("aten::")} <= registered
    assert "torch_attn::_varlen_attn" in registered
    assert op_name(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) in KEPT_ATTENTION_OPS
    assert not is_attention_kernel(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def test_varlen_attn_dispatches_a_kept_op():
    """What torch's varlen_attn really calls below autograd (run on fake tensors: the
    kernel is CUDA-only) is a kept op."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.varlen import varlen_attn

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(op_name(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        q, k, v = (torch.randn(12, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        with Spy():
            out = varlen_attn(q, k, v, cu, cu, 7, 7)
    assert out.shape == q.shape
    assert [n for n in seen if n in KEPT_ATTENTION_OPS] == ["torch_attn::_varlen_attn"], seen


def test_varlen_attn_output_is_kept_and_its_gradients_exact():
    """torch's varlen_attn (its custom op and the autograd registered for it) under the
    checkpoint: kept in forward, not run again in the recompute, gradients exact. Its kernels
    are CUDA-only: per-document CPU kernels stand in for them while the test runs
    (tests/cuda_kernel_shims.py), under the op's own autograd."""
    import cuda_kernel_shims as shims
    from torch.nn.attention import varlen as V
    from torch.utils.checkpoint import checkpoint

    def forward_cpu(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, scale=None, window_size=None, *rest):
        return shims._varlen_cpu(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale)

    def backward_cpu(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale=None, window=None):
        return shims._varlen_backward_cpu(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale)

    for op, fn in ((V._varlen_attn, forward_cpu), (V._varlen_attn_backward, backward_cpu)):
        if "cpu" not in op._backend_fns:
            # Registered disabled (torch keeps a kernel registered after a disable disabled), so
            # only the `with` below enables it: the rest of the process sees torch's own op.
            op._disabled_kernel.add("cpu")
            op.register_kernel("cpu")(fn)

    class VarlenBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x, cu):
            q, k, v = self.qkv(x).view(-1, 3, 2, 8).unbind(1)  # (tokens, heads, head dim)
            a = V.varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0))
            return x + self.out(a.reshape(-1, 16))

    torch.manual_seed(0)
    block = VarlenBlock()
    x = torch.randn(12, 16, requires_grad=True)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)  # two documents
    with V._varlen_attn.set_kernel_enabled("cpu"), V._varlen_attn_backward.set_kernel_enabled("cpu"):
        block(x, cu).square().sum().backward()
        ref = _grads(block, x)
        for contexts, kernels in ((None, 2), (keep_attention_contexts, 1)):
            options = {"context_fn": contexts} if contexts else {}
            with KernelCounter() as count:
                checkpoint(block, x, cu, use_reentrant=False, **options).square().sum().backward()
            assert count.kernels == kernels, (contexts, count.kernels)
            for n, g in _grads(block, x).items():
                torch.testing.assert_close(g, ref[n], msg=n)
    with pytest.raises(RuntimeError):  # torch's own CPU path again: its kernel is CUDA-only
        V.varlen_attn(x.view(12, 2, 8), x.view(12, 2, 8), x.view(12, 2, 8), cu, cu, 7, 7)


def test_flex_attention_reaches_the_checkpoint_modes():
    """FlexAttention is a higher-order op: torch hands it to the selective checkpoint's
    modes (both), whose policy sees it by this name (flex has no backward on CPU, so the
    saving itself runs on GPUs only)."""
    from torch._higher_order_ops.flex_attention import flex_attention
    from torch.utils.checkpoint import (
        _CachedTorchDispatchMode,
        _CachingTorchDispatchMode,
    )

    assert op_name(flex_attention) == "higher_order::flex_attention" and is_attention_kernel(flex_attention)
    for mode in (_CachingTorchDispatchMode, _CachedTorchDispatchMode):
        assert mode in flex_attention.python_key_table, mode


# ---------------------------------------------------------------------------
# The selective checkpoint's storage, read by the host offload (private parts pinned)
# ---------------------------------------------------------------------------


class AttnBlock(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, d))


def _grads(module, x):
    out = {n: p.grad.clone() for n, p in module.named_parameters()}
    out["input"] = x.grad.clone()
    module.zero_grad()
    x.grad = None
    return out


def test_checkpoint_storage_layout_is_what_offload_reads():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = AttnBlock()
    x = torch.randn(2, 6, 16, requires_grad=True)
    block(x).square().sum().backward()
    ref = _grads(block, x)

    modes = []

    def contexts():
        modes[:] = keep_attention_contexts()
        return tuple(modes)

    with KernelCounter() as count:
        y = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
    assert count.kernels == 1
    kept = take_kept_outputs(modes[0].storage)
    # One kernel call kept: SDPA's CPU flash kernel's output (B, H, S, D) and log-sum-exp (B, H, S).
    assert kept.entries == 1
    assert [tuple(t.shape) for t in kept.tensors] == [(2, 2, 6, 8), (2, 2, 6)]
    tensors = kept.hand_over()
    storage_tensors = [leaf for per_op in modes[0].storage.values()
                       for entry in (per_op.values() if isinstance(per_op, dict) else per_op)
                       for leaf in torch.utils._pytree.tree_leaves(entry)
                       if isinstance(leaf, torch.Tensor) or isinstance(getattr(leaf, "val", None), torch.Tensor)]
    assert storage_tensors == []  # nothing of them is left in the storage
    kept.put_back([t.clone() for t in tensors])  # new tensors, as the host copies come back
    with KernelCounter() as count:
        y.square().sum().backward()
    assert count.kernels == 0  # the recompute read the kept output
    for n, g in _grads(block, x).items():
        torch.testing.assert_close(g, ref[n], msg=n)


def test_kept_outputs_are_read_from_the_list_layout_of_torch_2_11():
    """torch 2.11's storage (before pytorch#176455): a list of entries per op, each the op's
    outputs wrapped in _VersionWrapper; the recompute pops them in order and checks versions."""
    from collections import defaultdict

    from torch.utils.checkpoint import _VersionWrapper

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    outputs = [(torch.randn(2, 3), torch.randn(2)) for _ in range(2)]
    storage = defaultdict(list)
    for out in outputs:
        storage[op].append(torch.utils._pytree.tree_map(_VersionWrapper, out))
    kept = take_kept_outputs(storage)
    assert kept.entries == 2 and [t.data_ptr() for t in kept.hand_over()] == [
        t.data_ptr() for out in outputs for t in out]
    assert all(w.val is None for entry in storage[op] for w in entry)
    kept.put_back([t.clone() for out in outputs for t in out])
    for entry, out in zip(storage[op], outputs):  # as the recompute reads them
        for w, t in zip(entry, out):
            torch.testing.assert_close(w.get_val(False), t)


def test_offloader_brings_back_the_kept_outputs_with_the_block_input():
    torch.manual_seed(0)
    blocks = nn.ModuleList([AttnBlock() for _ in range(3)])
    x = torch.randn(2, 6, 16, requires_grad=True)

    def run(mods):
        h = x
        for m in mods:
            h = m(h)
        return h.square().mean()

    run(blocks).backward()
    ref = _grads(blocks, x)
    offloader, keep = HostOffloader(), AttentionKeeping()
    wrapped = [OffloadedCheckpointBlock(b, offloader, keep=keep) for b in blocks]
    for _ in range(2):  # the second step starts from a clean offloader
        with KernelCounter() as count:
            loss = run(wrapped)
            # Per block: its input (2, 6, 16), the kernel's output (2, 2, 6, 8) and lse (2, 2, 6), fp32.
            assert offloader.offloaded_bytes == 3 * 4 * (2 * 6 * 16 + 2 * 2 * 6 * 8 + 2 * 2 * 6)
            assert offloader.held == 3
            loss.backward()
        assert count.kernels == 3 and offloader.held == 0
        for n, g in _grads(blocks, x).items():
            torch.testing.assert_close(g, ref[n], msg=n)
    assert keep.check() is None and keep.kept == 6


def test_a_forward_that_keeps_nothing_warns_once():
    """The sdpa backend's explicit scores (soft-cap, sinks) are not one kernel: recomputed, said."""

    class Explicit(AttnBlock):
        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
            scores = torch.tanh(q @ k.transpose(-1, -2) / 4) * 4
            return x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))

    from ulysses_dtensor.models.llama_parallelize import _checkpoint

    keep = AttentionKeeping()
    model = nn.Sequential(*[_checkpoint(Explicit(), context_fn=keep.contexts) for _ in range(2)])
    keep.watch(model)
    x = torch.randn(1, 5, 16, requires_grad=True)
    with pytest.warns(UserWarning, match=r"save_attention: 2 checkpointed block forwards kept no attention.*"
                                         r"soft-capping or sinks"):
        model(x).sum().backward()
    model(x).sum().backward()  # once
    assert keep.kept == 0 and keep.problem is not None


# ---------------------------------------------------------------------------
# Our Llama at sp 2 with FSDP2, packed documents
# ---------------------------------------------------------------------------

LAYERS = 2
DIM, HEADS, KV_HEADS, ROWS, SEQ = 32, 4, 2, 2, 40
EAGER = {
    "full": dict(ac_mode="full"),
    "save": dict(ac_mode="full", save_attention=True),
    "save_offload": dict(ac_mode="full", save_attention=True, offload_activations=True),
}
# Compiled (aot_eager: the graphs inductor gets, run op by op, so the counter sees them):
# full AC's compiled recompute is counted too.
COMPILED = {
    "full_compiled": dict(ac_mode="full", compile=True, compile_backend="aot_eager"),
    "save_compiled": dict(ac_mode="full", save_attention=True, compile=True, compile_backend="aot_eager"),
    "save_offload_compiled": dict(ac_mode="full", save_attention=True, offload_activations=True, compile=True,
                                  compile_backend="aot_eager"),
}


def _step(pm, opts: dict, batch):
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import (
        count_valid_tokens,
        global_loss,
        sp_cross_entropy,
    )

    torch._dynamo.reset()
    with torch.device("meta"):
        model = Llama(llama_args("debug", dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                 vocab_size=128, ffn_dim=64))
    parallelize_llama(model, pm, **opts)
    model.to_empty(device="cpu")
    model.init_weights(0)
    local = shard_batch(batch, pm.sp)
    n_valid = count_valid_tokens(local["labels"], pm.loss)
    with KernelCounter() as fwd:
        logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
        loss = sp_cross_entropy(logits, local["labels"], num_valid_tokens=n_valid)
    with KernelCounter() as bwd:
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad.full_tensor()
             for n, p in model.named_parameters()}
    counts = {"kernels": fwd.kernels + bwd.kernels, "bwd_a2a": bwd.a2a, "fwd_a2a": fwd.a2a}
    return global_loss(loss, pm.loss), grads, counts, model


def _llama_worker(rank: int, world: int, cases: dict) -> dict:
    from ulysses_dtensor.parallel.mesh import ParallelDims

    pm = ParallelDims(sp=world).build_mesh("cpu")  # FSDP2 over the two sp ranks
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 128, (ROWS, SEQ), generator=g),
             "position_ids": torch.cat([torch.arange(15), torch.arange(25)]).expand(ROWS, SEQ)}  # two documents
    ref_loss, ref_grads, ref_counts, _ = _step(pm, {}, batch)
    assert ref_counts["kernels"] == LAYERS  # no AC: one forward kernel per layer
    out = {}
    for name, opts in cases.items():
        t0 = time.perf_counter()
        loss, grads, counts, model = _step(pm, opts, batch)
        counts["seconds"] = round(time.perf_counter() - t0, 2)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=name)
        assert grads.keys() == ref_grads.keys(), name
        for n, gr in grads.items():
            torch.testing.assert_close(gr, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")
        out[name] = counts
        if opts.get("offload_activations"):
            s_local, heads_local = SEQ // world, HEADS // world
            block_input = ROWS * s_local * DIM * 4
            # After the exchange: the kernel's output (B, H/sp, S, D) and lse (B, H/sp, S), fp32.
            kept = ROWS * heads_local * SEQ * (DIM // HEADS) * 4 + ROWS * heads_local * SEQ * 4
            assert model.offloader.offloaded_bytes == LAYERS * (block_input + kept), name
            assert model.offloader.held == 0, name
        if opts.get("save_attention"):
            assert model.attention_keeping.kept >= LAYERS and model.attention_keeping.problem is None, name
    return out


def _check_counts(cases: dict) -> None:
    from distributed import run_ranks

    counts = run_ranks(2, _llama_worker, cases)[0]
    print(counts)
    per_layer_a2a = 4  # q, k, v and the output
    for name in cases:
        # Full AC: the attention kernel runs twice per layer (forward, recompute); saved: once,
        # offloaded or not.
        assert counts[name]["kernels"] == (2 if name.startswith("full") else 1) * LAYERS, (name, counts[name])
        # The kernel's inputs are recomputed, the exchange with them: backward sends the four
        # all-to-alls of autograd plus the four of the recompute per layer, as under full AC.
        assert counts[name]["fwd_a2a"] == per_layer_a2a * LAYERS, (name, counts[name])
        assert counts[name]["bwd_a2a"] == 2 * per_layer_a2a * LAYERS, (name, counts[name])


def test_llama_save_attention_matches_no_ac_and_runs_attention_once():
    _check_counts(EAGER)


def test_llama_save_attention_compiled():
    _check_counts(COMPILED)


# ---------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ac_mode", ["none", "selective"])
def test_save_attention_needs_full_ac(ac_mode):
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama

    with torch.device("meta"):
        model = Llama(llama_args("debug"))
    with pytest.raises(ValueError, match=rf"^save_attention=True needs ac_mode='full' .*got ac_mode='{ac_mode}'$"):
        parallelize_llama(model, None, ac_mode=ac_mode, save_attention=True)


def test_config_refuses_save_attention_without_full_ac():
    from ulysses_dtensor.trainer.config import ConfigError, parse_config

    cfg = parse_config({"activation_checkpoint": {"mode": "full", "save_attention": True}})
    assert cfg.activation_checkpoint.save_attention
    for mode in ("none", "selective"):
        with pytest.raises(ConfigError, match=rf"activation_checkpoint.save_attention=true needs "
                                              rf"activation_checkpoint.mode='full' \(got '{mode}'\).*Set "
                                              rf"mode='full', or save_attention=false"):
            parse_config({"activation_checkpoint": {"mode": mode, "save_attention": True}})


def test_trainer_banner_says_what_is_kept_and_where():
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import _checkpointing_banner

    def banner(ac: dict, memory: dict | None = None) -> str:
        return _checkpointing_banner(parse_config({"activation_checkpoint": ac, "memory": memory or {}}))

    assert banner({"mode": "full"}) == "activation checkpointing full"
    assert banner({"mode": "full", "save_attention": True}) == (
        "activation checkpointing full; attention kernel outputs kept from forward, not recomputed (save_attention)")
    assert banner({"mode": "full", "save_attention": True}, {"offload_activations": True}).endswith(
        "(save_attention); layer inputs and kept attention outputs offloaded to host")
    assert banner({"mode": "selective"}).startswith("activation checkpointing selective (op:")
    assert banner({"mode": "none"}) == "activation checkpointing off"
