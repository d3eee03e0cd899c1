"""The disk tier of offloaded activations (``offload_dir``): the same bytes come back.

What is proven here (CPU, gloo, float32):

* one process: checkpointed blocks keeping their attention outputs give losses and
  gradients equal (torch.equal) to host offload over two steps, with the default staging
  area and with one smaller than a single tensor (every tensor streams through it); the
  staging bytes held never exceed the stated size, the offloader holds no other tensor
  between forward and backward, the file holds one step's bytes and is reused;
* the planner's fake tensors and ``host_device="meta"`` count the bytes and touch no disk;
* refusals, each one message naming the setting, the bytes needed and the bytes free: a
  missing directory, a file, one where no file can be made, too little space (library and
  trainer), a disk that fills mid-run (``ENOSPC``, also while the forward waits for staging);
* no file is left in the directory: after a run, and after a process using it is SIGKILLed;
* parity with host offload on dp_shard 2 x sp 2, sp 4 and ring 2 x ulysses 2 (our Llama:
  save_attention, head chunks, packed documents, 2 steps; every loss and gradient shard
  equal), and the transformers path on dp_shard 2 x sp 2;
* the trainer (ours and model.implementation = "transformers") and UlyssesHFTrainer: every
  logged loss (and the trainer's gradient norm) equal to the host-offload run's; the trainer
  stopped by a full disk keeps its last checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ulysses_dtensor.memory.disk_offload import DiskStore, staging_chunk, staging_size
from ulysses_dtensor.memory.offload_dir import OffloadDirError, check_offload_dir, open_unlinked
from ulysses_dtensor.memory.offload import HostOffloader, OffloadedCheckpointBlock
from ulysses_dtensor.memory.saved_attention import AttentionKeeping

REPO = Path(__file__).resolve().parents[1]
# Per block of the tests below: its input (2, 6, 16), the kept kernel output (2, 2, 6, 8) and lse (2, 2, 6), fp32.
BLOCK_BYTES = 4 * (2 * 6 * 16 + 2 * 2 * 6 * 8 + 2 * 2 * 6)


def _blocks():
    from test_save_attention import AttnBlock

    torch.manual_seed(0)
    return nn.ModuleList([AttnBlock() for _ in range(3)]), torch.randn(2, 6, 16, requires_grad=True)


def _steps(blocks, x, offloader, steps=2, between=None):
    """Per step: the loss and every gradient (the blocks' and the input's)."""
    wrapped = [OffloadedCheckpointBlock(b, offloader, keep=AttentionKeeping()) for b in blocks]
    out = []
    for _ in range(steps):
        h = x
        for m in wrapped:
            h = m(h)
        loss = h.square().mean()
        if between is not None:
            between(offloader)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]))
        blocks.zero_grad()
        x.grad = None
    return out


def _tensors_held(offloader) -> int:
    return sum(isinstance(t, torch.Tensor) for s in offloader._slots for t, _ in s.get("host", ()))


@pytest.mark.parametrize("staging", [None, 300])
def test_disk_gives_the_host_offload_bytes_within_the_staging_bound(tmp_path, staging):
    blocks, x = _blocks()
    ref = _steps(blocks, x, HostOffloader())
    store = DiskStore(str(tmp_path), staging_bytes=staging)
    offloader = HostOffloader(disk=store)
    seen = []
    got = _steps(blocks, x, offloader, between=lambda o: seen.append((_tensors_held(o), o.held)))
    for (loss, grads), (ref_loss, ref_grads) in zip(got, ref):
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    # Between forward and backward the offloader holds 3 blocks, as records: no tensor of its own.
    assert seen == [(0, 3), (0, 3)]
    assert offloader.offloaded_bytes == store.disk_bytes == 3 * BLOCK_BYTES
    assert os.fstat(store._io.fd).st_size == 3 * BLOCK_BYTES  # the second step wrote over the first
    assert store.bytes_written == store.bytes_read == 2 * 3 * BLOCK_BYTES
    # The staging area: two layers (a block's input and kept outputs), or the size asked for,
    # all allocated; the bytes held at once never more.
    want = staging_size(BLOCK_BYTES, staging_chunk(2 * 6 * 16 * 4)) if staging is None else staging
    assert store.staging_bytes == store._io.staging.allocated == sum(t.numel() for t in store._io.staging.tensors)
    assert want - store._io.staging.chunk < store.staging_bytes <= want
    assert 0 < store.staging_peak_bytes <= store.staging_bytes
    assert os.listdir(tmp_path) == []
    offloader.close()
    store._io.thread.join(5)
    assert not store._io.thread.is_alive()


def test_fake_and_meta_tensors_count_bytes_and_touch_no_disk(tmp_path):
    """The planner's two conventions: fake tensors (FakeTensorMode) and host_device='meta'. The
    directory does not exist: any file I/O or check would raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    missing = str(tmp_path / "not-there")
    blocks, x = _blocks()
    fake = HostOffloader(disk=DiskStore(missing))
    with FakeTensorMode(allow_non_fake_inputs=True):
        _steps(blocks, torch.randn(2, 6, 16, requires_grad=True), fake, steps=1)
    meta = HostOffloader(host_device="meta", disk=DiskStore(missing))
    _steps(blocks, x, meta, steps=1)
    for offloader in (fake, meta):
        assert offloader.disk._io is None and offloader.held == 0
        assert offloader.disk_bytes == 3 * BLOCK_BYTES
        assert offloader.staging_bytes == staging_size(BLOCK_BYTES, staging_chunk(2 * 6 * 16 * 4))
    assert not os.path.exists(missing)


def test_unusable_directories_and_too_little_space_are_refused(tmp_path, monkeypatch):
    import ulysses_dtensor.memory.offload_dir as disk

    free = disk.free_bytes(str(tmp_path))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for path, problem in ((tmp_path / "nope", "no such directory"), (a_file, "not a directory")):
        with pytest.raises(OffloadDirError) as e:
            check_offload_dir(str(path), 1000)
        assert str(e.value).startswith(f"offload_dir={str(path)!r}: {problem}; the offloaded activations need "
                                       f"1,000 bytes (0.00 GiB) there, ")
        assert "are free" in str(e.value)
    def no_file(directory):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disk, "open_unlinked", no_file)
    with pytest.raises(OffloadDirError, match=r"cannot create a file there \(Permission denied\)"):
        check_offload_dir(str(tmp_path), 1000, key="memory.offload_dir")
    monkeypatch.undo()

    class Full:
        f_bavail, f_frsize = 1, 512  # one block of 512 bytes

    monkeypatch.setattr(disk.os, "statvfs", lambda p: Full)
    with pytest.raises(OffloadDirError) as e:
        check_offload_dir(str(tmp_path), 1 << 20)
    assert str(e.value) == (f"offload_dir={str(tmp_path)!r}: too little free space; the offloaded activations need "
                            "1,048,576 bytes (0.00 GiB) there, 512 bytes (0.00 GiB) are free (leave offload_dir "
                            "unset to keep them in host memory)")
    # The library: refused at the first block's offload, before any byte is written.
    blocks, x = _blocks()
    offloader = HostOffloader(disk=DiskStore(str(tmp_path)))
    with pytest.raises(OffloadDirError, match=r"too little free space; .* need 2,304 bytes .*, 512 bytes"):
        _steps(blocks, x, offloader, steps=1)  # at least 3 block inputs of 768 bytes
    assert offloader.disk._io is None and free > 0


def test_a_full_disk_mid_run_stops_with_the_message(tmp_path, monkeypatch):
    """ENOSPC on the 5th write: the forward (waiting for staging chunks the writer frees) or the
    backward raises one OffloadDirError; nothing hangs, the thread ends, no file is left."""
    calls = []
    real = os.pwrite

    def full_after_four(fd, data, offset):
        calls.append(offset)
        if len(calls) > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_after_four)
    blocks, x = _blocks()
    store = DiskStore(str(tmp_path), staging_bytes=300, key="memory.offload_dir")
    with pytest.raises(OffloadDirError) as e:
        _steps(blocks, x, HostOffloader(disk=store), steps=1)
    # Needed: the most known when it stopped (the blocks' inputs, or the bytes queued so far in this step).
    assert re.fullmatch(re.escape(f"memory.offload_dir={str(tmp_path)!r}: the disk filled during the run (No space "
                                  "left on device); the offloaded activations need ") + r"[\d,]+ bytes \(0\.00 GiB\) "
                        r"there, [\d,]+ bytes \([\d.]+ GiB\) are free \(leave memory\.offload_dir unset to keep them "
                        r"in host memory\)", str(e.value)), str(e.value)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    store.close()
    store._io.thread.join(5)
    assert not store._io.thread.is_alive() and os.listdir(tmp_path) == []


def test_no_file_outlives_a_killed_process(tmp_path, monkeypatch):
    """A forked process offloads (its file has bytes on disk, in this directory), then SIGKILLs
    itself: the directory is empty. Also where O_TMPFILE is missing (a named file, unlinked)."""
    for tmpfile in (True, False):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns to pytest
            try:
                os.close(r)
                if not tmpfile:
                    real_open = os.open
                    os.open = lambda p, flags, *a: (_ for _ in ()).throw(OSError(errno.EOPNOTSUPP, "no")) \
                        if flags & os.O_TMPFILE == os.O_TMPFILE else real_open(p, flags, *a)
                store = DiskStore(str(tmp_path))
                store.new_step(4096, 4096)
                store.put(torch.arange(1024, dtype=torch.float32))
                store._io.drain()
                fd = store._io.fd
                os.write(w, f"{os.readlink(f'/proc/self/fd/{fd}')}|{os.fstat(fd).st_size}".encode())
            finally:
                os.kill(os.getpid(), signal.SIGKILL)
        os.close(w)
        with os.fdopen(r) as pipe:
            link = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        path, size = link.split("|")
        assert path.startswith(str(tmp_path)) and path.endswith("(deleted)") and int(size) == 4096, link
        assert os.listdir(tmp_path) == []
    fd = open_unlinked(str(tmp_path))
    os.close(fd)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# Parity with host offload on the meshes (one launch of 4 ranks)
# ---------------------------------------------------------------------------

SAVED_CHUNKED = {"ac_mode": "full", "save_attention": True, "offload_activations": True, "head_chunks": 2}
STEPS = 2


def _llama_steps(pmesh, opts: dict) -> tuple[list, list, dict]:
    """STEPS SGD steps of the debug Llama (8 heads, 2 kv heads) on packed documents: the losses,
    this rank's gradient shards per step, and the offloader's byte counts."""
    import test_parallelize as tp

    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama
    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import sp_cross_entropy

    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(llama_args("debug_gqa"))
    parallelize_llama(model, pmesh, **opts)
    model.to_empty(device="cpu")
    model.init_weights(tp.SEED)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    per = tp.GLOBAL_BATCH // pmesh.dims.dp
    losses, grads, offloaded = [], [], []
    for step in range(STEPS):
        batch = tp.global_batch(step, model.args.vocab_size)
        batch = {k: v[pmesh.dp_rank * per:(pmesh.dp_rank + 1) * per] for k, v in batch.items()}
        local = shard_batch(batch, pmesh.sp)
        logits = model(local["input_ids"], local["position_ids"], local["document_ids"])
        loss = sp_cross_entropy(logits, local["labels"], pmesh.loss)
        loss.backward()
        losses.append(loss.detach().clone())
        offloaded.append(model.offloader.offloaded_bytes)
        grads.append({tp.canonical(n): p.grad.to_local().clone() for n, p in model.named_parameters()})
        sgd.step()
        sgd.zero_grad()
    off = model.offloader
    info = {"offloaded": offloaded, "disk": off.disk_bytes, "staging": off.staging_bytes,
            "seconds": round(time.perf_counter() - t0, 1)}
    off.close()
    return losses, grads, info


def _mesh_parity(pmesh, where: str, directory: str) -> dict:
    host_losses, host_grads, host = _llama_steps(pmesh, SAVED_CHUNKED)
    disk_losses, disk_grads, disk = _llama_steps(pmesh, {**SAVED_CHUNKED, "offload_dir": directory})
    assert all(torch.equal(a, b) for a, b in zip(disk_losses, host_losses)), (where, disk_losses, host_losses)
    for step, (got, want) in enumerate(zip(disk_grads, host_grads)):
        assert got.keys() == want.keys()
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, (where, step, bad)
    # The file holds the largest step (ring steps keep more or fewer kernel outputs by the documents).
    assert disk["offloaded"] == host["offloaded"] and disk["disk"] == max(disk["offloaded"]) > 0, (where, disk, host)
    return {"mesh": where, **disk, "steps": len(disk_losses)}


def _parity_worker(rank: int, world: int, root: str) -> list[dict]:
    import test_hf_memory as hm
    from distributed import destroy_subgroups
    from test_hf_integration import registry_restored

    from ulysses_dtensor.parallel.mesh import ParallelDims

    directory = os.path.join(root, f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    rows = []
    pmesh = ParallelDims(1, 2, 2).build_mesh("cpu")
    rows.append(_mesh_parity(pmesh, "dp_shard 2 x sp 2", directory))
    # The transformers path (tiny Llama, packed documents): one step, every full gradient.
    with registry_restored():
        opts = {"ac_mode": "full", "save_attention": True, "offload_activations": True}
        host_loss, host_grads, host = hm._run("llama", pmesh, opts)
        disk_loss, disk_grads, disk = hm._run("llama", pmesh, {**opts, "offload_dir": directory})
    assert disk_loss == host_loss and disk["offloaded"] == host["offloaded"] > 0 and disk["held"] == 0
    assert host_grads.keys() == disk_grads.keys()
    assert all(torch.equal(disk_grads[n], g) for n, g in host_grads.items())
    rows.append({"mesh": "dp_shard 2 x sp 2, transformers llama", "offloaded": disk["offloaded"]})
    destroy_subgroups()
    rows.append(_mesh_parity(ParallelDims(sp=4).build_mesh("cpu"), "sp 4", directory))
    destroy_subgroups()
    rows.append(_mesh_parity(ParallelDims(sp=4, ring=2).build_mesh("cpu"), "ring 2 x ulysses 2", directory))
    assert os.listdir(directory) == []
    return rows


def test_disk_equals_host_offload_on_every_mesh(tmp_path):
    from distributed import run_ranks

    rows = run_ranks(4, _parity_worker, str(tmp_path))[0]
    for r in rows:
        print(r)
    assert [r["mesh"] for r in rows] == ["dp_shard 2 x sp 2", "dp_shard 2 x sp 2, transformers llama", "sp 4",
                                         "ring 2 x ulysses 2"]


# ---------------------------------------------------------------------------
# The trainers
# ---------------------------------------------------------------------------


def _trainer_args(config: str, dump: Path, *extra: str) -> list[str]:
    """A debug config, 2 steps of 4 rows x 64 tokens, full AC keeping attention, layer inputs
    offloaded; ``extra`` adds the directory."""
    return ["--config", str(REPO / "train_configs" / config), "--job.dump_folder", str(dump),
            "--training.steps", "2", "--training.global_batch_size", "4", "--context.schedule", "1:64",
            "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--metrics.progress_bar", "false",
            "--activation_checkpoint.mode", "full", "--activation_checkpoint.save_attention", "true",
            "--memory.offload_activations", "true", *extra]


def _metric_rows(dump: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def _trainers_worker(rank: int, world: int, runs: list, scripts: list) -> tuple[list, list]:
    """The trainer's runs (argv) one after the other, then the Trainer script's (argv)."""
    from test_hf_trainer import TRAINER_SCRIPT, _run_scripts

    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    for argv in runs:
        train(load_config(argv))
    return [], _run_scripts(rank, world, str(TRAINER_SCRIPT), [(argv, None) for argv in scripts])


def test_trainers_on_disk_equal_host_offload(tmp_path):
    """sp 2: our trainer (our Llama; a transformers Llama with model.implementation =
    "transformers") and UlyssesHFTrainer, keeping attention outputs: every logged loss (and the
    trainer's gradient norm) equals the host-offload run's."""
    from distributed import run_ranks
    from test_hf_trainer import _common, write_tiny_model  # puts scripts/ on the path

    from make_tiny_hf_model import make_tiny_hf_model

    hf_dir, trainer_dir = tmp_path / "tiny_llama", tmp_path / "trainer_llama"
    make_tiny_hf_model(hf_dir, "llama", tokenizer=False, vocab_size=320, dim=32, heads=4, kv_heads=2, ffn_dim=64)
    write_tiny_model(trainer_dir, "llama")
    disk = tmp_path / "nvme"
    disk.mkdir()
    runs = {"ours": ("debug_model.toml",),
            "transformers": ("debug_hf.toml", "--model.hf_path", str(hf_dir), "--model.implementation",
                             "transformers")}
    argv = []
    for name, (config, *extra) in runs.items():
        argv += [_trainer_args(config, tmp_path / f"{name}-host", *extra),
                 _trainer_args(config, tmp_path / f"{name}-disk", *extra, "--memory.offload_dir", str(disk))]
    script = ["--sp_size", "2", "--save_attention", "true",
              "--offload_activations", "true"]
    scripts = [_common(tmp_path / "hf-host", trainer_dir, 4, *script),
               _common(tmp_path / "hf-disk", trainer_dir, 4, *script, "--offload_dir", str(disk))]
    _, (host, on_disk) = run_ranks(2, _trainers_worker, argv, scripts)[0]
    for name in runs:
        want, got = _metric_rows(tmp_path / f"{name}-host"), _metric_rows(tmp_path / f"{name}-disk")
        assert got == want and [r[0] for r in got] == [1, 2], (name, got, want)
    assert on_disk["losses"] == host["losses"] and len(host["losses"]) == 3, (on_disk, host)
    assert os.listdir(disk) == []


def _one_rank_train(argv: list[str]) -> None:
    """The trainer in this process, a world of one (what ``python -m ulysses_dtensor.train`` does)."""
    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    train(load_config(argv))


def test_trainer_refuses_before_step_1_and_a_full_disk_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    import gc

    import ulysses_dtensor.memory.disk_offload as disk_offload
    from ulysses_dtensor.trainer.checkpoint import complete_steps
    from ulysses_dtensor.trainer.config import ConfigError
    from ulysses_dtensor.trainer.known_errors import exit_on_known_error

    disk = tmp_path / "nvme"
    # Before step 1 (before any process group or folder): a missing directory, then too little space.
    with pytest.raises(ConfigError, match=re.escape(f"memory.offload_dir={str(disk)!r}: no such directory; the "
                                                    "offloaded activations need 278,528 bytes (0.00 GiB) there, ")):
        _one_rank_train(_trainer_args("debug_model.toml", tmp_path / "refused", "--memory.offload_dir", str(disk)))
    disk.mkdir()

    class Full:
        f_bavail, f_frsize = 100, 1024

    with monkeypatch.context() as m:
        m.setattr(disk_offload.os, "statvfs", lambda p: Full)
        with pytest.raises(ConfigError, match=r": too little free space; .* need 278,528 bytes \(0\.00 GiB\) there, "
                                              r"102,400 bytes \(0\.00 GiB\) are free"):
            _one_rank_train(_trainer_args("debug_model.toml", tmp_path / "refused", "--memory.offload_dir", str(disk)))
    assert not (tmp_path / "refused").exists()

    # A disk that fills at step 2: the run stops with the message; step 1's checkpoint stands.
    steps = []
    real_new_step, real_pwrite = disk_offload.DiskStore.new_step, os.pwrite
    monkeypatch.setattr(disk_offload.DiskStore, "new_step", lambda self, *a: (steps.append(1), real_new_step(self, *a)))

    def pwrite(fd, data, offset):
        if len(steps) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    dump = tmp_path / "full"
    argv = _trainer_args("debug_model.toml", dump, "--memory.offload_dir", str(disk), "--checkpoint.enable", "true",
                         "--checkpoint.interval", "1")
    with pytest.raises(OffloadDirError) as e:
        _one_rank_train(argv)
    # A step's bytes, the check's (2 layers x the input, kept output and lse of 4 rows x 64 tokens) and
    # the file's since step 1.
    assert str(e.value).startswith(f"memory.offload_dir={str(disk)!r}: the disk filled during the run (No space left "
                                   "on device); the offloaded activations need 278,528 bytes (0.00 GiB) there, ")
    assert [r[0] for r in _metric_rows(dump)] == [1] and complete_steps(dump / "checkpoint") == [1]
    assert json.loads((dump / "checkpoint" / "step-1" / "train_state.json").read_text())["step"] == 1
    gc.collect()
    assert os.listdir(disk) == []
    # What `python -m ulysses_dtensor.train` does with it: one message, status 2.
    with pytest.raises(SystemExit) as stop, exit_on_known_error():
        raise e.value
    assert stop.value.code == 2 and capsys.readouterr().err == f"disk error: {e.value}\n"


def test_banner_states_the_staging_area_and_the_disk_bytes(tmp_path):
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.config import load_config, model_args
    from ulysses_dtensor.trainer.memory_banner import memory_banner, offload_disk_plan

    cfg = load_config(_trainer_args("debug_model.toml", tmp_path, "--memory.offload_dir", "/nvme/x",
                                    "--context.schedule", "1:64,2:128"))
    dims = ParallelDims(1, 1, 2, world_size=2)
    shape, schedule = model_args(cfg, 512), cfg.context_schedule()
    staging, disk = offload_disk_plan(cfg, shape, schedule, dims)
    # At 128 tokens on sp 2, 4 rows: per layer an input of 4 x 64 x 64 x 4 bytes and the kept output
    # (8 heads x 8) with its lse; the staging area two of those, in chunks cut at the first stage.
    block, kept = 4 * 64 * 64 * 4, 4 * 64 * 8 * (8 * 4 + 4)
    assert disk == 2 * (block + kept) and staging == staging_size(block + kept, staging_chunk(block // 2))
    banner = memory_banner(cfg, shape, schedule, dims, "cpu", transformers=False)
    assert ("offload_activations on (layer inputs to memory.offload_dir='/nvme/x': 272.0 KiB per rank on disk, through "
            "272.0 KiB of pinned staging in host memory; the files unlinked at once)") in banner, banner
