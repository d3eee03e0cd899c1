"""A tiny transformer trained one step with SP equals the single-process step.

The model is deliberately independent of `ulysses_dtensor.models` so this
pins the core (style + shard_batch + loss) on its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from ulysses_dtensor.attention import LocalAttention
from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.loss import IGNORE_INDEX, global_loss, sp_cross_entropy
from ulysses_dtensor.parallel.mesh import ParallelDims
from ulysses_dtensor.parallel.ulysses import UlyssesAttention

VOCAB, DIM, HEADS, KV = 64, 32, 8, 2


def _rope(x, pos):
    # x: (B, S, H, D); pos: (B, S) global positions.
    half = x.shape[-1] // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    ang = pos[..., None].float() * inv  # (B, S, half)
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, KV * self.hd, bias=False)
        self.wv = nn.Linear(DIM, KV * self.hd, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.inner = LocalAttention("sdpa")
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, pos, doc):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = _rope(self.wq(h).view(b, s, HEADS, self.hd), pos)
        k = _rope(self.wk(h).view(b, s, KV, self.hd), pos)
        v = self.wv(h).view(b, s, KV, self.hd)
        x = x + self.wo(self.inner(q, k, v, document_ids=doc).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, pos, doc):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, pos, doc)
        return self.head(x)


def _global_batch(n_rows: int, seq: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n_rows, seq), generator=g)
    # Packed documents: boundaries at different places per row.
    pos = torch.cat(
        [torch.cat([torch.arange(7 + r), torch.arange(seq - 7 - r)]).view(1, seq) for r in range(n_rows)]
    )
    labels = ids.clone()
    labels[:, 2] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _reference(batch):
    torch.manual_seed(0)
    model = Tiny()
    sb = shard_batch(batch)
    logits = model(sb["input_ids"], sb["position_ids"], sb["document_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), sb["labels"].flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _train_worker(rank: int, world: int, dp: int, seq: int) -> None:
    sp = world // dp
    pm = ParallelDims(dp_shard=dp, sp=sp).build_mesh("cpu")
    batch = _global_batch(2 * dp, seq)
    ref_loss, ref_grads = _reference(batch)

    torch.manual_seed(0)
    model = Tiny()
    for layer in model.layers:
        parallelize_module(layer.inner, pm.sp, UlyssesAttention())
    # Each dp rank takes its contiguous share of the global batch; the sp ranks
    # of a group take the same rows and shard them.
    rows = slice(pm.dp_rank * 2, (pm.dp_rank + 1) * 2)
    local = shard_batch({k: v[rows] for k, v in batch.items()}, pm.sp)
    logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
    loss = sp_cross_entropy(logits, local["labels"], pm.loss)
    loss.backward()
    # Parameters are replicated here (no FSDP): shares are summed, never averaged.
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    torch.testing.assert_close(global_loss(loss, pm.loss), ref_loss, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"grad {name} rank {rank}")


@pytest.mark.parametrize(
    "world,dp,seq",
    [(2, 1, 32), (4, 1, 30), (4, 2, 32)],
    ids=["sp2", "sp4-padded", "dp2xsp2"],
)
def test_tiny_transformer_step_matches_single_process(world, dp, seq):
    run_ranks(world, _train_worker, dp, seq)


def _zero_valid_worker(rank: int, world: int) -> None:
    pm = ParallelDims(sp=world).build_mesh("cpu")
    torch.manual_seed(0)
    logits = torch.randn(1, 16, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, 16))
    labels[:, 8:] = IGNORE_INDEX  # rank 1's slice (tokens 8..15) has no valid target
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    sl = slice(rank * 8, (rank + 1) * 8)
    local_logits = logits.detach()[:, sl].clone().requires_grad_()
    loss = sp_cross_entropy(local_logits, labels[:, sl], pm.loss)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(local_logits.grad).all()
    if rank == 1:
        assert loss.item() == 0.0 and (local_logits.grad == 0).all()
    torch.testing.assert_close(global_loss(loss, pm.loss), ref.detach())
    # A global batch with no target at all: 0, not NaN.
    empty = sp_cross_entropy(local_logits, torch.full((1, 8), IGNORE_INDEX), pm.loss)
    assert empty.item() == 0.0


def test_rank_with_no_valid_token_contributes_zero():
    run_ranks(2, _zero_valid_worker)


def test_loss_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\) and labels \(2, 4\) disagree"):
        sp_cross_entropy(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))
