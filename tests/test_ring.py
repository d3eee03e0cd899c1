"""USP (Ulysses x ring) on CPU ranks: parity, exact bytes, layout, trainer, errors.

The central task runs on 8 gloo ranks and takes one AdamW step of the tiny GQA
Llama (8 heads, 2 kv heads) on packed documents with padding (30 tokens,
padded to 32; test_parallelize's batches) on every (ring, ulysses) of the
issue, FSDP2 over the rest: the loss, every gradient, the clipped norm and the
updated weights must equal one process's (each rank's shards against the same
parts of the reference). The same task counts the bytes of
one USP attention layer against :func:`usp_bytes_per_rank`.
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from test_parallelize import GRAD_TOL, LOSS_RTOL, PARAM_TOL, SEED, reference_shards, train
from torch.distributed.tensor.parallel import parallelize_module

from ulysses_dtensor.attention import LocalAttention, local_attention
from ulysses_dtensor.models.llama import Llama, llama_args
from ulysses_dtensor.models.llama_parallelize import parallelize_llama
from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.comm_stats import CollectiveCounter
from ulysses_dtensor.parallel.mesh import ParallelDims
from ulysses_dtensor.parallel.ring import (
    RingAttention,
    layout_indices,
    layout_position_ids,
    ring_attention,
    ring_bytes_per_rank,
    usp_bytes_per_rank,
)
from ulysses_dtensor.parallel.ulysses import UlyssesAttention

# (ring, ulysses, dp_shard) on 8 ranks: every pair the issue names, FSDP over the rest.
USP_MESHES = [(2, 1, 4), (1, 2, 4), (2, 2, 2), (4, 2, 1), (2, 4, 1)]


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
    model = Llama(llama_args("debug_gqa"))
    model.init_weights(SEED)
    return train(model, None, 1, record=True)


def _parity(world: int, ring: int, ulysses: int, dp_shard: int) -> dict:
    pmesh = ParallelDims(dp_shard=dp_shard, sp=ring * ulysses, ring=ring).build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(llama_args("debug_gqa"))
    parallelize_llama(model, pmesh)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    ref = _reference()
    out = train(model, pmesh, 1, record=True)  # shard_batch reads the ring layout off pmesh.sp
    what = f"ring {ring} x ulysses {ulysses} (dp_shard {dp_shard})"
    rel = max(abs(a - b) / abs(b) for a, b in zip(out["loss"], ref["loss"]))
    assert rel < LOSS_RTOL, (what, out["loss"], ref["loss"])
    torch.testing.assert_close(out["norm"], ref["norm"], rtol=1e-5, atol=0, msg=lambda m: f"{what}: norm {m}")
    assert set(out["grads"]) == set(ref["grads"])
    # train() records this rank's shards: compared with the same parts of the reference.
    grads, params = reference_shards(ref, model)
    for n, g in grads.items():
        torch.testing.assert_close(out["grads"][n], g, **GRAD_TOL, msg=lambda m: f"{what}: grad {n}: {m}")
    for n, p in params.items():
        torch.testing.assert_close(out["params"][n], p, **PARAM_TOL, msg=lambda m: f"{what}: param {n}: {m}")
    grad_abs = max((out["grads"][n] - g).abs().max().item() for n, g in grads.items())
    return {"ring": ring, "ulysses": ulysses, "dp_shard": dp_shard, "loss_rel": rel, "grad_abs": grad_abs}


def _bytes(ring: int, ulysses: int) -> dict:
    """One USP attention layer, fwd + bwd: counted bytes = formula; output = one process."""
    pmesh = ParallelDims(dp_shard=1, sp=ring * ulysses, ring=ring).build_mesh("cpu")
    b, seq, heads, kv, d = 2, 64, 8, 2, 4
    torch.manual_seed(0)
    full = [torch.randn(b, seq, h, d) for h in (heads, kv, kv)]
    pos = torch.cat([torch.arange(20), torch.arange(seq - 20)]).expand(b, seq)  # two documents
    local = shard_batch({"input_ids": torch.zeros(b, seq, dtype=torch.long), "position_ids": pos}, pmesh.sp)
    idx = layout_indices(seq, ring)
    mine = idx[pmesh.sp.get_local_rank() * seq // (ring * ulysses):][: seq // (ring * ulysses)]
    inputs = [t[:, mine].clone().requires_grad_() for t in full]
    attn = parallelize_module(LocalAttention("sdpa"), pmesh.ring, RingAttention())
    parallelize_module(attn, pmesh.ulysses, UlyssesAttention())
    with CollectiveCounter() as counter:
        out = attn(*inputs, document_ids=local["document_ids"])
        out.sum().backward()
    want = usp_bytes_per_rank(b, seq, heads, kv, d, ring, ulysses, 4)
    assert counter.sent_bytes() == want, (ring, ulysses, counter.sent_bytes(), want)
    # Ulysses: q, k, v, out and their gradients; ring: R-1 k/v blocks forward, R-1 + R backward.
    assert counter.counts() == {"all_to_all_single": 8 + 3 * ring - 2}, counter.counts()
    ref = local_attention(*full, backend="sdpa", document_ids=torch.cat([torch.zeros(20), torch.ones(seq - 20)]).long().expand(b, seq))
    torch.testing.assert_close(out, ref[:, mine], atol=1e-5, rtol=1e-5)
    ring_part = ring_bytes_per_rank(b, seq, max(kv // ulysses, 1), d, ring, 4)
    return {"ring": ring, "ulysses": ulysses, "sent_bytes": counter.sent_bytes(), "formula": want, "ring_part": ring_part}


def _random_documents(world: int) -> float:
    """Ring 8 alone, float64: random packed documents (long, short, repeated ids), causal or not."""
    mesh = ParallelDims(dp_shard=1, sp=world, ring=world).build_mesh("cpu").ring
    b, seq, heads, kv, d = 3, 16 * world, 4, 2, 4
    rank, worst = mesh.get_local_rank(), 0.0
    idx = layout_indices(seq, world)
    mine = idx[rank * 16 : (rank + 1) * 16]
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        full = [torch.randn(b, seq, h, d, generator=g, dtype=torch.float64) for h in (heads, kv, kv, heads)]
        cuts = torch.randint(1, seq, (b, [1, 8, 40][seed % 3]), generator=g)
        docs = torch.zeros(b, seq, dtype=torch.long)
        for row in range(b):
            for c in cuts[row].tolist():
                docs[row, c:] += 1
        docs = docs % 2 if seed % 2 else docs  # equal ids apart: each run is its own document
        for causal in (True, False):
            ref_in = [t.clone().requires_grad_() for t in full[:3]]
            ref = local_attention(*ref_in, backend="sdpa", causal=causal, document_ids=docs)
            ref.backward(full[3])
            local = [t[:, mine].clone().requires_grad_() for t in full[:3]]
            out = ring_attention(*local, mesh, causal=causal, document_ids=docs[:, idx])
            out.backward(full[3][:, mine])
            for got, want in zip([out, *(t.grad for t in local)], [ref, *(t.grad for t in ref_in)]):
                torch.testing.assert_close(got, want[:, mine], atol=1e-12, rtol=1e-12)
                worst = max(worst, (got - want[:, mine]).abs().max().item())
    return worst


def _usp_worker(rank: int, world: int, out_path: str) -> None:
    results = {"parity": [], "bytes": [], "ring8_documents_fp64_max_abs": _random_documents(world)}
    for ring, ulysses, dp_shard in USP_MESHES:
        t0 = time.perf_counter()
        res = _parity(world, ring, ulysses, dp_shard)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results["parity"].append(res)
    for ring, ulysses in ((4, 2), (2, 4)):
        results["bytes"].append(_bytes(ring, ulysses))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def test_usp_parity_and_bytes_8_ranks(tmp_path):
    out = os.path.join(tmp_path, "usp.json")
    run_ranks(8, _usp_worker, out)
    with open(out) as f:
        results = json.load(f)
    for r in results["parity"] + results["bytes"]:
        print(json.dumps(r))
    print(json.dumps({"ring8_documents_fp64_max_abs": results["ring8_documents_fp64_max_abs"]}))


# ---------------------------------------------------------------------------
# The trainer: same losses on meshes with and without a ring
# ---------------------------------------------------------------------------


def _write_corpus(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    words = ["ring", "ulysses", "node", "token", "block", "mesh", "shard", "head"]
    with open(path, "w") as f:
        for _ in range(120):
            n = int(torch.randint(2, 9, (1,), generator=g))
            text = " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))
            f.write(json.dumps({"text": text}) + "\n")


def _trainer_worker(rank: int, world: int, tmp: str) -> list:
    from ulysses_dtensor.trainer.config import parse_config
    from ulysses_dtensor.trainer.loop import train as run_training

    # (dp_shard, sp, ring, activation checkpointing): no sp; ring 2 x ulysses 2; dp 2 x ring 2
    meshes = [(4, 1, 1, "none"), (1, 4, 2, "none"), (2, 2, 2, "full")]
    losses = []
    for dp_shard, sp, ring, ac in meshes:
        cfg = parse_config({
            "job": {"dump_folder": os.path.join(tmp, f"run-{dp_shard}-{sp}-{ring}"), "seed": 3},
            "model": {"flavor": "debug_gqa", "attn_backend": "sdpa"},
            "training": {"steps": 2, "global_batch_size": 4, "seq_len": 64},
            "parallelism": {"dp_shard": dp_shard, "sp": sp, "ring": ring},
            "data": {"path": os.path.join(tmp, "corpus.jsonl")},
            "activation_checkpoint": {"mode": ac},
            "metrics": {"progress_bar": False, "log_freq": 100},
        })
        rows = run_training(cfg)
        if rank == 0:
            losses.append([r["loss"] for r in rows])
        dist.barrier()
    return losses


def test_trainer_losses_mesh_independent_with_ring(tmp_path):
    _write_corpus(os.path.join(tmp_path, "corpus.jsonl"))
    losses = run_ranks(4, _trainer_worker, str(tmp_path))[0]
    ref = losses[0]
    for got in losses[1:]:
        assert got == pytest.approx(ref, rel=1e-5), (got, ref)
    print(json.dumps({"losses": losses}))


# ---------------------------------------------------------------------------
# Layout, batch and config (one process)
# ---------------------------------------------------------------------------


def test_layout_is_mirrored_chunks_and_shard_batch_keeps_every_token():
    assert layout_indices(16, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    seq, sp, ring = 21, 4, 2  # padded to lcm(4, 4) = 24
    ids = torch.arange(100, 100 + seq).expand(2, seq)
    pos = torch.cat([torch.arange(9), torch.arange(seq - 9)]).expand(2, seq)
    parts = [shard_batch({"input_ids": ids, "position_ids": pos}, sp_rank=r, sp_size=sp, ring=ring) for r in range(sp)]
    plain = shard_batch({"input_ids": ids, "position_ids": pos})
    idx = layout_indices(24, ring)
    restore = torch.argsort(idx)
    for key in ("input_ids", "labels", "position_ids"):
        whole = torch.cat([p[key] for p in parts], dim=1)[:, restore]
        assert torch.equal(whole[:, :seq], plain[key]), key  # shifted before the reorder: nothing lost
    assert (torch.cat([p["labels"] for p in parts], dim=1)[:, restore][:, seq:] == -100).all()
    single = [shard_batch({"input_ids": ids}, sp_rank=r, sp_size=sp, ring=ring) for r in range(sp)]
    for r, part in enumerate(single):  # what the model uses when no position ids are given
        assert torch.equal(part["position_ids"][0], layout_position_ids(6, r, sp, ring)), r
    docs = parts[0]["document_ids"]
    assert torch.equal(docs[:, torch.argsort(idx)][:, :seq], plain["document_ids"])
    with pytest.raises(ValueError, match=r"not divisible by lcm\(sp=4, 2\*ring=4\)"):
        shard_batch({"input_ids": ids}, sp_rank=0, sp_size=sp, ring=ring, pad=False)
    with pytest.raises(ValueError, match=r"ring=3 must divide sp=4; valid: \[1, 2, 4\]"):
        shard_batch({"input_ids": ids}, sp_rank=0, sp_size=sp, ring=3)


def test_bad_ring_settings_are_clear_errors():
    from ulysses_dtensor.trainer.config import (
        ConfigError,
        parse_config,
        validate_config,
    )

    with pytest.raises(ValueError, match=r"parallelism.ring=3 must divide parallelism.sp=8 .*\[1, 2, 4, 8\]"):
        ParallelDims(sp=8, ring=3, world_size=8)

    def check(world, match, **sections):
        cfg = parse_config({"model": {"flavor": "debug_gqa"}, "training": {"global_batch_size": 8}, **sections})
        with pytest.raises(ConfigError, match=match):
            validate_config(cfg, world)

    check(8, r"parallelism: parallelism.ring=3 must divide", parallelism={"sp": 8, "ring": 3})
    check(16, r"parallelism.sp=16: .*parallelism.ring > 1 splits sp", parallelism={"sp": 16, "ring": 1})  # Ulysses alone: 8 heads
    check(4, r"seq_len=12 .*lcm\(sp=4, 2\*ring=8\) = 8",  # a multiple of sp, not of 2*ring
          parallelism={"sp": 4, "ring": 4}, training={"seq_len": 12, "global_batch_size": 8})
    check(8, r"attn_backend='flex'.*ring", parallelism={"sp": 8, "ring": 2}, model={"flavor": "debug_gqa", "attn_backend": "flex"})
    check(8, r"training.compile=true with parallelism.ring=2", parallelism={"sp": 8, "ring": 2},
          training={"compile": True, "global_batch_size": 8})
    with pytest.raises(ConfigError, match=r"parallelism.ring=0 must be >= 1"):
        parse_config({"parallelism": {"ring": 0}})
    # 16 ranks = ring 2 x ulysses 8: more sp ranks than the 8 heads allow Ulysses alone.
    cfg = parse_config({"model": {"flavor": "debug_gqa"}, "training": {"global_batch_size": 8},
                        "parallelism": {"sp": 16, "ring": 2}})
    dims = validate_config(cfg, 16)
    assert (dims.ring, dims.ulysses) == (2, 8)
