"""Ulysses SP + FSDP2 on unmodified transformers models equals the model unsharded.

One 4-rank task runs every family (tiny random Llama with GQA, Qwen3 with MQA,
q/k norms and tied embeddings, Mistral with MHA and a sliding window longer
than the sequence) on sp 2 (two independent replicas), sp 4 and dp 2 x sp 2
(FSDP over dp_shard x sp, or HSDP for Qwen3). Each case trains on two global
batches of 29 tokens per row (29 is not a multiple of 2 or 4: every mesh
pads): one of packed documents, one of a single document per row (the
compiled case: the first only). The reference is the same model in one
process, run document by document, so it cannot attend across documents
whatever transformers' own masking does; loss and every parameter's gradient
must match. The same task counts the collectives of each forward and backward.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

# Checked without importing it: transformers costs seconds to import, which the
# pooled ranks pay once and this process need not pay at all.
if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

from distributed import run_ranks  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from ulysses_dtensor.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.loss import IGNORE_INDEX, count_valid_tokens, global_loss, sp_cross_entropy  # noqa: E402
from ulysses_dtensor.mesh import MESH_DIM_NAMES, ParallelDims, ParallelMesh  # noqa: E402
from ulysses_dtensor.ulysses import exchange_bytes_per_rank  # noqa: E402

VOCAB, SEQ, ROWS, LAYERS, HEADS = 64, 29, 4, 2, 4
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, max_position_embeddings=64, attention_dropout=0.0,
)
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=4, sliding_window=32, tie_word_embeddings=False)),
}
# (family, (dp_replicate, dp_shard, sp), options): each family on each mesh; the
# options spread AC, packed exchange and compile over the cases.
CASES = [
    ("llama", (1, 1, 2), {}),
    ("llama", (1, 1, 4), {"pack_qkv": True}),
    ("llama", (1, 2, 2), {"ac_mode": "full"}),
    ("qwen3", (1, 1, 2), {"ac_mode": "selective"}),
    ("qwen3", (1, 1, 4), {}),
    ("qwen3", (2, 1, 2), {}),
    # Compiled (aot_eager: the graphs and autograd of inductor without C++
    # codegen) on one replica only: compiling costs seconds of CPU per rank.
    ("mistral", (1, 1, 2), {"ac_mode": "full", "compile": True, "compile_backend": "aot_eager"}),
    ("mistral", (1, 1, 4), {}),
    ("mistral", (1, 2, 2), {"pack_qkv": True}),
]
LOSS_RTOL = 1e-5
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)


def make_model(family: str, **overrides):
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def global_batches() -> list[dict]:
    """Two global batches: packed documents, and one document per row."""
    g = torch.Generator().manual_seed(7)
    starts = [[0, 11], [0], [0, 5, 17], [0, 23]]  # document starts per row
    pos = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r, row in enumerate(starts):
        for a, b in zip(row, row[1:] + [SEQ]):
            pos[r, a:b] = torch.arange(b - a)
    out = []
    for position_ids in (pos, torch.arange(SEQ).expand(ROWS, SEQ)):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        labels[:, 3] = IGNORE_INDEX  # ignored targets count in neither loss nor denominator
        out.append({"input_ids": ids, "labels": labels, "position_ids": position_ids.contiguous()})
    return out


def reference(model, batch) -> torch.Tensor:
    """Token-mean next-token loss, each document run through the model on its own."""
    total, count = 0.0, 0
    for r in range(ROWS):
        pos = batch["position_ids"][r].tolist()
        starts = [t for t in range(SEQ) if pos[t] == 0] + [SEQ]
        for a, b in zip(starts, starts[1:]):
            logits = model(input_ids=batch["input_ids"][r : r + 1, a:b]).logits[0]
            target = batch["labels"][r, a + 1 : b]
            total = total + F.cross_entropy(logits[:-1], target, ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((target != IGNORE_INDEX).sum())
    return total / count


def build_pmesh(world: int, dims: tuple) -> tuple[ParallelMesh, int]:
    """The mesh for ``dims`` and which of the ``world // size`` independent replicas this rank is in."""
    size = dims[0] * dims[1] * dims[2]
    mesh = init_device_mesh("cpu", (world // size, *dims), mesh_dim_names=("replica", *MESH_DIM_NAMES))
    return ParallelMesh(ParallelDims(*dims, world_size=size), mesh[MESH_DIM_NAMES]), mesh["replica"].get_local_rank()


class registry_restored:
    """Put transformers' class-wide attention registry back as it was (pooled ranks live on)."""

    def __enter__(self):
        from transformers import AttentionInterface

        self.saved = dict(AttentionInterface._global_mapping)

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface._global_mapping.clear()
        AttentionInterface._global_mapping.update(self.saved)


def _parity_worker(rank: int, world: int) -> list[dict]:
    from ulysses_dtensor.integrations.hf import parallelize_hf_model, shard_hf_batch

    batches = global_batches()
    refs, results = {}, []
    with registry_restored():
        for family, dims, opts in CASES:
            model = make_model(family)
            if family not in refs:
                ref = copy.deepcopy(model)
                refs[family] = []
                for b in batches:  # gradients per batch: the compiled case trains on one
                    ref.zero_grad()
                    loss = reference(ref, b)
                    loss.backward()
                    refs[family].append((loss.item(), {n: p.grad.clone() for n, p in ref.named_parameters()}))
            # Compiled: the packed batch only (each batch kind compiles its own graph).
            used = refs[family][:1] if opts.get("compile") else refs[family]
            ref_losses = [loss for loss, _ in used]
            ref_grads = {n: sum(g[n] for _, g in used) for n in used[0][1]}

            pmesh, replica = build_pmesh(world, dims)
            shown = opts
            if opts.get("compile"):
                if replica:
                    continue
                # Counts the frames compiled: one graph serves every layer.
                counter = CompileCounterWithBackend(opts["compile_backend"])
                opts = {**opts, "compile_backend": counter}
            parallelize_hf_model(model, pmesh, attn_backend="sdpa", **opts)
            dp, rows = pmesh.dims.dp, ROWS // pmesh.dims.dp
            mine = slice(pmesh.dp_rank * rows, (pmesh.dp_rank + 1) * rows)
            total, losses, counts = 0, [], {}
            for i, b in enumerate(batches[: len(used)]):
                inputs, labels = shard_hf_batch({k: v[mine] for k, v in b.items()}, pmesh.sp)
                n = count_valid_tokens(labels, pmesh.loss)
                with CollectiveCounter() as fwd:
                    logits = model(**inputs).logits
                loss = sp_cross_entropy(logits, labels, num_valid_tokens=n)
                total = total + loss
                losses.append(global_loss(loss, pmesh.loss).item())
                if i == 0:
                    counts["forward"], counts["forward_bytes"] = fwd.counts(), fwd.sent_bytes()
                    if not opts:
                        # transformers' own loss with pre-shifted labels and the global count.
                        with torch.no_grad():
                            hf = model(**inputs, labels=labels, shift_labels=labels, num_items_in_batch=n).loss
                        torch.testing.assert_close(hf, loss.detach(), rtol=1e-6, atol=0)
            with CollectiveCounter() as bwd:
                total.backward()
            counts["backward"] = bwd.counts()

            cfg = model.config
            kv, head_dim = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // HEADS
            padded = -(-SEQ // dims[2]) * dims[2]
            a2a = (2 if opts.get("pack_qkv") else 4) * LAYERS
            assert counts["forward"] == {"all_to_all_single": a2a}, (family, dims, counts)
            # Full AC replays the exchange in backward; selective AC saves its outputs.
            replay = 2 if opts.get("ac_mode") == "full" else 1
            assert counts["backward"] == {"all_to_all_single": a2a * len(used) * replay}, (family, dims, counts)
            want_bytes = LAYERS * exchange_bytes_per_rank(rows, padded, HEADS, kv, head_dim, dims[2], 4, backward=False)
            assert counts["forward_bytes"] == want_bytes, (family, dims, counts, want_bytes)

            loss_rel = max(abs(g - r) / abs(r) for g, r in zip(losses, ref_losses))
            grad_abs, compared = 0.0, 0
            for name, p in model.named_parameters():
                name = name.replace("_checkpoint_wrapped_module.", "")
                full = p.grad.full_tensor()
                torch.testing.assert_close(full, ref_grads[name], **GRAD_TOL, msg=f"{family} {dims} {opts} {name}")
                grad_abs = max(grad_abs, (full - ref_grads[name]).abs().max().item())
                compared += 1
            assert compared == len(ref_grads), (family, compared, sorted(ref_grads))
            assert loss_rel < LOSS_RTOL, (family, dims, losses, ref_losses)
            if opts.get("compile"):
                # fullgraph=True (transformers marks these models compilable), and
                # one graph serves both layers (no recompile per layer index).
                assert counter.frame_count == 1, counter.frame_count
            results.append(dict(family=family, dims=dims, opts=shown, loss=losses, loss_rel=loss_rel,
                                grad_abs=grad_abs, dp=dp, counts=counts))
    return results


def _raises(fn, *words) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert all(w in msg for w in words), (words, msg)
        return msg
    raise AssertionError(f"no error; expected one naming {words}")


def _errors_worker(rank: int, world: int) -> list[str]:
    import transformers

    from ulysses_dtensor.integrations.hf import parallelize_hf_model, shard_hf_batch

    auto = transformers.AutoModelForCausalLM
    msgs = []
    with registry_restored():
        # Refused before anything changes (no mesh needed), naming the class.
        def refuse(model, sp, *words):
            stand_in = SimpleNamespace(dims=ParallelDims(sp=sp, dp_shard=1, world_size=sp))
            msgs.append(_raises(lambda: parallelize_hf_model(model, stand_in), *words))

        tiny = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1)
        refuse(torch.nn.Linear(2, 2), 2, "Linear", "PreTrainedModel")
        refuse(auto.from_config(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)),
               2, "BloomForCausalLM", "AttentionInterface")
        bart = transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32)
        refuse(transformers.AutoModelForSeq2SeqLM.from_config(bart), 2, "BartForConditionalGeneration", "encoder-decoder")
        llama = transformers.LlamaConfig(**tiny, num_attention_heads=4, num_key_value_heads=2)
        refuse(auto.from_config(llama), 8, "LlamaForCausalLM", "heads % sp == 0", "[1, 2, 4]")
        llama6 = transformers.LlamaConfig(**{**tiny, "hidden_size": 48}, num_attention_heads=6, num_key_value_heads=3)
        refuse(auto.from_config(llama6), 2, "LlamaForCausalLM", "kv_heads=3", "sp=2")
        # A hybrid with convolution layers: they would mix tokens over the local slice only.
        lfm = transformers.Lfm2Config(**{**tiny, "num_hidden_layers": 2}, num_attention_heads=4,
                                      num_key_value_heads=2, layer_types=["conv", "full_attention"])
        refuse(auto.from_config(lfm), 2, "Lfm2ForCausalLM", "'conv'")

        # At run time, what the model's own mask would express is refused, not dropped.
        pmesh, _ = build_pmesh(world, (1, 1, 2))
        b = global_batches()[0]
        model = parallelize_hf_model(make_model("llama"), pmesh)
        inputs, labels = shard_hf_batch(b, pmesh.sp)
        ids = inputs["input_ids"]
        for call, words in (
            (lambda: model(input_ids=ids, attention_mask=torch.zeros_like(ids)), ("attention_mask",)),
            (lambda: model(**inputs, labels=labels), ("sp_cross_entropy", "shift_labels")),
            (lambda: model(**inputs, use_cache=True), ("cache",)),
            # Packed positions without the document ids of the whole sequence.
            (lambda: model(input_ids=ids, position_ids=inputs["position_ids"]), ("sp_document_ids",)),
        ):
            msgs.append(_raises(call, "LlamaForCausalLM", *words))
        padded = {**b, "attention_mask": (b["input_ids"] > 2).long()}
        msgs.append(_raises(lambda: shard_hf_batch(padded, pmesh.sp), "attention_mask", "position_ids"))
        # A window shorter than the sequence is not plain causal attention.
        model = parallelize_hf_model(make_model("mistral", sliding_window=16), pmesh)
        msgs.append(_raises(lambda: model(**inputs), "MistralForCausalLM", "sliding_window=16"))
    return msgs


def test_hf_models_match_unsharded_on_every_mesh():
    results = run_ranks(4, _parity_worker)
    for r in results[0]:
        print(
            f"{r['family']:8s} dims={r['dims']} {r['opts']}: loss rel diff {r['loss_rel']:.1e}, "
            f"max grad abs diff {r['grad_abs']:.1e}, all-to-alls fwd {r['counts']['forward']} "
            f"bwd {r['counts']['backward']}"
        )
    assert len(results[0]) == len(CASES)


def test_unsupported_models_and_inputs_are_refused_by_name():
    msgs = run_ranks(4, _errors_worker)[0]
    print("\n".join(msgs))


# ---------------------------------------------------------------------------
# scripts/example_hf_custom_loop.py: its train() on the pooled ranks
# ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scripts" / "example_hf_custom_loop.py"


def _example_worker(rank: int, world: int, argv: list[str]) -> dict:
    spec = importlib.util.spec_from_file_location("example_hf_custom_loop", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with registry_restored():
        return example.train(example.parse_args(argv), torch.device("cpu"))


def _file_norm(directory: Path) -> tuple[float, dict]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(f))
    norm = sum(t.double().pow(2).sum() for t in tensors.values()).sqrt().item()
    return norm, {k: tuple(t.shape) for k, t in tensors.items()}


def test_example_hf_custom_loop_trains_loads_and_saves(tmp_path):
    """dp 2 x sp 2: makes a tiny Llama directory, loads it sharded, learns, saves an HF directory."""
    data = tmp_path / "docs.jsonl"
    sources = [ROOT / "README.md", *sorted((ROOT / "ulysses_dtensor").glob("*.py"))[:6]]
    data.write_text("".join(json.dumps({"text": f.read_text()[:4000]}) + "\n" for f in sources))
    model_dir, save_dir = tmp_path / "tiny", tmp_path / "trained"
    argv = ["--model-dir", str(model_dir), "--make-tiny", "--data", str(data), "--sp", "2",
            "--seq-len", "64", "--steps", "6", "--save-dir", str(save_dir)]
    log = run_ranks(4, _example_worker, argv)[0]
    losses = log["losses"]
    print("losses", [round(x, 3) for x in losses])
    assert all(math.isfinite(x) for x in losses), losses
    assert abs(losses[0] - math.log(320)) < 0.5, losses  # a random model over 320 ids
    assert losses[-1] < losses[0] - 0.3, losses
    # Loaded: the sharded parameters are the checkpoint's (their norm over all shards).
    loaded_norm, loaded_shapes = _file_norm(model_dir)
    assert math.isclose(log["loaded_norm"], loaded_norm, rel_tol=1e-6), (log["loaded_norm"], loaded_norm)
    # Saved: same names and shapes as transformers' own files, the trained values.
    saved_norm, saved_shapes = _file_norm(save_dir)
    assert saved_shapes == loaded_shapes
    assert math.isclose(log["saved_norm"], saved_norm, rel_tol=1e-6), (log["saved_norm"], saved_norm)
    assert not math.isclose(saved_norm, loaded_norm, rel_tol=1e-4)
    assert (save_dir / "config.json").exists()
