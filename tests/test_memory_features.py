"""Tiled MLP, tiled logits+loss and activation offload: same numbers, less memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ulysses_dtensor.memory.offload import HostOffloader, OffloadedCheckpointBlock
from ulysses_dtensor.memory.tiling import (
    TiledMLP,
    auto_loss_chunks,
    auto_num_tiles,
    tiled_sp_cross_entropy,
)
from ulysses_dtensor.parallel.loss import IGNORE_INDEX, sp_cross_entropy

DIM, FFN, VOCAB = 16, 64, 96


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


class SavedBytes:
    """Bytes autograd keeps for backward (what activation memory is made of)."""

    def __init__(self):
        self.total, self._seen = 0, set()

    def pack(self, t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in self._seen and t.device.type != "meta":
            self._seen.add(key)
            self.total += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


@pytest.mark.parametrize("num_tiles", [None, 1, 3, 8])
def test_tiled_mlp_matches_untiled(num_tiles):
    torch.manual_seed(0)
    mlp = SwiGLU()
    x = torch.randn(2, 40, DIM, requires_grad=True)
    ref = mlp(x)
    ref.backward(torch.ones_like(ref))
    ref_grads, ref_dx = _grads(mlp), x.grad.clone()
    mlp.zero_grad()
    x.grad = None
    out = TiledMLP(mlp, FFN, num_tiles)(x)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_dx)
    for n, g in _grads(mlp).items():
        torch.testing.assert_close(g, ref_grads[n], msg=n)


def test_tiled_mlp_saves_one_tile_of_intermediates():
    torch.manual_seed(0)
    mlp = SwiGLU()
    x = torch.randn(1, 512, DIM, requires_grad=True)
    with SavedBytes() as plain:
        mlp(x)
    with SavedBytes() as tiled:
        TiledMLP(mlp, FFN, num_tiles=8)(x)
    # Untiled keeps (seq, ffn) intermediates: w1 and w3 outputs and the silu
    # product: 3 * 512 * 64 floats, plus the (seq, dim) input. Tiled keeps only
    # the tile inputs, views of x: the (seq, dim) input. The ratio is what the
    # design predicts: (3*FFN + DIM) / DIM.
    seq_bytes = 512 * DIM * 4
    assert tiled.total == seq_bytes
    assert plain.total >= 3 * 512 * FFN * 4 + seq_bytes
    assert plain.total / tiled.total >= (3 * FFN + DIM) / DIM


def test_auto_num_tiles():
    assert auto_num_tiles(4096, 14336, 4096) == 4  # seq 4K on Llama-3-8B: 4 tiles
    assert auto_num_tiles(16, 64, 16) == 4
    assert auto_num_tiles(1, 64, 4096) == 1
    # Loss chunks: at most 1 GiB of float32 logits each (Llama-3's vocabulary: 2092 tokens).
    assert auto_loss_chunks(2092, 128256) == 1 and auto_loss_chunks(2093, 128256) == 2
    assert auto_loss_chunks(1, 128256) == 1


@pytest.mark.parametrize("num_chunks", [None, 1, 5])
def test_tiled_loss_matches_plain(num_chunks):
    torch.manual_seed(0)
    hidden = torch.randn(2, 30, DIM, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 30))
    labels[0, :7] = IGNORE_INDEX
    count = int((labels != IGNORE_INDEX).sum())
    ref = sp_cross_entropy(F.linear(hidden, weight), labels)
    ref.backward()
    ref_dh, ref_dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = tiled_sp_cross_entropy(hidden, weight, labels, count, num_chunks=num_chunks)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, ref_dh)
    torch.testing.assert_close(weight.grad, ref_dw)


def test_tiled_loss_never_keeps_logits():
    torch.manual_seed(0)
    hidden = torch.randn(1, 256, DIM, requires_grad=True)
    weight = torch.randn(VOCAB, DIM, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 256))
    with SavedBytes() as plain:
        sp_cross_entropy(F.linear(hidden, weight), labels)
    with SavedBytes() as tiled:
        tiled_sp_cross_entropy(hidden, weight, labels, 256, num_chunks=8)
    logits_bytes = 256 * VOCAB * 4
    assert plain.total >= logits_bytes  # plain keeps the (seq, vocab) logits
    assert tiled.total < logits_bytes / 3  # tiled keeps hidden, weight, labels views
    # hidden (256x16) + weight (96x16) + labels (256 int64) + the int64 token
    # count the sum is divided by: what the design predicts, no logits.
    assert tiled.total == 256 * DIM * 4 + VOCAB * DIM * 4 + 256 * 8 + 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = SwiGLU()

    def forward(self, x, scale):
        return x + scale * self.mlp(self.norm(x))


def test_offloaded_checkpoint_matches_plain_and_moves_block_inputs():
    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(3)])
    x0 = torch.randn(2, 24, DIM, requires_grad=True)

    def run(mods, x):
        for m in mods:
            x = m(x, scale=0.5)
        return x.square().mean()

    ref = run(blocks, x0)
    ref.backward()
    ref_grads, ref_dx = _grads(blocks), x0.grad.clone()
    blocks.zero_grad()
    x0.grad = None

    offloader = HostOffloader()
    wrapped = [OffloadedCheckpointBlock(b, offloader) for b in blocks]
    with SavedBytes() as saved:
        loss = run(wrapped, x0)
    # One block input per block went to the host; autograd itself keeps only
    # what the final loss needs (the last block's output), nothing per block.
    assert offloader.offloaded_bytes == 3 * x0.numel() * 4
    assert saved.total == x0.numel() * 4
    loss.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(x0.grad, ref_dx)
    for n, g in _grads(blocks).items():
        torch.testing.assert_close(g, ref_grads[n], msg=n)
    # A second step reuses the offloader from a clean state.
    blocks.zero_grad()
    run(wrapped, x0).backward()
    assert offloader.offloaded_bytes == 3 * x0.numel() * 4


class GatedBlock(nn.Module):
    """A block with a tensor keyword argument that needs a gradient (a per-layer
    input computed from trainable weights) and a side output recorded by a hook
    (as transformers records MoE router logits)."""

    def __init__(self):
        super().__init__()
        self.mlp = SwiGLU()
        self.gate = nn.Linear(DIM, 1)
        self.recorded: list = []
        self.gate.register_forward_hook(lambda mod, args, out: self.recorded.append(out))

    def forward(self, hidden_states, extra=None):
        return hidden_states + self.mlp(hidden_states + extra) * torch.sigmoid(self.gate(hidden_states))


def _offload_case(frozen_input: bool):
    torch.manual_seed(0)
    blocks = nn.ModuleList([GatedBlock() for _ in range(3)])
    embed = nn.Embedding(11, DIM)
    extra_w = nn.Parameter(torch.randn(DIM))
    ids = torch.randint(0, 11, (2, 9))
    embed.requires_grad_(not frozen_input)

    def run(mods):
        for b in blocks:
            b.recorded.clear()
        x = embed(ids)
        for i, m in enumerate(mods):
            kw = {"hidden_states": x} if i == 1 else {}  # transformers' keyword spelling too
            x = m(*(() if kw else (x,)), extra=extra_w * (i + 1), **kw)
        side = sum(r.square().sum() for b in blocks for r in b.recorded)
        return x.square().mean() + side

    params = [*blocks.parameters(), extra_w, *embed.parameters()]
    ref = run(blocks)
    ref_grads = torch.autograd.grad(ref, [p for p in params if p.requires_grad])
    offloader = HostOffloader()
    out = run([OffloadedCheckpointBlock(b, offloader) for b in blocks])
    assert offloader.held == 3
    got = torch.autograd.grad(out, [p for p in params if p.requires_grad])
    torch.testing.assert_close(out, ref)
    for g, r in zip(got, ref_grads):
        torch.testing.assert_close(g, r)
    assert offloader.held == 0  # every host copy was fetched back and dropped


@pytest.mark.parametrize("frozen_input", [False, True])
def test_offload_keeps_gradients_of_keywords_hooks_and_frozen_inputs(frozen_input):
    """Gradients reach a tensor keyword argument, a hook's side output and the
    parameters of blocks whose input needs no gradient (a frozen embedding)."""
    _offload_case(frozen_input)


def test_offload_releases_blocks_nothing_differentiates():
    offloader = HostOffloader()
    block = OffloadedCheckpointBlock(Block().requires_grad_(False), offloader)
    x = torch.randn(2, 5, DIM)
    for _ in range(3):  # steps: a copy no backward will fetch is not kept
        out = block(x, scale=1.0)
        assert not out.requires_grad and offloader.held == 0


# --- The features inside the Llama, under SP (sp=2) with FSDP2 -----------------

FEATURES = {
    "tiled_mlp": dict(tiled_mlp=True, mlp_tiles=3),
    "tiled_mlp_auto": dict(tiled_mlp=True),
    "tiled_loss": dict(tiled_loss=True, loss_chunks=4),
    "offload": dict(ac_mode="full", offload_activations=True),
    "offload_params": dict(offload_params=True),
    "all": dict(ac_mode="full", offload_activations=True, tiled_mlp=True, mlp_tiles=2, tiled_loss=True, loss_chunks=3,
                offload_params=True),
}


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _llama_step(pm, features: dict, batch, use_labels: bool):
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import count_valid_tokens, global_loss

    with torch.device("meta"):
        model = Llama(llama_args("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=64))
    parallelize_llama(model, pm, **features)
    model.to_empty(device="cpu")
    model.init_weights(0)
    local = shard_batch(batch, pm.sp)
    n_valid = count_valid_tokens(local["labels"], pm.loss)
    if use_labels:
        loss = model(local["input_ids"], local["position_ids"], local["document_ids"],
                     labels=local["labels"], num_valid_tokens=n_valid)
    else:
        logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
        loss = sp_cross_entropy(logits, local["labels"], num_valid_tokens=n_valid)
    loss.backward()
    grads = {_clean(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    return global_loss(loss, pm.loss), grads, model


def _features_worker(rank: int, world: int) -> None:
    from ulysses_dtensor.parallel.mesh import ParallelDims

    pm = ParallelDims(sp=world).build_mesh("cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 40), generator=g)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, 40)
    batch = {"input_ids": ids, "position_ids": pos}
    ref_loss, ref_grads, _ = _llama_step(pm, {}, batch, use_labels=False)
    for name, features in FEATURES.items():
        loss, grads, model = _llama_step(pm, features, batch, use_labels=True)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=name)
        assert grads.keys() == ref_grads.keys(), (name, sorted(grads), sorted(ref_grads))
        for n, g_ in grads.items():
            torch.testing.assert_close(g_, ref_grads[n], rtol=1e-4, atol=1e-6, msg=f"{name}: {n}")
        if features.get("offload_params"):
            # Every shard, and every gradient shard, is a host tensor under the policy.
            from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

            assert all(p.to_local().is_cpu and p.grad.to_local().is_cpu for p in model.parameters())
            groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
            groups = {id(g): g for g in groups if g is not None}.values()  # [norm, output] share one
            # embedding, 2 blocks, norm + output: every group offloads.
            assert len(groups) == 4 and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)
        if features.get("offload_activations"):
            # Both block inputs (B, S/sp, dim) fp32 went to the host.
            assert model.offloader.offloaded_bytes == 2 * (2 * 20 * 32 * 4)


def test_memory_features_match_plain_under_sp_and_fsdp():
    from distributed import run_ranks

    run_ranks(2, _features_worker)


def test_offload_needs_full_ac():
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama

    with torch.device("meta"):
        model = Llama(llama_args("debug"))
    with pytest.raises(ValueError, match=r"offload_activations=True needs ac_mode='full'.*ac_mode='none'"):
        parallelize_llama(model, None, offload_activations=True)
