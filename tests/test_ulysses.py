"""UlyssesAttention on CPU ranks: parity with one process, exact communication, errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from ulysses_dtensor.attention import LocalAttention, local_attention
from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.comm_stats import CollectiveCounter
from ulysses_dtensor.parallel.mesh import ParallelDims
from ulysses_dtensor.parallel.ulysses import (
    UlyssesAttention,
    exchange_bytes_per_rank,
    kv_replication,
)

# (heads, kv_heads, documents, padded_len) cases; each runs unpacked and packed.
B, D = 2, 4


def _cases(sp: int):
    cases = [
        ("mha", 8, 8, False, None),
        ("mqa", 8, 1, False, None),
        ("mha-docs", 8, 8, True, None),
        ("gqa-docs", 8, 2, True, None),
    ]
    if sp == 2:
        cases.append(("gqa-split", 8, 4, False, None))  # kv 4 % sp 2 == 0
    if sp >= 4:
        cases.append(("gqa-replicate", 8, 2, False, None))  # sp % kv 2 == 0
    cases.append(("padded", 8, 4 if sp == 2 else 2, False, 8 * sp - 3))
    return cases


def _documents(seq: int) -> torch.Tensor:
    # Two rows with different document layouts, boundaries inside shards.
    row0 = torch.tensor([0] * (seq // 3) + [1] * (seq - seq // 3))
    row1 = torch.tensor([0] * 5 + [1] * (seq // 2 - 5) + [2] * (seq - seq // 2))
    return torch.stack([row0, row1])


def _parity_worker(rank: int, world: int) -> None:
    sp = world
    mesh = ParallelDims(sp=sp).build_mesh("cpu").sp
    for name, heads, kv, docs, true_len in _cases(sp):
        seq = 8 * sp
        torch.manual_seed(0)
        q = torch.randn(B, seq, heads, D, dtype=torch.float64).float()
        k = torch.randn(B, seq, kv, D).float()
        v = torch.randn(B, seq, kv, D).float()
        grad_out = torch.randn(B, seq, heads, D)
        doc_ids = _documents(seq) if docs else None
        n = true_len or seq  # the real tokens; the rest is padding

        # Reference: one process, the real (unpadded) sequence.
        ref_in = [t[:, :n].clone().requires_grad_() for t in (q, k, v)]
        ref = local_attention(*ref_in, causal=True, document_ids=None if doc_ids is None else doc_ids[:, :n])
        ref.backward(grad_out[:, :n])

        for pack in (False, True):
            # Pad like shard_batch does, then take this rank's slice.
            sl = slice(rank * seq // sp, (rank + 1) * seq // sp)
            ins = [t.clone() for t in (q, k, v)]
            for t in ins:
                t[:, n:] = 0.0
            local = [t[:, sl].clone().requires_grad_() for t in ins]
            attn = parallelize_module(LocalAttention("sdpa"), mesh, UlyssesAttention(pack_qkv=pack))
            out = attn(*local, document_ids=doc_ids)
            g = grad_out.clone()
            g[:, n:] = 0.0
            out.backward(g[:, sl])

            real = slice(rank * seq // sp, min((rank + 1) * seq // sp, n))
            keep = real.stop - real.start
            msg = f"case={name} sp={sp} pack={pack} rank={rank}"
            torch.testing.assert_close(out[:, :keep], ref.detach()[:, real], atol=1e-5, rtol=1e-5, msg=msg)
            for got, want, label in zip(local, ref_in, "qkv"):
                torch.testing.assert_close(
                    got.grad[:, :keep], want.grad[:, real], atol=1e-5, rtol=1e-5, msg=f"{msg} d{label}"
                )


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_attention_parity_with_single_process(sp):
    run_ranks(sp, _parity_worker)


def _comm_worker(rank: int, world: int) -> None:
    mesh = ParallelDims(sp=world).build_mesh("cpu").sp
    seq = 16 * world
    for heads, kv in ((8, 8), (8, 2), (8, 1)):
        for pack in (False, True):
            torch.manual_seed(rank)
            local = [torch.randn(B, seq // world, h, D, requires_grad=True) for h in (heads, kv, kv)]
            attn = parallelize_module(LocalAttention("sdpa"), mesh, UlyssesAttention(pack_qkv=pack))
            with CollectiveCounter() as counter:
                attn(*local).sum().backward()
            # Forward: q, k, v (1 when packed) + output; backward: the same again.
            expected = 2 * (2 if pack else 4)
            assert counter.counts() == {"all_to_all_single": expected}, (heads, kv, pack, counter.counts())
            want = exchange_bytes_per_rank(B, seq, heads, kv, D, world, 4)
            assert counter.sent_bytes() == want, (heads, kv, pack, counter.sent_bytes(), want)
            # O(n d / P): the bytes leaving a rank shrink with P; nothing is gathered.
            assert counter.input_bytes() == want * world // (world - 1)


@pytest.mark.parametrize("sp", [2, 4])
def test_exchange_is_minimal_all_to_all(sp):
    run_ranks(sp, _comm_worker)


def _patterns_worker(rank: int, world: int) -> list[str]:
    """Window, soft-cap, sinks and a v head dim of its own through the exchange:
    parity (outputs, q/k/v and sink gradients) with one process, exact bytes."""
    sp = world
    mesh = ParallelDims(sp=sp).build_mesh("cpu").sp
    seq, heads, dv = 8 * sp, 8, 6
    sl = slice(rank * seq // sp, (rank + 1) * seq // sp)
    docs = _documents(seq)
    done = []
    # kv 2: replicated on sp 4, split on sp 2; kv 8: split.
    for kv, window, softcap, pack in ((2, 5, 2.0, False), (8, 3, None, True)):
        torch.manual_seed(1)
        full = [torch.randn(B, seq, h, d) for h, d in ((heads, D), (kv, D), (kv, dv))]
        sinks = torch.randn(heads)
        grad_out = torch.randn(B, seq, heads, dv)
        pattern = dict(window=window, softcap=softcap, scale=0.4)
        ref_in = [t.clone().requires_grad_() for t in (*full, sinks)]
        ref = local_attention(*ref_in[:3], document_ids=docs, sinks=ref_in[3], **pattern)
        ref.backward(grad_out)
        # The pattern matters here: without it the output differs.
        assert (ref - local_attention(*full, document_ids=docs)).abs().max() > 1e-2

        local = [t[:, sl].clone().requires_grad_() for t in full]
        my_sinks = sinks.clone().requires_grad_()
        attn = parallelize_module(
            LocalAttention("sdpa", scale=0.4, window=window, softcap=softcap), mesh, UlyssesAttention(pack_qkv=pack)
        )
        with CollectiveCounter() as counter:
            out = attn(*local, document_ids=docs, sinks=my_sinks)
            out.backward(grad_out[:, sl])
        msg = f"kv={kv} pack={pack} sp={sp}"
        torch.testing.assert_close(out, ref.detach()[:, sl], atol=1e-5, rtol=1e-5, msg=msg)
        for got, want, name in zip(local, ref_in, "qkv"):
            torch.testing.assert_close(got.grad, want.grad[:, sl], atol=1e-5, rtol=1e-5, msg=f"{msg} d{name}")
        # Each rank's sink gradient covers its own heads only; summed (as FSDP
        # sums gradients over ranks) they are the single-process gradient.
        per_rank = heads // sp
        mine = torch.zeros(heads, dtype=torch.bool)
        mine[rank * per_rank : (rank + 1) * per_rank] = True
        assert torch.count_nonzero(my_sinks.grad[~mine]) == 0, msg
        dist.all_reduce(my_sinks.grad, group=mesh.get_group())
        torch.testing.assert_close(my_sinks.grad, ref_in[3].grad, atol=1e-5, rtol=1e-5, msg=f"{msg} dsinks")
        want = exchange_bytes_per_rank(B, seq, heads, kv, D, sp, 4, v_head_dim=dv)
        assert counter.counts() == {"all_to_all_single": 2 * (2 if pack else 4)}, (msg, counter.counts())
        assert counter.sent_bytes() == want, (msg, counter.sent_bytes(), want)
        done.append(msg)
    # A sinks tensor that is not one value per query head is refused.
    try:
        attn(*local, sinks=torch.zeros(heads + 1))
    except ValueError as e:
        assert "sinks must have one entry per query head, shape (8,)" in str(e), e
    else:
        raise AssertionError("9 sinks for 8 heads were accepted")
    return done


@pytest.mark.parametrize("sp", [2, 4])
def test_patterns_and_mla_through_the_exchange(sp):
    assert len(run_ranks(sp, _patterns_worker)[0]) == 2


def _every_backend_worker(rank: int, world: int) -> None:
    # The CUDA-only kernels are replaced by the reference-backed fakes of
    # test_attention (this process is thrown away afterwards).
    import sys

    import test_attention as T
    import torch.nn.attention.varlen as varlen_mod

    from ulysses_dtensor.attention import select as S

    S.kernel_refusal = lambda *args, **kwargs: None
    varlen_mod.varlen_attn = T.fake_varlen_attn
    sys.modules["flash_attn"] = T._fake_flash_module()

    mesh = ParallelDims(sp=world).build_mesh("cpu").sp
    seq, heads, kv = 16 * world, 8, 2
    docs = _documents(seq)
    sl = slice(rank * seq // world, (rank + 1) * seq // world)
    torch.manual_seed(0)
    full = [torch.randn(B, seq, h, D) for h in (heads, kv, kv)]
    want = exchange_bytes_per_rank(B, seq, heads, kv, D, world, 4)
    reference = None
    for backend in ("sdpa", "auto", "flex", "varlen", "flash_attn"):
        # FlexAttention has no CPU backward: its exchange is checked forward only.
        backward = backend != "flex"
        for pack in (False, True):
            local = [t[:, sl].clone().requires_grad_(backward) for t in full]
            attn = parallelize_module(LocalAttention(backend), mesh, UlyssesAttention(pack_qkv=pack))
            with CollectiveCounter() as counter, torch.set_grad_enabled(backward):
                out = attn(*local, document_ids=docs)
                if backward:
                    out.sum().backward()
            per_pass = 2 if pack else 4
            msg = f"backend={backend} pack={pack}"
            assert counter.counts() == {"all_to_all_single": per_pass * (2 if backward else 1)}, (msg, counter.counts())
            assert counter.sent_bytes() == (want if backward else want // 2), (msg, counter.sent_bytes(), want)
            if reference is None:
                reference = out.detach()
            torch.testing.assert_close(out.detach(), reference, atol=1e-5, rtol=1e-5, msg=msg)


def test_exchange_volume_is_the_same_on_every_backend():
    # Packed documents, GQA: sdpa (dense mask), auto, flex (block mask, forward
    # only on CPU), varlen and flash_attn (cu_seqlens; CPU fakes of the kernels).
    run_ranks(2, _every_backend_worker)


def test_exchange_bytes_formula():
    # sp=4, MHA: 4 tensors of B*S/4*H*D floats, 3/4 leaves the rank, x2 for backward.
    assert exchange_bytes_per_rank(1, 1024, 8, 8, 64, 4, 2) == 2 * 4 * (256 * 8 * 64 * 2) * 3 // 4
    # MQA on sp=4: the single kv head is repeated to 4 before the exchange.
    assert exchange_bytes_per_rank(1, 1024, 8, 1, 64, 4, 2) == exchange_bytes_per_rank(1, 1024, 8, 4, 64, 4, 2)
    assert exchange_bytes_per_rank(1, 1024, 8, 8, 64, 1, 2) == 0
    # MLA: q, k carry head_dim, v and the output v_head_dim.
    mla = exchange_bytes_per_rank(1, 1024, 8, 8, 24, 4, 2, v_head_dim=16)
    assert mla == 2 * (256 * 8 * (24 + 24 + 16 + 16) * 2) * 3 // 4


def test_kv_replication_rules():
    assert kv_replication(8, 8, 4) == 1
    assert kv_replication(8, 4, 2) == 1
    assert kv_replication(8, 2, 4) == 2
    assert kv_replication(8, 1, 8) == 8
    with pytest.raises(ValueError, match=r"heads % sp == 0, got heads=6, kv_heads=6, sp=4"):
        kv_replication(6, 6, 4)
    with pytest.raises(ValueError, match=r"kv_heads=3 on sp=2 ranks \(heads=6\)"):
        kv_replication(6, 3, 2)


def _bad_input_worker(rank: int, world: int) -> None:
    mesh = ParallelDims(sp=world).build_mesh("cpu").sp
    attn = parallelize_module(LocalAttention("sdpa"), mesh, UlyssesAttention())
    # Heads not divisible by sp: every rank raises before any collective.
    q = torch.randn(1, 4, 6, 4)
    try:
        attn(q, q, q)
    except ValueError as e:
        assert "heads=6" in str(e) and "sp=4" in str(e), e
    else:
        raise AssertionError("heads=6 on sp=4 did not raise")
    # A sequence not divisible by sp reaching the style as a DTensor (uneven shards).
    full = torch.randn(1, 9, 8, 4)
    dq = distribute_tensor(full, mesh, [Shard(1)])
    try:
        attn(dq, dq, dq)
    except ValueError as e:
        assert "(1, 9, 8, 4)" in str(e) and "sp=4" in str(e), e
    else:
        raise AssertionError("seq 9 on sp=4 did not raise")
    # DTensor in, DTensor out with use_local_output=False; same values as local.
    even = distribute_tensor(torch.randn(1, 8, 8, 4), mesh, [Shard(1)])
    as_dt = parallelize_module(LocalAttention("sdpa"), mesh, UlyssesAttention(use_local_output=False))
    out = as_dt(even, even, even)
    assert tuple(out.placements) == (Shard(1),) and out.shape == (1, 8, 8, 4)
    torch.testing.assert_close(out.to_local(), attn(even.to_local(), even.to_local(), even.to_local()))
    # A multi-dim mesh is refused at apply time.
    world_mesh = ParallelDims(dp_shard=2, sp=2).build_mesh("cpu").mesh
    try:
        parallelize_module(LocalAttention("sdpa"), world_mesh["dp_shard", "sp"], UlyssesAttention())
    except ValueError as e:
        assert "1-D sp mesh" in str(e), e
    else:
        raise AssertionError("2-D mesh was accepted")
    # A ring (USP) refuses the patterns its merge of plain causal blocks cannot
    # express, naming the value, before any collective.
    from ulysses_dtensor.parallel.ring import RingAttention

    ring_mesh = ParallelDims(sp=4, ring=2).build_mesh("cpu").ring
    for kwargs, words in ((dict(window=16), "sliding window (window=16)"), (dict(softcap=30.0), "soft-capping (softcap=30.0)")):
        try:
            parallelize_module(LocalAttention("sdpa", **kwargs), ring_mesh, RingAttention())
        except ValueError as e:
            assert words in str(e) and "ring=1" in str(e), e
        else:
            raise AssertionError(f"ring accepted {kwargs}")
    ring = parallelize_module(LocalAttention("sdpa"), ring_mesh, RingAttention())
    try:
        ring(q, q, q, sinks=torch.zeros(6))
    except ValueError as e:
        assert "attention sinks (sinks=a (6,) tensor)" in str(e) and "ring=1" in str(e), e
    else:
        raise AssertionError("ring accepted sinks")
    dist.barrier()


def test_bad_input_raises_clear_errors():
    run_ranks(4, _bad_input_worker)


def test_bad_mesh_and_backend():
    with pytest.raises(ValueError, match=r"2\*2\*2 = 8 does not match world_size=4"):
        ParallelDims(dp_replicate=2, dp_shard=2, sp=2, world_size=4)
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by dp_replicate\*sp=1\*4"):
        ParallelDims(sp=4, world_size=6)
    with pytest.raises(ValueError, match=r"parallelism.sp=0"):
        ParallelDims(sp=0, world_size=4)
    with pytest.raises(ValueError, match=r"'sdpaa'.*sdpa"):
        LocalAttention("sdpaa")
    dims = ParallelDims(dp_replicate=2, sp=2, world_size=8)
    assert (dims.dp_shard, dims.dp, dims.fsdp) == (2, 4, 4)


class _Block(nn.Module):
    """Projections around the Ulysses attention, as a model would have them."""

    def __init__(self, dim: int, heads: int, kv: int):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.inner = LocalAttention("sdpa")

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd)
        k, v = self.wkv(x).view(b, s, 2, self.kv, self.hd).unbind(2)
        return self.wo(self.inner(q, k, v).reshape(b, s, -1))


def _graph_collectives(graphs) -> dict[str, int]:
    counts: dict[str, int] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "_c10d_functional" in str(node.target):
                name = node.target._overloadpacket.__name__
                if name != "wait_tensor":
                    counts[name] = counts.get(name, 0) + 1
    return counts


def _compile_worker(rank: int, world: int) -> None:
    from torch._dynamo.backends.common import aot_autograd

    mesh = ParallelDims(sp=world).build_mesh("cpu").sp
    torch.manual_seed(0)
    block = _Block(32, 8, 2)
    parallelize_module(block.inner, mesh, UlyssesAttention(pack_qkv=True))
    x = torch.randn(2, 16, 32)[:, rank * 16 // world : (rank + 1) * 16 // world]
    eager = block(x)
    eager.sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for p, g in zip(block.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g)
    # The traced forward and backward keep the minimal exchange: 2 packed
    # all-to-alls each way, no all-gather.
    assert len(graphs) == 2
    assert _graph_collectives(graphs) == {"all_to_all_single": 4}, _graph_collectives(graphs)
    # The counter the benchmarks use sees the compiled code's collectives too.
    with CollectiveCounter() as counter:
        compiled(x).sum().backward()
    assert len(graphs) == 2, "the counter made dynamo recompile"
    assert counter.counts() == {"all_to_all_single": 4}, counter.counts()
    assert counter.sent_bytes() == exchange_bytes_per_rank(2, 16, 8, 2, 4, world, 4)


def test_compile_fullgraph_matches_eager():
    run_ranks(2, _compile_worker)
