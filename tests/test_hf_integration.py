"""Ulysses SP + FSDP2 on unmodified transformers models equals the model unsharded: the options.

The family matrix (``tests/test_family_matrix.py``) measures EVERY family on the
plain path. Here 17 families run with the options on top of it -- packed q/k/v,
full and selective activation checkpointing, compiled layers, HSDP -- in ONE
pooled 4-rank task (sp 2 on ranks 0-1 with ranks 2-3 idle, sp 4, dp_shard 2 x sp
2, dp_replicate 2 x sp 2), each on one or two meshes, with exact collective
counts and bytes: tiny random configs (1-2 layers, hidden 32, 4 heads, vocab 64)
in fp32, each family's pattern switched on where it has one -- a sliding window
(4) shorter than the documents, soft-capping, sinks, MLA, MoE router losses,
layers without rope, multimodal rope ids. The global batch is 4 rows of 29 tokens (29 is not a
multiple of 2 or 4: every mesh pads) of packed documents (one row a single
document); the compiled case trains on one document per row (plain causal,
no document ids). The reference is transformers' own unsharded model (eager
attention) run document by document in one process (every rank computes it),
so it cannot attend across documents whatever transformers' own masking does;
its router loss is transformers' own ``load_balancing_loss_func`` over the
router logits of every document. Loss (relative error <= 1e-5) and every
parameter's gradient (relative error of the norm <= 1e-4) must match; each
pattern must change the reference (so a dropped one would fail); the
collectives of each forward and backward are counted exactly.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
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
from script_module import load_script  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from ulysses_dtensor.parallel.comm_stats import CollectiveCounter  # noqa: E402
from ulysses_dtensor.parallel.loss import (  # noqa: E402
    IGNORE_INDEX,
    count_valid_tokens,
    global_loss,
    sp_cross_entropy,
)
from ulysses_dtensor.parallel.mesh import MESH_DIM_NAMES, ParallelDims, ParallelMesh  # noqa: E402
from ulysses_dtensor.parallel.ulysses import exchange_bytes_per_rank  # noqa: E402

VOCAB, SEQ, ROWS, HEADS, WINDOW = 64, 29, 4, 4, 4
DOC_STARTS = [[0, 11], [0], [0, 5, 17], [0, 23]]  # document starts per row; shortest document: 5 > WINDOW
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=HEADS,
    max_position_embeddings=64, attention_dropout=0.0, initializer_range=0.1,
)
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.1)
SLIDING_FULL = ["sliding_attention", "full_attention"]


@dataclass
class Family:
    config: str  # transformers config class
    extra: dict
    layers: int = 1
    features: tuple = ()  # README columns: window, softcap, sinks, mla, moe, vl_rope
    off: dict = field(default_factory=dict)  # per pattern, config overrides that switch it off ("sinks": -inf sinks)
    moe: bool = False  # transformers computes a router loss (output_router_logits=True)
    model: str | None = None  # model class, when not AutoModelForCausalLM's
    meshes: tuple = ((1, 1, 2), (1, 1, 4), (1, 2, 2))
    options: list = field(default_factory=list)  # per mesh, parallelize_hf_model options


FAMILIES = {
    "llama": Family("LlamaConfig", dict(num_key_value_heads=2), meshes=((1, 1, 4), (1, 2, 2)),
                    options=[{"pack_qkv": True}, {"ac_mode": "full"}]),
    "qwen2": Family("Qwen2Config", dict(num_key_value_heads=2), meshes=((1, 1, 2),), options=[{"pack_qkv": True}]),
    "qwen3": Family("Qwen3Config", dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True),
                    meshes=((1, 1, 2), (2, 1, 2)), options=[{"ac_mode": "selective"}]),
    "mistral": Family("MistralConfig", dict(num_key_value_heads=4, sliding_window=WINDOW), layers=2,
                      features=("window",), off={"window": dict(sliding_window=None)},
                      # Compiled (aot_eager: the graphs and autograd of inductor without C++
                      # codegen): compiling costs seconds of CPU per rank.
                      meshes=((1, 1, 2), (1, 2, 2)),
                      options=[{"ac_mode": "full", "compile": True, "compile_backend": "aot_eager"},
                               {"pack_qkv": True}]),
    "gemma2": Family("Gemma2Config", dict(num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                                          query_pre_attn_scalar=16, attn_logit_softcapping=0.5,
                                          layer_types=SLIDING_FULL), layers=2,
                     features=("window", "softcap"), meshes=((1, 1, 2),),
                     off={"window": dict(sliding_window=64), "softcap": dict(attn_logit_softcapping=None)}),
    "gemma3": Family("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                                              layer_types=SLIDING_FULL), layers=2, meshes=((1, 2, 2),),
                     features=("window",), off={"window": dict(sliding_window=64)}, options=[{"ac_mode": "full"}]),
    "cohere2": Family("Cohere2Config", dict(num_key_value_heads=2, sliding_window=WINDOW, layer_types=SLIDING_FULL,
                                            logit_scale=1.0), meshes=((1, 1, 4),),
                      layers=2, features=("window",), off={"window": dict(sliding_window=64)}),
    "gpt_oss": Family("GptOssConfig", dict(num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
                                           layer_types=SLIDING_FULL, num_local_experts=4, **MOE,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                      layers=2, features=("window", "sinks", "moe"), off={"window": dict(sliding_window=64), "sinks": {}},
                      moe=True, meshes=((1, 1, 2), (1, 1, 4)), options=[{}, {"pack_qkv": True}]),
    "qwen3_moe": Family("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=8, num_experts=4,
                                               moe_intermediate_size=32, **MOE),
                        features=("moe",), moe=True, meshes=((1, 2, 2),)),
    "mixtral": Family("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, **MOE),
                      features=("moe",), moe=True, meshes=((1, 1, 2),), options=[{"ac_mode": "full"}]),
    "deepseek_v3": Family("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                                   n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                                   moe_intermediate_size=32, first_k_dense_replace=0),
                          features=("mla", "moe"), meshes=((1, 1, 4),), options=[{"pack_qkv": True}]),
    "phi3": Family("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0), meshes=((1, 1, 2),)),
    "olmo2": Family("Olmo2Config", dict(num_key_value_heads=2), meshes=((1, 1, 2),), options=[{"pack_qkv": True}]),
    "glm4": Family("Glm4Config", dict(num_key_value_heads=2, head_dim=8, pad_token_id=0), meshes=((1, 1, 2),)),
    "granite": Family("GraniteConfig", dict(num_key_value_heads=2, attention_multiplier=0.2), meshes=((1, 1, 2),)),
    "smollm3": Family("SmolLM3Config", dict(num_key_value_heads=2, pad_token_id=0, no_rope_layers=[1, 0]), layers=2,
                      off={"no rope": dict(no_rope_layers=[1, 1])}, meshes=((1, 1, 2),)),
    "qwen2_5_vl": Family("Qwen2_5_VLConfig", dict(num_key_value_heads=2), features=("vl_rope",),
                         model="Qwen2_5_VLForConditionalGeneration", meshes=((1, 2, 2),)),
}
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def make_model(family: str, **overrides):
    import transformers

    spec = FAMILIES[family]
    kwargs = {**COMMON, **spec.extra, "num_hidden_layers": spec.layers, **overrides}
    if spec.config == "Qwen2_5_VLConfig":
        kwargs["rope_parameters"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                      temporal_patch_size=1, window_size=4, fullatt_block_indexes=[0], spatial_merge_size=1)
        config = transformers.Qwen2_5_VLConfig(text_config=kwargs, vision_config=vision, image_token_id=60,
                                               video_token_id=61, vision_start_token_id=62)
    else:
        config = getattr(transformers, spec.config)(**kwargs)
    torch.manual_seed(0)
    # transformers' own eager attention: the reference implementation of every
    # pattern (its sdpa path would drop gpt-oss's sinks, and Gemma2 has none).
    if spec.model is not None:
        model = getattr(transformers, spec.model)._from_config(config, attn_implementation="eager")
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family == "gpt_oss":
        with torch.no_grad():  # sinks of either sign, large enough to matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def global_batches() -> list[dict]:
    """Two global batches: packed documents, and one document per row."""
    g = torch.Generator().manual_seed(7)
    pos = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r, row in enumerate(DOC_STARTS):
        for a, b in zip(row, row[1:] + [SEQ]):
            pos[r, a:b] = torch.arange(b - a)
    out = []
    for position_ids in (pos, torch.arange(SEQ).expand(ROWS, SEQ)):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        labels[:, 3] = IGNORE_INDEX  # ignored targets count in neither loss nor denominator
        out.append({"input_ids": ids, "labels": labels, "position_ids": position_ids.contiguous()})
    return out


def documents(batch) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of the batch."""
    out = []
    for r in range(ROWS):
        pos = batch["position_ids"][r].tolist()
        starts = [t for t in range(SEQ) if pos[t] == 0] + [SEQ]
        out += [(r, a, b) for a, b in zip(starts, starts[1:])]
    return out


def _router_loss_fn(model):
    """transformers' own load_balancing_loss_func of the model's family (FSDP subclasses the model)."""
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))
    return importlib.import_module(cls.__module__).load_balancing_loss_func


def reference(model, batch, family: str, backward: bool = True) -> tuple[float, dict | None]:
    """Token-mean next-token loss (+ the router loss) of transformers' unsharded
    model in this process, each document run alone; and every gradient.

    The router loss is transformers' own function over the router logits of
    every document: the whole batch's tokens, as in one unsharded forward.
    """
    spec = FAMILIES[family]
    docs = documents(batch)
    total, router = 0.0, []
    for r, a, b in docs:
        kwargs = {"output_router_logits": True} if spec.moe else {}
        out = model(input_ids=batch["input_ids"][r : r + 1, a:b], **kwargs)
        target = batch["labels"][r, a + 1 : b]
        total = total + F.cross_entropy(out.logits[0, :-1], target, ignore_index=IGNORE_INDEX, reduction="sum")
        if spec.moe:
            router.append(out.router_logits)
    count = sum(int((batch["labels"][r, a + 1 : b] != IGNORE_INDEX).sum()) for r, a, b in docs)
    loss = total / count
    if spec.moe:
        logits = tuple(torch.cat(per_layer) for per_layer in zip(*router))
        aux = _router_loss_fn(model)(logits, model.num_experts, model.num_experts_per_tok)
        loss = loss + model.router_aux_loss_coef * aux
    if not backward:
        return loss.item(), None
    loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads


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


def attention_dims(config) -> tuple[int, int, int, int]:
    """(heads, kv heads as exchanged, q/k head dim, v head dim) of a text config."""
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # MLA: one k and v per head
        return heads, heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, config.num_key_value_heads, d, d


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


def _run_case(family, dims, opts, batch, ref_loss, ref_grads, world):
    from ulysses_dtensor.integrations.hf import parallelize_hf_model, shard_hf_batch

    spec = FAMILIES[family]
    pmesh, replica = build_pmesh(world, dims)  # every rank: the groups are made collectively
    if replica:
        # A second replica would repeat the first's work on other ranks, and
        # show nothing more: on 2 cores it only doubles the time.
        return None
    model = make_model(family)
    shown = dict(opts)
    counter = None
    if opts.get("compile"):
        # Counts the frames compiled: one graph serves every layer.
        counter = CompileCounterWithBackend(opts["compile_backend"])
        opts = {**opts, "compile_backend": counter}
    parallelize_hf_model(model, pmesh, attn_backend="sdpa", **opts)
    rows = ROWS // pmesh.dims.dp
    mine = slice(pmesh.dp_rank * rows, (pmesh.dp_rank + 1) * rows)
    local_batch = {k: v[mine] for k, v in batch.items()}
    if spec.features and "vl_rope" in spec.features:
        local_batch["position_ids"] = local_batch["position_ids"].expand(3, -1, -1)  # (3, B, S) multimodal ids
    inputs, labels = shard_hf_batch(local_batch, pmesh.sp)
    n = count_valid_tokens(labels, pmesh.loss)
    kwargs = {"output_router_logits": True} if spec.moe else {}
    with CollectiveCounter() as fwd:
        out = model(**inputs, **kwargs)
    loss = sp_cross_entropy(out.logits, labels, num_valid_tokens=n)
    if spec.moe:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
        # transformers' own value on this slice is not the batch's: the reduction matters.
        own = _router_loss_fn(model)(out.router_logits, model.num_experts, model.num_experts_per_tok)
        assert abs(own.item() - global_loss(out.aux_loss.detach(), pmesh.loss).item()) > 1e-4, family
    value = global_loss(loss.detach(), pmesh.loss).item()
    if not opts:
        # transformers' own loss with pre-shifted labels and the global count (+ the router share).
        with torch.no_grad():
            hf = model(**inputs, **kwargs, labels=labels, shift_labels=labels, num_items_in_batch=n).loss
        torch.testing.assert_close(hf, loss.detach(), rtol=1e-6, atol=1e-7)
    with CollectiveCounter() as bwd:
        loss.backward()

    heads, kv, d, dv = attention_dims(model.config.get_text_config())
    padded = -(-SEQ // dims[2]) * dims[2]
    a2a = (2 if opts.get("pack_qkv") else 4) * spec.layers
    want_fwd = {"all_to_all_single": a2a}
    if spec.moe:
        want_fwd["all_reduce"] = 1  # the router loss's expert counts over every rank
    assert fwd.counts() == want_fwd, (family, dims, fwd.counts())
    # Full AC replays the exchange in backward; selective AC saves its outputs.
    replay = 2 if opts.get("ac_mode") == "full" else 1
    assert bwd.counts() == {"all_to_all_single": a2a * replay}, (family, dims, bwd.counts())
    want_bytes = spec.layers * exchange_bytes_per_rank(rows, padded, heads, kv, d, dims[2], 4, backward=False,
                                                       v_head_dim=dv)
    assert fwd.sent_bytes("all_to_all_single") == want_bytes, (family, dims, fwd.sent_bytes(), want_bytes)

    loss_rel = abs(value - ref_loss) / abs(ref_loss)
    grad_rel, compared = 0.0, 0
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        assert p.grad is not None or not ref_grads[name].any(), (family, dims, name)
        rel = 0.0 if p.grad is None else _rel(p.grad.full_tensor(), ref_grads[name])
        assert rel <= GRAD_RTOL, (family, dims, shown, name, rel)
        grad_rel = max(grad_rel, rel)
        compared += 1
    assert compared == len(ref_grads), (family, compared, sorted(ref_grads))
    assert loss_rel <= LOSS_RTOL, (family, dims, value, ref_loss)
    if counter is not None:
        # fullgraph=True (transformers marks these models compilable), and
        # one graph serves both layers (no recompile per layer index).
        assert counter.frame_count == 1, counter.frame_count
    if "vl_rope" in spec.features:
        # The vision tower attends bidirectionally: left unwrapped, on its own implementation.
        vision = [m for m in model.model.visual.modules() if type(m).__name__.endswith("Attention")]
        assert vision and not any(hasattr(m, "ulysses") for m in vision)
        assert model.config.vision_config._attn_implementation == "eager"
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))
    return dict(family=family, model_class=cls.__name__, model_type=model.config.model_type, dims=list(dims),
                opts=shown, loss_rel=loss_rel,
                grad_rel=grad_rel, counts={"forward": fwd.counts(), "backward": bwd.counts()})


def _family_references(family: str, spec, packed, unpacked) -> dict:
    """The unsharded model's (loss, gradients) on each batch the family's meshes use."""
    compiled = any(o.get("compile") for o in spec.options)
    refs = {}
    for name, batch in (("packed", packed), ("unpacked", unpacked)):
        if name == "unpacked" and not compiled:
            continue
        refs[name] = reference(make_model(family), batch, family)
    for pattern, overrides in spec.off.items():
        # Each pattern changes the numbers (by 10x the loss tolerance at least):
        # a backend dropping it would fail the parity.
        off = make_model(family, **overrides)
        if pattern == "sinks":
            with torch.no_grad():
                for layer in off.model.layers:
                    layer.self_attn.sinks.fill_(float("-inf"))  # exp(-inf) = 0: no sink
        with torch.no_grad():
            off_loss, _ = reference(off, packed, family, backward=False)
        on_loss = refs["packed"][0]
        assert abs(off_loss - on_loss) > 10 * LOSS_RTOL * abs(on_loss), (family, pattern, off_loss, on_loss)
    return refs


def _parity_worker(rank: int, world: int) -> list[dict]:
    import torch.distributed as dist

    packed, unpacked = global_batches()
    results = []
    with registry_restored():
        # The references are the same on every rank (same seeds, same batches):
        # each rank computes every world-th family's, then all hold all of them.
        mine = {family: _family_references(family, spec, packed, unpacked)
                for i, (family, spec) in enumerate(FAMILIES.items()) if i % world == rank}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        all_refs = {family: refs for part in gathered for family, refs in part.items()}
        for family, spec in FAMILIES.items():
            refs = all_refs[family]
            for i, dims in enumerate(spec.meshes):
                opts = spec.options[i] if i < len(spec.options) else {}
                name = "unpacked" if opts.get("compile") else "packed"
                r = _run_case(family, dims, opts, packed if name == "packed" else unpacked, *refs[name], world)
                if r is not None:
                    results.append(r)
    return results


def test_hf_families_match_unsharded_on_every_mesh():
    results = run_ranks(4, _parity_worker)
    mine = results[0]
    for r in mine:
        print(f"{r['family']:12s} dims={tuple(r['dims'])} {r['opts']}: loss rel {r['loss_rel']:.1e}, "
              f"grad rel {r['grad_rel']:.1e}, fwd {r['counts']['forward']} bwd {r['counts']['backward']}")
    want = {(f, tuple(d)) for f, spec in FAMILIES.items() for d in spec.meshes}
    assert {(r["family"], tuple(r["dims"])) for r in mine} == want


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
        # Layers whose attention has a mask of its own (chunks) would attend within the local slice's chunks.
        llama4 = transformers.Llama4TextConfig(**{**tiny, "num_hidden_layers": 2}, num_attention_heads=4,
                                               num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                               intermediate_size_mlp=32, attention_chunk_size=4)
        refuse(auto.from_config(llama4), 2, "Llama4ForCausalLM", "'chunked_attention'")
        # Bidirectional attention is refused, never made causal.
        gemma3 = transformers.Gemma3TextConfig(**tiny, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                               use_bidirectional_attention=True)
        refuse(auto.from_config(gemma3), 2, "Gemma3ForCausalLM", "use_bidirectional_attention=True")
        # A named backend whose kernel lacks a layer's pattern, refused before anything runs.
        stand_in = SimpleNamespace(dims=ParallelDims(sp=2, dp_shard=1, world_size=2))
        msgs.append(_raises(lambda: parallelize_hf_model(make_model("gpt_oss"), stand_in, attn_backend="flash_attn"),
                            "GptOssForCausalLM", "'flash_attn' cannot apply attention sinks", "auto, sdpa, flex"))
        msgs.append(_raises(lambda: parallelize_hf_model(make_model("gemma2"), stand_in, attn_backend="varlen"),
                            "Gemma2ForCausalLM", "'varlen' cannot apply attention-logit soft-capping (softcap=0.5)"))
        # A ring mesh would not honour windows, soft-capping or sinks (nor lay the batch out for them).
        ring = SimpleNamespace(dims=ParallelDims(sp=4, ring=2, world_size=4))
        msgs.append(_raises(lambda: parallelize_hf_model(make_model("gemma2"), ring), "Gemma2ForCausalLM", "ring=2"))

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
        # Multimodal rope ids whose rows differ (vision tokens) do not tell the documents apart.
        mixed = {**b, "position_ids": torch.stack([b["position_ids"], b["position_ids"] * 2, b["position_ids"]])}
        msgs.append(_raises(lambda: shard_hf_batch(mixed, pmesh.sp), "(4, batch, seq)", "text positions first"))
        # The text path of a VL model only: image inputs are refused before any collective.
        vl = parallelize_hf_model(make_model("qwen2_5_vl"), pmesh)
        pixels = torch.zeros(4, 12)
        msgs.append(_raises(lambda: vl(**inputs, pixel_values=pixels), "Qwen2_5_VLForConditionalGeneration",
                            "pixel_values", "text path only"))
    return msgs


def test_unsupported_models_and_inputs_are_refused_by_name():
    msgs = run_ranks(4, _errors_worker)[0]
    print("\n".join(msgs))


# ---------------------------------------------------------------------------
# scripts/example_hf_custom_loop.py: its train() on the pooled ranks
# ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "scripts" / "example_hf_custom_loop.py"


def _example_worker(rank: int, world: int, argv: list[str]) -> dict:
    example = load_script(EXAMPLE)
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
    sources = [ROOT / "README.md", *sorted((ROOT / "ulysses_dtensor").rglob("*.py"))[:6]]
    data.write_text("".join(json.dumps({"text": f.read_text()[:4000]}) + "\n" for f in sources))
    model_dir, save_dir = tmp_path / "tiny", tmp_path / "trained"
    argv = ["--model_dir", str(model_dir), "--make_tiny", "--dataset", str(data), "--sp_size", "2",
            "--seq_len", "64", "--max_steps", "6", "--output_dir", str(save_dir)]
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

