"""Hugging Face checkpoints: config.json -> LlamaArgs, parameter names both ways,
and sharded loading of ``*.safetensors`` into a (possibly FSDP2-sharded) Llama.

Supported families: Llama 3.x, Mistral, Qwen2 / Qwen2.5, Qwen3 -- decoders with
SwiGLU MLPs, RMSNorm, GQA and every rope type transformers computes (``default``,
``linear``, ``dynamic``, ``yarn``, ``llama3``, ``longrope``; ``models/rope.py``). A model
built from their config uses ``rope_layout="half"``: HF stores q/k projections
for the rotate-half layout, so the weights load unpermuted and every FSDP shard
is a plain row range of the file's tensor. Our own flavors use Meta's
interleaved layout; :func:`interleaved_to_half` converts their q/k rows on
export (offline, on full tensors).

Loading goes through ``torch.distributed.checkpoint`` with its
``HuggingFaceStorageReader``: the state dict handed to ``dcp.load`` holds the
model's own (DTensor) parameters under HF names, so each rank reads only the
slices its shards cover (``safe_open(...).get_slice(name)[rows]``) and copies
them in place, converting the dtype (bf16 files into fp32 parameters).

Needs the ``safetensors`` package (``pip install 'ulysses-dtensor[hf]'``);
``transformers`` is not needed to load or export.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from .llama import LlamaArgs
from .rope import ROPE_TYPES, RopeConfig, RopeError

__all__ = [
    "HF_EXTRA_MSG",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "HFCheckpointError",
    "args_from_hf_config",
    "checkpoint_tensor_shapes",
    "hf_config_from_args",
    "hf_names",
    "hf_rope_fields",
    "interleaved_to_half",
    "load_hf_weights",
    "read_hf_config",
    "require_safetensors",
    "rope_from_hf_config",
    "safetensors_files",
    "write_hf_rope",
]

HF_EXTRA_MSG = (
    "{what} needs the optional 'safetensors' package (and 'transformers' to use the "
    "result with Hugging Face): pip install 'ulysses-dtensor[hf]'"
)

# architectures[0] of config.json -> (model_type, what the family needs from LlamaArgs).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 3.x (3.2 1B/3B: tied embeddings)
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",  # Qwen2, Qwen2.5: q/k/v bias
    "Qwen3ForCausalLM": "qwen3",  # q/k RMSNorm, own head_dim
}
SUPPORTED_ROPE_TYPES = ROPE_TYPES  # every rope type transformers computes for these families
# Buffers some old checkpoints carry; recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFCheckpointError(ValueError):
    """A Hugging Face model directory this code cannot load; the message says why."""


def require_safetensors(what: str = "loading a Hugging Face checkpoint") -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ImportError(HF_EXTRA_MSG.format(what=what)) from None


# ---------------------------------------------------------------------------
# config.json <-> LlamaArgs
# ---------------------------------------------------------------------------


def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of the model directory ``path``."""
    d = Path(path)
    if not d.is_dir():
        raise HFCheckpointError(
            f"model.hf_path={str(path)!r} is not a directory; give a local directory with "
            "config.json and *.safetensors (as save_pretrained writes them)"
        )
    f = d / "config.json"
    if not f.is_file():
        raise HFCheckpointError(f"model.hf_path={str(path)!r} has no config.json")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{f} is not valid JSON: {e}") from None


def _architecture(cfg: dict, where: str) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFCheckpointError(
            f"{where}: architectures={archs!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 3.x, Mistral, Qwen2/2.5, Qwen3)"
        )
    return SUPPORTED_ARCHITECTURES[arch]


def rope_from_hf_config(cfg: dict, *, where: str = "config.json", head_dim: int | None = None) -> RopeConfig:
    """The rope of an HF config, as transformers 5 standardizes it.

    transformers 5 writes ``rope_parameters`` (theta inside); 4.x wrote
    ``rope_theta`` + ``rope_scaling`` (``type`` for ``rope_type``). ``llama3`` /
    ``yarn`` / ``longrope`` without an original length take
    ``max_position_embeddings`` (a top-level ``original_max_position_embeddings``
    wins, as for Phi-3); ``dynamic`` grows beyond ``max_position_embeddings``;
    ``longrope`` without ``factor`` has ``max_position_embeddings / original``.
    """
    table = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if "type" in table:
        table.setdefault("rope_type", table.pop("type"))
    table.setdefault("rope_type", "default")
    if table.get("rope_theta") is None:
        table["rope_theta"] = cfg.get("rope_theta") or 10000.0
    if "partial_rotary_factor" in cfg:
        table.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    max_pos = cfg.get("max_position_embeddings")
    if table["rope_type"] in ("llama3", "yarn", "longrope"):
        if cfg.get("original_max_position_embeddings"):
            table["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif table.get("original_max_position_embeddings") is None and max_pos:
            table["original_max_position_embeddings"] = max_pos
    if table["rope_type"] == "dynamic":
        table.pop("original_max_position_embeddings", None)  # transformers reads max_position_embeddings
    if table["rope_type"] == "yarn" and table.get("factor") is None and max_pos and table.get(
            "original_max_position_embeddings"):
        table["factor"] = max_pos / table["original_max_position_embeddings"]
    try:
        return RopeConfig.from_parameters(table, where=f"{where}: rope_parameters", head_dim=head_dim,
                                          max_position_embeddings=max_pos)
    except RopeError as e:
        raise HFCheckpointError(str(e)) from None


def hf_rope_fields(
    rope: RopeConfig, *, trained_len: int, source: dict | None = None
) -> tuple[dict, str | None]:
    """(config.json fields, a note or None) that make transformers compute ``rope``.

    ``max_position_embeddings`` is the longest trained sequence, or the source
    config's when larger, then what the rope type needs to load without a
    warning: ``llama3`` more than its original length (``factor x original``
    when the run stayed within it); ``yarn`` exactly ``factor x original``, the
    length it extends to (if training went beyond that, the longest trained, and
    transformers will warn: the note says so); ``dynamic`` its original length,
    which is that type's parameter in transformers. The source config's spelling is kept (``rope_parameters``, or
    ``rope_theta`` + ``rope_scaling`` as transformers 4.x and vLLM read them).
    """
    source = source or {}
    trained = int(trained_len or 0)
    max_pos, note = max(trained, int(source.get("max_position_embeddings") or 0)), None
    orig = rope.original_max_position_embeddings
    if rope.rope_type == "llama3" and max_pos <= orig:
        max_pos = int(round(rope.factor * orig))
    elif rope.rope_type == "yarn":
        extended = int(round(rope.factor * orig))
        max_pos = max(extended, trained)
        if trained > extended:
            note = (f"max_position_embeddings={trained} (the longest trained) exceeds the yarn rope's "
                    f"factor x original_max_position_embeddings = {extended}: transformers will log a "
                    "warning on load (the model computes the same)")
    elif rope.rope_type == "dynamic":
        max_pos = orig
    params = rope.parameters()
    fields: dict = {"max_position_embeddings": max_pos}
    if "rope_parameters" in source and source.get("rope_parameters") is not None:
        fields.update(rope_parameters=params)
    else:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        fields.update(rope_theta=rope.theta, rope_scaling=None if rope.rope_type == "default" else scaling)
    return fields, note


def write_hf_rope(config: dict, rope: RopeConfig, *, trained_len: int) -> str | None:
    """Put ``rope`` and ``max_position_embeddings`` into the HF ``config`` dict in place
    (every older rope key removed); return :func:`hf_rope_fields`' note."""
    fields, note = hf_rope_fields(rope, trained_len=trained_len, source=config)
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "original_max_position_embeddings",
                "partial_rotary_factor"):
        config.pop(key, None)
    config.update(fields)
    return note


def _reject_unsupported(cfg: dict, family: str, where: str) -> None:
    """Features of these families that this model does not implement."""
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r} (only 'silu')")
    if family in ("llama", "mistral", "qwen3") and cfg.get("attention_bias"):
        problems.append("attention_bias=true (bias on q/k/v/o projections)")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if family == "mistral" and cfg.get("sliding_window") is not None:
        problems.append(
            f"sliding_window={cfg['sliding_window']} (attention here is full causal; set it "
            "to null in config.json to train this model with full attention)"
        )
    if family.startswith("qwen") and cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        problems.append(f"layer_types {sorted(kinds)} (only full_attention)")
    if cfg.get("quantization_config"):
        problems.append("quantization_config (quantized weights)")
    if problems:
        raise HFCheckpointError(f"{where}: not supported: {'; '.join(problems)}")


def args_from_hf_config(cfg: dict, *, attn_backend: str = "auto", where: str = "config.json") -> LlamaArgs:
    """LlamaArgs (``rope_layout="half"``) of an HF config dict, or an HFCheckpointError."""
    family = _architecture(cfg, where)
    _reject_unsupported(cfg, family, where)
    try:
        dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        fields = dict(
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=int(cfg["vocab_size"]),
            ffn_dim=int(cfg["intermediate_size"]),
            explicit_head_dim=int(cfg.get("head_dim") or dim // heads),
        )
    except KeyError as e:
        raise HFCheckpointError(f"{where} lacks {e.args[0]!r}") from None
    rope = rope_from_hf_config(cfg, where=where, head_dim=fields["explicit_head_dim"])
    try:
        return LlamaArgs(
            **fields,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_backend=attn_backend,
            rope_layout="half",
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            rope=rope,
        )
    except ValueError as e:
        raise HFCheckpointError(f"{where}: {e}") from None


def hf_config_from_args(args: LlamaArgs, *, rope: RopeConfig | None = None, trained_len: int = 0) -> dict:
    """An HF config dict for a model trained from our args (no source config).

    ``rope``: the rope the model was trained with last (default ``args.rope``);
    ``trained_len``: the longest trained sequence (see :func:`hf_rope_fields`).
    """
    if args.qkv_bias and args.qk_norm:
        raise HFCheckpointError("no supported HF architecture has both q/k/v bias and q/k norm")
    arch, model_type = "LlamaForCausalLM", "llama"
    if args.qkv_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    elif args.qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }
    # rope_theta + rope_scaling: the 4.x spelling, which transformers 5 and vLLM read.
    write_hf_rope(config, rope or args.rope, trained_len=trained_len)
    return config


# ---------------------------------------------------------------------------
# Names and layouts
# ---------------------------------------------------------------------------

_LAYER_NAMES = (
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
)
_BIAS_NAMES = tuple((f"attention.w{x}.bias", f"self_attn.{x}_proj.bias") for x in "qkv")
_QK_NORM_NAMES = (
    ("attention.q_norm.weight", "self_attn.q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight"),
)


def hf_names(args: LlamaArgs) -> dict[str, str]:
    """Our parameter name -> HF name, for every parameter stored once.

    With tied embeddings ``output.weight`` is ``tok_embeddings.weight`` and is
    left out (HF stores only ``model.embed_tokens.weight`` then).
    """
    names = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    pairs = _LAYER_NAMES + (_BIAS_NAMES if args.qkv_bias else ()) + (_QK_NORM_NAMES if args.qk_norm else ())
    for i in range(args.n_layers):
        for ours, theirs in pairs:
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    names["norm.weight"] = "model.norm.weight"
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def rope_rows(name: str) -> str | None:
    """``"q"`` / ``"k"`` for parameters whose head_dim entries rope rotates (q/k
    projection rows, their bias, their norm weight), else None."""
    for x in ("q", "k"):
        if f"attention.w{x}." in name or f"attention.{x}_norm." in name:
            return x
    return None


def interleaved_to_half(t: Tensor, head_dim: int) -> Tensor:
    """Reorder each head's ``head_dim`` rows from pairs (2i, 2i+1) to (i, i + head_dim/2).

    ``t``: a q/k projection weight ``(heads * head_dim, dim)``, its bias, or a
    q/k norm weight ``(head_dim,)``. A model with the interleaved layout and
    weights ``W`` equals one with the half layout and ``interleaved_to_half(W)``.
    """
    rest = t.shape[1:]
    return t.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a model directory (those its index lists, if it has one)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({path / f for f in weight_map.values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{path} holds no *.safetensors file (PyTorch .bin files are not read)")
    return files


def checkpoint_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model directory (headers only)."""
    require_safetensors()
    from safetensors import safe_open

    shapes = {}
    for f in safetensors_files(Path(path)):
        if not f.is_file():
            raise HFCheckpointError(f"{f} is listed in model.safetensors.index.json but missing")
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                shapes[key] = tuple(fh.get_slice(key).get_shape())
    return shapes


def _check_names_and_shapes(expected: dict[str, tuple], found: dict[str, tuple], path) -> None:
    missing = sorted(set(expected) - set(found))
    extra = sorted(
        k for k in set(found) - set(expected)
        if not k.endswith(_IGNORED_SUFFIXES) and k != "lm_head.weight"  # a tied copy
    )
    wrong = [f"{k} {found[k]} (config.json implies {expected[k]})" for k in expected
             if k in found and tuple(found[k]) != tuple(expected[k])]
    for what, items in (("lacks", missing), ("has tensors this model would ignore:", extra),
                        ("has tensors of the wrong shape:", wrong)):
        if items:
            shown = ", ".join(items[:6]) + (f" ... ({len(items)} in all)" if len(items) > 6 else "")
            raise HFCheckpointError(f"{path} {what} {shown}")


def _canonical(name: str) -> str:
    # compile's and checkpointing's wrappers, and peft's (a LoRA layer keeps the weight in base_layer)
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "").replace("base_layer.", "")


def load_hf_weights(model: nn.Module, path: str | os.PathLike, *, ignore=None) -> None:
    """Load an HF model directory into ``model`` (a Llama built from its config) in place.

    Works on a plain model and on a parallelized one after ``to_empty``: the
    parameters stay where they are (DTensor shards included) and each rank reads
    only its slices. Every rank of the default process group must call it
    (``dcp.load`` plans collectively); without a process group it runs alone.
    ``ignore(name)``: parameters added on top of the model that the checkpoint
    does not hold (LoRA adapters), left as they are.
    """
    require_safetensors()
    args: LlamaArgs = model.args
    if args.rope_layout != "half":
        raise HFCheckpointError(
            "load_hf_weights needs a model with rope_layout='half' (build its args with "
            "args_from_hf_config): HF checkpoints store q/k for the rotate-half layout"
        )
    names = hf_names(args)
    params = {_canonical(n): p for n, p in model.named_parameters() if ignore is None or not ignore(n)}
    unmapped = sorted(set(params) - set(names) - ({"output.weight"} if args.tie_embeddings else set()))
    if unmapped:
        raise HFCheckpointError(f"no HF name for parameters {unmapped}")
    # The parameters themselves (detached views, DTensor shards as they are): dcp
    # copies each rank's slices into them in place.
    read_hf_tensors_into({names[n]: params[n].detach() for n in names}, path)


def read_hf_tensors_into(state: dict[str, Tensor], path: str | os.PathLike) -> None:
    """Fill ``state`` (HF tensor name -> this rank's tensor, DTensor shards included)
    in place from the safetensors files of ``path``; each rank reads only its slices.

    Names and shapes are checked against the files' headers first, so a wrong
    directory fails with one message rather than inside dcp. Collective over the
    default process group when there is one.
    """
    require_safetensors()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    _check_names_and_shapes({k: tuple(v.shape) for k, v in state.items()},
                            checkpoint_tensor_shapes(path), path)
    # One reader thread: one slice in flight, so a rank's peak host memory is its
    # shard plus one tensor (threads would multiply the temporaries and malloc arenas).
    with torch.no_grad(), quiet_single_process():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))


@contextlib.contextmanager
def quiet_single_process():
    """dcp without a process group runs in one process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
