"""DCP checkpoints: FSDP2 round trip, completeness marker, keep_latest_k."""

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_ranks
from ulysses_dtensor.trainer import checkpoint as ckpt_mod
from ulysses_dtensor.trainer.checkpoint import COMPLETE_MARKER, CheckpointManager, complete_steps


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _sharded(seed, mesh):
    from torch.distributed.fsdp import fully_shard

    m = _model(seed)
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp_round_trip(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _sharded(0, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        _step(model, opt, s)
    mgr = CheckpointManager(folder, interval=1, keep_latest_k=0)
    torch.manual_seed(100 + rank)
    rng_before = torch.get_rng_state()
    state = {"step": 2, "data": {"doc_index": 3}}
    mgr.save(2, model, opt, state)
    assert (mgr.path(2) / COMPLETE_MARKER).is_file()

    # A fresh, differently initialised model/optimizer, loaded from step 2.
    other = _sharded(1, mesh)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    torch.manual_seed(999)
    assert mgr.latest_step() == 2
    assert mgr.load(2, other, other_opt) == state
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(_full(p), _full(q)), n
    for p, q in zip(model.parameters(), other.parameters()):
        sp, sq = opt.state[p], other_opt.state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_full(sp[key]), _full(sq[key])), key
        assert float(sp["step"]) == float(sq["step"]) == 2
    # Both continue identically.
    _step(model, opt, 7)
    _step(other, other_opt, 7)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(_full(p), _full(q))
    dist.barrier()


def test_fsdp_save_load_round_trip(tmp_path):
    run_ranks(2, _fsdp_round_trip, str(tmp_path / "ckpt"))
    assert complete_steps(tmp_path / "ckpt") == [2]
    files = {p.name for p in (tmp_path / "ckpt" / "step-2").iterdir()}
    assert {".metadata", "train_state.json", "rng", COMPLETE_MARKER} <= files
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-2" / "rng").iterdir()) == [
        "rank0.pt", "rank1.pt"
    ]


def test_incomplete_checkpoint_ignored(tmp_path):
    folder = tmp_path / "ckpt"
    mgr = CheckpointManager(folder, interval=2)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    mgr.save(4, model, opt, {"step": 4})
    # A later save that died before the marker: renamed folder without it, and a .tmp.
    (folder / "step-6").mkdir()
    (folder / "step-6" / ".metadata").write_bytes(b"x")
    (folder / "step-8.tmp").mkdir()
    (folder / "step-8.tmp" / COMPLETE_MARKER).write_text("step 8\n")
    (folder / "notes").mkdir()
    assert complete_steps(folder) == [4]
    assert mgr.latest_step() == 4
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        mgr.load(6, model, opt)
    assert mgr.load(4, model, opt) == {"step": 4}


def test_kill_during_save_never_looks_complete(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    mgr = CheckpointManager(folder, interval=1)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    mgr.save(1, model, opt, {"step": 1})

    def killed(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ckpt_mod, "_fsync_write", killed)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, model, opt, {"step": 2})
    assert (folder / "step-2.tmp").is_dir() and not (folder / "step-2").exists()
    assert mgr.latest_step() == 1
    monkeypatch.undo()
    mgr.save(2, model, opt, {"step": 2})  # the stale .tmp is replaced
    assert complete_steps(folder) == [1, 2] and not (folder / "step-2.tmp").exists()


def test_keep_latest_k_and_interval(tmp_path):
    folder = tmp_path / "ckpt"
    mgr = CheckpointManager(folder, interval=3, keep_latest_k=2)
    assert [s for s in range(1, 11) if mgr.should_save(s, last_step=10)] == [3, 6, 9, 10]
    assert not CheckpointManager(folder, interval=3, enable=False).should_save(3, 10)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters())
    for step in (3, 6, 9, 10):
        mgr.save(step, model, opt, {"step": step})
    assert complete_steps(folder) == [9, 10]
    assert json.loads((folder / "step-10" / "train_state.json").read_text()) == {"step": 10}
