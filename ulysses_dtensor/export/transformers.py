"""Export of a checkpoint trained with ``model.implementation = "transformers"``.

The checkpoint's model entries already carry the transformers model's own
parameter names (the trainer keeps them). What the export adds is the
checkpoint *layout*: transformers 5 stores some families in memory in another
layout than on disk (fused MoE experts, ...), and the files are written the way
``save_pretrained`` writes them (transformers' own reverse conversion), so that
``from_pretrained``, vLLM and the Hub tools read them as they read the source.
A run whose context stages changed the rope gets the last trained stage's rope
in config.json (``hf_rope.export_rope_fields``), written so ``from_pretrained``
computes what the trainer computed.

Offline, one process, no process group: the tensors are read from the DCP
checkpoint one decoder layer at a time (a conversion never spans layers), so
host memory is bounded by one output shard, not the model. ``config.json`` is
the source model's, ``max_position_embeddings`` raised to the longest trained
sequence; the tokenizer files of the source directory are copied. A multimodal
model (Qwen2.5-VL) is written whole: the trained text path and the (frozen)
vision tower, under the names ``save_pretrained`` gives them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..models.llama_checkpoint import HFCheckpointError, quiet_single_process

__all__ = ["export_transformers_checkpoint"]

_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def _meta_model(source: dict):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..integrations.hf.causal_lm import auto_model_class

    model_type = source.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise HFCheckpointError(f"the checkpoint's source config has model_type={model_type!r}, unknown to "
                                f"this transformers")
    cls = CONFIG_MAPPING[model_type]
    # config.json spells inf / nan as {"__float__": "Infinity"} (Mamba-2 hybrids' time_step_limit):
    # decoded as transformers' own from_pretrained does.
    decode = getattr(cls, "_decode_special_floats", lambda d: d)
    config = cls.from_dict(decode(dict(source)))
    try:
        cls = auto_model_class(config)  # the class the trainer built (a VL model's image-text-to-text class)
    except ValueError as e:
        raise HFCheckpointError(f"the checkpoint's source config: {e}") from None
    with torch.device("meta"):
        return cls.from_config(config, dtype=torch.float32)


def _groups(names: list[str]) -> list[list[str]]:
    """Tensor names grouped by decoder layer (each other tensor alone), in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _LAYER.match(name)
        groups.setdefault(m.group(1) if m else name, []).append(name)
    return list(groups.values())


def _raise_max_len(config: dict, max_len: int) -> dict:
    config = dict(config)
    holder = config
    if "max_position_embeddings" not in config and isinstance(config.get("text_config"), dict):
        holder = config["text_config"] = dict(config["text_config"])
    if "max_position_embeddings" in holder:
        holder["max_position_embeddings"] = max(int(holder["max_position_embeddings"] or 0), max_len)
    return config


def _trained_config(model, source: dict, info: dict) -> tuple[dict, str | None]:
    """The source config.json with the rope the checkpoint trained with last (when a
    context stage changed it) and max_position_embeddings raised to the longest trained."""
    from ..integrations.hf.rotary import export_rope_fields, rope_support
    from ..models.rope import RopeConfig

    max_len = int(info.get("max_seq_len") or 0)
    trained = RopeConfig.from_dict(info["rope"]) if info.get("rope") else None
    if trained is None or trained == rope_support(model).rope:
        return _raise_max_len(source, max_len), None
    return export_rope_fields(source, trained, trained_len=max_len)


def export_transformers_checkpoint(ckpt: Path, out: Path, info: dict, *, dtype: str | None,
                                   max_shard_size: str | int) -> Path:
    """Write ``out`` from the trainer checkpoint ``ckpt`` of a transformers model."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    from ..integrations.hf.weights import unique_state_dict
    from .files import DTYPES, copy_tokenizer, parse_size

    source = info.get("hf_config")
    if not source:
        raise HFCheckpointError(f"{ckpt}/model.json has no source config.json (hf_config); cannot export")
    dtype = dtype or source.get("dtype") or source.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise HFCheckpointError(f"--dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    torch_dtype, max_bytes = DTYPES[dtype], parse_size(max_shard_size)
    model = _meta_model(source)
    meta = unique_state_dict(model)  # the checkpoint's names; a tied head once
    if out.is_dir() and any(out.glob("*.safetensors")):
        raise HFCheckpointError(
            f"--out {str(out)!r} already holds *.safetensors files (a loader would mix them with "
            "this export); give a new or empty directory")

    def out_bytes(name: str) -> int:
        t = meta[name]
        return t.numel() * (torch_dtype.itemsize if t.is_floating_point() else t.element_size())

    files: list[list[list[str]]] = [[]]
    size = 0
    for group in _groups(list(meta)):
        nbytes = sum(out_bytes(n) for n in group)
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(group)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total, written = {}, 0, 0
    for i, groups in enumerate(files, start=1):
        name = "model.safetensors" if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for group in groups:
            state = {n: torch.empty(meta[n].shape, dtype=meta[n].dtype) for n in group}
            with quiet_single_process():
                dcp.load({"model": state}, checkpoint_id=str(ckpt))
            state = {n: t.to(torch_dtype) if t.is_floating_point() else t for n, t in state.items()}
            for key, t in revert_weight_conversion(model, state).items():  # the on-disk layout
                tensors[key] = t.contiguous()
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
        written += len(tensors)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config, note = _trained_config(model, source, info)
    config.update(dtype=dtype, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copied = copy_tokenizer(info, out)
    print(f"exported {ckpt} -> {out}: {type(model).__name__} (transformers), {written} tensors, "
          f"{total / 1e6:.1f} MB {dtype} in {len(files)} file(s); tokenizer files: {', '.join(copied) or 'none'}")
    if note:
        print(f"note: {note}")
    return out
