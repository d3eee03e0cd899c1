"""Hugging Face checkpoints in and out, against ``transformers`` itself (no download).

Tiny random Llama (llama3 rope), Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k
norm, head_dim != hidden/heads; saved in several shards) and Mistral models are
built from configs and saved with ``save_pretrained``. The references (logits,
loss, gradients) are computed here with transformers; the ranks only load the
directories with our code, so transformers is imported once, in this process.

* logits of our model loaded from each directory equal HF's on plain rows and on
  packed documents (reference: HF on each document alone);
* under sp 4 and dp_shard 2 x sp 2 with FSDP2 (every family) and HSDP 2 x sp 2
  (Qwen2), the global loss and every gradient equal HF's;
* loading reads only a rank's shards: peak host memory while loading is bounded
  by its shard, not by the model;
* export of trained checkpoints (every family, a sharded export, and a model of
  our own interleaved flavor) loads with ``from_pretrained`` without a warning
  (Python's or transformers' logger) and gives our logits;
* the trainer runs ``train_configs/debug_hf.toml`` from an HF directory, resumes
  from its own checkpoint, and its export gives the trained model's logits.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from shards import reference_part
from transformers_strict import no_transformers_warnings

from ulysses_dtensor.models.llama import Llama, llama_args
from ulysses_dtensor.models.llama_checkpoint import (
    HFCheckpointError,
    args_from_hf_config,
    hf_names,
    load_hf_weights,
    read_hf_config,
)
from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.loss import count_valid_tokens, global_loss
from ulysses_dtensor.parallel.mesh import ParallelDims

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from make_tiny_hf_model import (  # noqa: E402
    FAMILIES,
    hf_config,
    hf_model,
    save_tokenizer,
    train_tokenizer,
)

VOCAB, SEQ = 320, 24
LOGIT_TOL = 1e-5
# (dp_replicate, dp_shard, sp) on 4 ranks: every family at sp 4 (FSDP over sp) and
# sp 2 (FSDP over dp_shard x sp); HSDP (replicate 2 x shard over sp 2) with Qwen2,
# whose tied table lives in the root FSDP group.
MESHES = {(1, 1, 4): FAMILIES, (1, 2, 2): FAMILIES, (2, 1, 2): ("qwen2",)}
SHAPE = dict(vocab_size=VOCAB, dim=64, layers=2, heads=8, kv_heads=4, ffn_dim=96, init_std=0.08)


# ---------------------------------------------------------------------------
# Batches and references
# ---------------------------------------------------------------------------


def packed_batch() -> dict:
    """Row 0: one document; row 1: documents of 9 and 15 tokens."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    pos = torch.stack([torch.arange(SEQ), torch.cat([torch.arange(9), torch.arange(SEQ - 9)])])
    return {"input_ids": ids, "position_ids": pos}


def documents(batch):
    """(row, start, end) of every document of the batch."""
    out = []
    for r, pos in enumerate(batch["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
        out += [(r, a, b) for a, b in zip(starts[:-1], starts[1:])]
    return out


def hf_reference(model, batch) -> dict:
    """HF on each document alone: logits of the batch, token-mean loss, gradients."""
    model.zero_grad()
    logits = torch.empty(*batch["input_ids"].shape, VOCAB)
    total, count = 0.0, 0
    for r, a, b in documents(batch):
        ids = batch["input_ids"][r : r + 1, a:b]
        out = model(ids).logits[0]
        logits[r, a:b] = out.detach()
        total = total + F.cross_entropy(out[:-1], ids[0, 1:], reduction="sum")
        count += b - a - 1
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"logits": logits, "loss": loss.item(), "grads": grads}


def ours_from(path) -> Llama:
    model = Llama(args_from_hf_config(read_hf_config(path)))
    load_hf_weights(model, path)
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (directory, HF model, references)."""
    out = {}
    batch = packed_batch()
    for i, family in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(family)
        model = hf_model(hf_config(family, **SHAPE), seed=i, perturb=0.1)
        # Qwen3 in several files with an index, as large checkpoints come.
        model.save_pretrained(path, **({"max_shard_size": "100KB"} if family == "qwen3" else {}))
        out[family] = (path, model, hf_reference(model, batch))
    assert len(list(out["qwen3"][0].glob("*.safetensors"))) > 1
    assert (out["qwen3"][0] / "model.safetensors.index.json").is_file()
    return out


# ---------------------------------------------------------------------------
# One process: logits, layouts, errors
# ---------------------------------------------------------------------------


def test_logits_match_transformers_on_plain_rows_and_packed_documents(families):
    batch = packed_batch()
    plain = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for family, (path, hf, ref) in families.items():
        ours = ours_from(path)
        with torch.no_grad():
            got = ours(plain)
            want = hf(plain).logits
            sb = shard_batch(batch)
            packed = ours(sb["input_ids"], sb["position_ids"], sb["document_ids"])
        plain_diff = (got - want).abs().max().item()
        packed_diff = (packed - ref["logits"]).abs().max().item()
        print(f"{family}: logits max|diff| plain {plain_diff:.2e} packed {packed_diff:.2e}")
        assert plain_diff < LOGIT_TOL and packed_diff < LOGIT_TOL, family
        # Sensitivity: the same weights in the other rope layout are another model.
        other = Llama(dataclasses.replace(ours.args, rope_layout="interleaved"))
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (other(plain) - want).abs().max() > 1e-3, family


def test_hf_config_errors_name_the_value_and_what_is_supported(families, tmp_path):
    cfg = read_hf_config(families["llama"][0])
    with pytest.raises(HFCheckpointError, match=r"architectures=\['GPT2LMHeadModel'\].*supported: LlamaForCausalLM"):
        args_from_hf_config({**cfg, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(HFCheckpointError, match=r"rope_parameters\.rope_type is 'su'; valid: default, linear, "
                                                r"dynamic, yarn, llama3, longrope"):
        args_from_hf_config({**cfg, "rope_parameters": {"rope_type": "su", "factor": 4.0}})
    with pytest.raises(HFCheckpointError, match=r"rope_parameters of rope_type 'llama3' lacks low_freq_factor"):
        args_from_hf_config({**cfg, "rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                        "high_freq_factor": 4.0}})
    mistral = read_hf_config(families["mistral"][0])
    with pytest.raises(HFCheckpointError, match="sliding_window=4096"):
        args_from_hf_config({**mistral, "sliding_window": 4096})
    # transformers 4.x spelling: rope_theta + rope_scaling.
    old = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    old.update(rope_theta=10000.0, rope_scaling=dict(cfg["rope_parameters"], rope_theta=None))
    old["rope_scaling"].pop("rope_theta")
    assert args_from_hf_config(old) == args_from_hf_config(cfg)
    # A directory whose tensors do not match its config.
    bad = tmp_path / "bad"
    shutil.copytree(families["llama"][0], bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(HFCheckpointError, match=r"wrong shape: model\.layers\.0\.mlp\.gate_proj\.weight \(96, 64\)"):
        ours_from(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(HFCheckpointError, match=r"lacks model\.layers\.2\."):
        ours_from(bad)


# ---------------------------------------------------------------------------
# Under SP + FSDP2 / HSDP: loss and gradients equal HF's
# ---------------------------------------------------------------------------


def _sp_parity_task(rank, world, dirs: dict, refs: dict) -> dict:
    import torch.distributed as dist

    from ulysses_dtensor.models.llama_parallelize import parallelize_llama

    batch = packed_batch()
    figures = {}
    for dims, families in MESHES.items():
        pmesh = ParallelDims(*dims).build_mesh("cpu")
        per = 2 // pmesh.dims.dp
        rows = slice(pmesh.dp_rank * per, (pmesh.dp_rank + 1) * per)
        local = shard_batch({k: v[rows] for k, v in batch.items()}, pmesh.sp)
        for family in families:
            path, ref = dirs[family], refs[family]
            with torch.device("meta"):
                model = Llama(args_from_hf_config(read_hf_config(path)))
            parallelize_llama(model, pmesh)
            model.to_empty(device="cpu")
            load_hf_weights(model, path)
            n_valid = count_valid_tokens(local["labels"], pmesh.loss)
            loss = model(local["input_ids"], local["position_ids"], local["document_ids"],
                         labels=local["labels"], num_valid_tokens=n_valid)
            loss.backward()
            total = global_loss(loss, pmesh.loss).item()
            # Each rank checks the gradient shards it holds against HF's (no gathers).
            names = hf_names(model.args)
            grad_diff = torch.zeros(())
            for name, p in model.named_parameters():
                want = reference_part(ref["grads"][names[name]], p)
                got = p.grad.to_local()
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{family} {dims} {name}")
                if got.numel():
                    grad_diff = torch.maximum(grad_diff, (got - want).abs().max())
            dist.all_reduce(grad_diff, op=dist.ReduceOp.MAX)
            rel = abs(total - ref["loss"]) / ref["loss"]
            assert rel < 1e-6, (family, dims, total, ref["loss"])
            figures[f"{family} {dims}"] = (rel, grad_diff.item())
    return figures


def test_sp_fsdp_hsdp_loss_and_gradients_match_transformers(families):
    dirs = {f: str(p) for f, (p, _, _) in families.items()}
    refs = {f: {"loss": r["loss"], "grads": r["grads"]} for f, (_, _, r) in families.items()}
    figures = run_ranks(4, _sp_parity_task, dirs, refs)[0]
    for key, (rel, grad) in figures.items():
        print(f"{key}: loss rel diff {rel:.1e}, grads max|diff| {grad:.1e}")


# ---------------------------------------------------------------------------
# Sharded loading: a rank reads its shards, not the model
# ---------------------------------------------------------------------------

BIG = dict(dim=1024, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=1024, ffn_dim=1024)


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _load_memory_task(rank, world, path: str) -> dict:
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama

    args = llama_args("debug", **BIG, rope_layout="half")
    pmesh = ParallelDims(dp_shard=world).build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(args)
    parallelize_llama(model, pmesh)
    # Pooled ranks ran other tasks before, and glibc then serves even large
    # blocks from the resident heap (its mmap threshold rises after frees):
    # pages the shard reused would not show in the peak, which would read too
    # low. So: hand the freed heap back to the OS, and fix the threshold so each
    # parameter shard gets fresh pages that become resident only when loaded into.
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    M_MMAP_THRESHOLD = -3
    libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)
    try:
        model.to_empty(device="cpu")  # untouched pages: not resident until loaded into
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        before = _rss_kib("VmRSS")
        load_hf_weights(model, path)
        peak = _rss_kib("VmHWM") - before
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # where the dynamic threshold tops out: later tasks as before
    names = hf_names(args)
    ok = all(bool((p.to_local() == i).all()) for i, (n, p) in enumerate(
        (n, dict(model.named_parameters())[n]) for n in names))
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    return {"peak_kib": peak, "shard_bytes": shard, "values_ok": ok}


def test_loading_reads_only_each_ranks_shards(tmp_path):
    from safetensors.torch import save_file

    args = llama_args("debug", **BIG, rope_layout="half")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Llama(args).named_parameters()}
    names = hf_names(args)
    # bf16 files (as published) into fp32 parameters; tensor i holds the value i.
    tensors = {names[n]: torch.full(shapes[n], float(i), dtype=torch.bfloat16) for i, n in enumerate(names)}
    keys = list(tensors)
    files = [keys[i::4] for i in range(4)]
    weight_map = {}
    for j, group in enumerate(files, start=1):
        name = f"model-{j:05d}-of-00004.safetensors"
        save_file({k: tensors[k] for k in group}, str(tmp_path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    del tensors
    model_bytes = sum(s.numel() * 4 for s in shapes.values())
    largest = max(s.numel() * 4 for s in shapes.values())

    results = run_ranks(4, _load_memory_task, str(tmp_path))
    for rank, r in enumerate(results):
        peak = r["peak_kib"] * 1024
        # The fp32 shard itself, the file pages of its bf16 slices (read through
        # mmap), one tensor's temporaries, and allocator slack.
        bound = r["shard_bytes"] + r["shard_bytes"] // 2 + largest + (16 << 20)
        print(f"rank {rank}: peak host memory while loading {peak / 2**20:.1f} MiB; shard "
              f"{r['shard_bytes'] / 2**20:.1f} MiB, model {model_bytes / 2**20:.1f} MiB (fp32), "
              f"bound {bound / 2**20:.1f} MiB")
        assert r["values_ok"], rank
        assert r["shard_bytes"] * 4 == pytest.approx(model_bytes, rel=0.01)
        assert r["shard_bytes"] <= peak <= bound < model_bytes, (rank, peak, bound, model_bytes)


# ---------------------------------------------------------------------------
# Export: from_pretrained gives our logits
# ---------------------------------------------------------------------------


def _save_our_checkpoint(model: Llama, folder: Path, info: dict) -> Path:
    from ulysses_dtensor.trainer.checkpoint import CheckpointManager

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return CheckpointManager(folder, interval=1).save(1, model, opt, {"step": 1}, model_info=info)


def _exported_logits(ckpt: Path, out: Path, ids, **kwargs):
    from transformers import AutoModelForCausalLM

    from ulysses_dtensor.export import export_checkpoint

    export_checkpoint(ckpt, out, **kwargs)
    with no_transformers_warnings():  # the exported config is one transformers accepts as is
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_export_round_trip_every_family_and_our_own_flavor(families, tmp_path):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    cases = []
    for family, (path, _, _) in families.items():
        cases.append((family, ours_from(path), read_hf_config(path), str(path)))
    # Our own flavor: interleaved rope (q/k rows permuted on export), llama3 scaling, tied.
    own = Llama(llama_args("debug", vocab_size=VOCAB, tie_embeddings=True))
    own.init_weights(seed=3)
    cases.append(("debug flavor", own, None, None))
    for name, model, source, hf_path in cases:
        with torch.no_grad():  # "training": every weight moves
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
            want = model(ids)
        info = {"args": dataclasses.asdict(model.args), "hf_config": source, "hf_path": hf_path,
                "tokenizer": "byte", "max_seq_len": 8192 * 4}
        ckpt = _save_our_checkpoint(model, tmp_path / name / "ckpt", info)
        out = tmp_path / name / "hf"
        shard = {"max_shard_size": "40KB"} if name == "qwen2" else {}
        got = _exported_logits(ckpt, out, ids, **shard)
        diff = (got - want).abs().max().item()
        print(f"export {name}: from_pretrained logits max|diff| {diff:.2e}")
        assert diff < LOGIT_TOL, name
        config = json.loads((out / "config.json").read_text())
        assert config["max_position_embeddings"] == 8192 * 4
        if name == "qwen2":
            assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == len(
                hf_names(model.args))
    from ulysses_dtensor.export import export_checkpoint

    with pytest.raises(HFCheckpointError, match="already holds"):
        export_checkpoint(ckpt, out)


# ---------------------------------------------------------------------------
# The trainer: debug_hf.toml from an HF directory, resume, export
# ---------------------------------------------------------------------------


def _trainer_task(rank, world, hf_dir: str, dump: str, resumed: str) -> dict:
    import torch.distributed as dist

    from ulysses_dtensor.trainer import load_config
    from ulysses_dtensor.trainer.loop import train

    def run(folder):
        cfg = load_config([
            "--config", str(REPO / "train_configs" / "debug_hf.toml"),
            "--model.hf_path", hf_dir, "--job.dump_folder", folder,
            "--training.steps", "3", "--checkpoint.interval", "2", "--context.schedule", "1:64",
            "--training.global_batch_size", "4", "--lr_scheduler.warmup_steps", "1",
            "--metrics.log_freq", "1", "--metrics.progress_bar", "false", "--data.max_corpus_mb", "0.25",
        ])
        return train(cfg)

    first = run(dump)
    if rank == 0:
        shutil.copytree(Path(dump) / "checkpoint" / "step-2", Path(resumed) / "checkpoint" / "step-2")
    dist.barrier()
    second = run(resumed)
    return {"first": first, "second": second}


def test_trainer_from_hf_dir_resumes_and_exports(families, tmp_path):
    from ulysses_dtensor.models.llama_checkpoint import quiet_single_process

    # Qwen2 (q/k/v bias, tied embeddings) with a BPE tokenizer.
    src, hf, _ = families["qwen2"]
    hf_dir = tmp_path / "qwen2"
    shutil.copytree(src, hf_dir)
    save_tokenizer(train_tokenizer(VOCAB, max_bytes=1 << 18), hf_dir)
    dump, resumed = tmp_path / "dump", tmp_path / "resumed"
    rows = run_ranks(4, _trainer_task, str(hf_dir), str(dump), str(resumed))[0]
    first, second = rows["first"], rows["second"]
    assert [r["step"] for r in first] == [1, 2, 3] and [r["step"] for r in second] == [3]
    assert second[0]["loss"] == pytest.approx(first[2]["loss"], rel=1e-6, abs=0)
    # The tokenizer is hf_dir/tokenizer.json and the vocabulary the model's.
    ckpt = dump / "checkpoint" / "step-3"
    info = json.loads((ckpt / "model.json").read_text())
    assert info["tokenizer"] == str(hf_dir / "tokenizer.json") and info["args"]["vocab_size"] == VOCAB

    # Export -> from_pretrained gives the logits of the trained model (read from our checkpoint).
    import torch.distributed.checkpoint as dcp

    trained = Llama(args_from_hf_config(read_hf_config(hf_dir)))
    state = {"model": trained.state_dict()}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(ckpt))
    trained.load_state_dict(state["model"])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want, before = trained(ids), hf(ids).logits
    got = _exported_logits(ckpt, tmp_path / "export", ids)
    diff = (got - want).abs().max().item()
    print(f"trainer export: from_pretrained logits max|diff| {diff:.2e}; moved by training "
          f"{(want - before).abs().max().item():.2e}")
    assert diff < LOGIT_TOL
    assert (want - before).abs().max() > 1e-3  # training changed the model
    assert (tmp_path / "export" / "tokenizer.json").is_file()


# ---------------------------------------------------------------------------
# Trainer config: keys hf_path makes meaningless are errors; no transformers needed
# ---------------------------------------------------------------------------


def test_trainer_config_with_hf_path(families, tmp_path):
    from ulysses_dtensor.trainer.config import (
        ConfigError,
        inactive_settings,
        load_config,
        model_args,
        validate_config,
    )
    from ulysses_dtensor.trainer.hf_start import tokenizer_spec

    hf_dir = str(families["qwen3"][0])
    toml = REPO / "train_configs" / "debug_hf.toml"
    base = ["--config", str(toml), "--model.hf_path", hf_dir]
    # Keys hf_path makes meaningless: an error naming both keys when set alongside it ...
    for extra, key in ((["--model.flavor", "llama3_8b"], "flavor"), (["--model.dim", "128"], "dim"),
                       (["--model.vocab_size", "512"], "vocab_size")):
        with pytest.raises(ConfigError, match=rf"model\.{key}=.* has no effect: with model\.hf_path.*"
                                              rf"model\.hf_path='{hf_dir}'"):
            load_config(base + extra)
    # ... and accepted, listed as not in effect, when the command line's hf_path
    # overrides a TOML file's flavor.
    cfg = load_config(["--config", str(REPO / "train_configs" / "llama3_8b_128k.toml"), "--model.hf_path", hf_dir])
    assert any(note.startswith("model.flavor='llama3_8b' (from the TOML file)") for note in inactive_settings(cfg))
    cfg = load_config(base)
    # Shapes from config.json (Qwen3: q/k norm, head_dim 16 != 64 / 8), the tokenizer
    # default 'byte' here (no tokenizer.json), an explicit one wins over the directory's.
    args = model_args(cfg, 0)
    assert (args.qk_norm, args.head_dim, args.vocab_size, args.rope_layout) == (True, 16, VOCAB, "half")
    assert tokenizer_spec(cfg) == "byte"
    with_tok = tmp_path / "tok"
    shutil.copytree(hf_dir, with_tok)
    (with_tok / "tokenizer.json").write_text("{}")
    assert tokenizer_spec(load_config(["--config", str(toml), "--model.hf_path", str(with_tok)])) == str(
        with_tok / "tokenizer.json")
    assert tokenizer_spec(load_config(["--config", str(toml), "--model.hf_path", str(with_tok),
                                       "--data.tokenizer", "byte"])) == "byte"
    # An unsupported architecture stops validation, listing what is supported.
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM"):
        validate_config(load_config(["--config", str(toml), "--model.hf_path", str(bad)]), 4)
    with pytest.raises(ConfigError, match=r"model\.hf_path='/nonexistent' is not a directory"):
        validate_config(load_config(["--config", str(toml), "--model.hf_path", "/nonexistent"]), 4)


# Meta's published config.json of Llama-3.1-8B (written by transformers 4.43).
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_shipped_hf_configs_validate(families, tmp_path):
    """debug_hf.toml and llama3_8b_hf_128k.toml validate with their directories in place;
    Llama-3.1-8B's published config is exactly our llama3_8b flavor, in the half layout."""
    from safetensors.torch import save_file

    from ulysses_dtensor.trainer.config import load_config, model_args, validate_config

    llama = tmp_path / "Llama-3.1-8B"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(LLAMA31_8B_CONFIG))
    save_file({"stand_in": torch.zeros(1)}, str(llama / "model-00001-of-00004.safetensors"))
    for name, path, world in (("debug_hf", families["llama"][0], 4), ("llama3_8b_hf_128k", llama, 8)):
        cfg = load_config(["--config", str(REPO / "train_configs" / f"{name}.toml"), "--model.hf_path", str(path)])
        assert validate_config(cfg, world).sp == cfg.parallelism.sp
    assert model_args(cfg, 0) == llama_args(
        "llama3_8b", rope_layout="half", explicit_head_dim=128, attn_backend="auto")


def test_library_imports_without_the_hf_extra():
    """transformers, safetensors and tokenizers are optional: the library, the
    trainer and the export module import without them (fresh copies, imported
    here with the three blocked), and using the HF path names the extra."""
    import importlib

    packages = ("ulysses_dtensor", "transformers", "safetensors", "tokenizers")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in packages}
    try:
        for name in saved:
            del sys.modules[name]
        for name in packages[1:]:
            sys.modules[name] = None  # `import name` raises ImportError
        importlib.import_module("ulysses_dtensor.trainer.loop")
        importlib.import_module("ulysses_dtensor.export")
        hf = importlib.import_module("ulysses_dtensor.models.llama_checkpoint")
        with pytest.raises(ImportError, match=r"pip install 'ulysses-dtensor\[hf\]'"):
            hf.load_hf_weights(None, ".")
    finally:  # the originals back, the fresh copies gone
        for name in [k for k in sys.modules if k.split(".")[0] in packages]:
            del sys.modules[name]
        sys.modules.update(saved)
