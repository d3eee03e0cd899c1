"""Export of a checkpoint trained with LoRA adapters (``[lora]``).

The checkpoint holds the adapters (and ``modules_to_save``) only; the base is
the run's ``model.hf_path``. Two outputs:

* a peft adapter directory (default): ``adapter_config.json`` written by peft's
  own ``LoraConfig`` (``base_model_name_or_path`` = the base directory) and
  ``adapter_model.safetensors`` with the keys peft saves
  (``base_model.model.<module>.lora_A.weight``, ``base_model.model.<module>.weight``
  for a module saved whole), transformers' module names for either
  implementation; ``PeftModel.from_pretrained(base, OUT)`` gives the trainer's
  model. Refused when a context stage changed the rope (the base's config.json
  would not compute what the trainer computed: use ``--merge``).
* ``--merge``: the base's safetensors files rewritten in their own layout and
  file split, each adapted weight ``W + alpha/r * B @ A`` and each saved module
  the trained one, with the source config.json (the trained rope, the longest
  trained length) and tokenizer files: what ``from_pretrained`` loads.

Offline, one process, no process group; host memory: the adapters, and one base
file at a time when merging.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..integrations.lora import (
    ADAPTER,
    LoraSpec,
    base_name,
    is_adapter_param,
    lora_delta,
)
from ..models.llama_checkpoint import (
    HFCheckpointError,
    quiet_single_process,
    safetensors_files,
)

__all__ = ["export_lora_checkpoint", "hf_name_of"]


def _trained_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint (the adapters and saved modules), by name."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {k[len("model."):]: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in meta.items() if k.startswith("model.") and hasattr(v, "size")}
    with quiet_single_process():
        dcp.load({"model": state}, checkpoint_id=str(ckpt))
    return {base_name(k): v for k, v in state.items()}


def hf_name_of(info: dict):
    """Our checkpoint's parameter name -> transformers' in-memory name of the same parameter."""
    if info.get("implementation") == "transformers":
        return lambda name: name
    from ..models.llama import LlamaArgs
    from ..models.llama_checkpoint import hf_names

    names = hf_names(LlamaArgs.from_dict(info["args"]))

    def native(name: str) -> str:
        for suffix in (f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"):
            if name.endswith(suffix):
                return names[name[: -len(suffix)] + ".weight"][: -len(".weight")] + suffix
        return names[name]

    return native


def _adapters(ckpt: Path, info: dict) -> tuple[dict, dict]:
    """({module: (A, B)}, {parameter: tensor} of the saved modules), transformers' names."""
    rename = hf_name_of(info)
    pairs: dict[str, dict] = {}
    whole = {}
    for name, t in _trained_tensors(ckpt).items():
        name = rename(name)
        if is_adapter_param(name):
            module, which = name.rsplit(".lora_", 1)
            pairs.setdefault(module, {})[which[0]] = t
        else:
            whole[name] = t
    return {m: (ab["A"], ab["B"]) for m, ab in pairs.items()}, whole


def _spec(info: dict) -> LoraSpec:
    lo = info["lora"]
    return LoraSpec(rank=int(lo["rank"]), alpha=float(lo["alpha"]), dropout=float(lo["dropout"]),
                    target_modules=tuple(lo["target_modules"]), modules_to_save=tuple(lo["modules_to_save"]))


def _source_model(info: dict):
    from .transformers import _meta_model

    return _meta_model(info["hf_config"])


def _rope_changed(model, info: dict) -> bool:
    from ..integrations.hf.rotary import rope_support
    from ..models.rope import RopeConfig

    return bool(info.get("rope")) and RopeConfig.from_dict(info["rope"]) != rope_support(model).rope


def _write_adapter(out: Path, info: dict, adapters: dict, whole: dict, dtype: torch.dtype) -> int:
    from peft import LoraConfig
    from safetensors.torch import save_file

    spec = _spec(info)
    tensors = {}
    for module, (a, b) in adapters.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype).contiguous()
    for name, t in whole.items():
        tensors[f"base_model.model.{name}"] = t.to(dtype).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, bias="none",
               target_modules=list(spec.target_modules), modules_to_save=list(spec.modules_to_save) or None,
               base_model_name_or_path=info["hf_path"]).save_pretrained(str(out))
    return len(tensors)


def _write_merged(out: Path, info: dict, model, adapters: dict, whole: dict, dtype: torch.dtype | None) -> int:
    """The base's files with the adapters merged; returns the tensors changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    scaling = _spec(info).scaling
    changes = {f"{m}.weight": lora_delta(a, b, scaling) for m, (a, b) in adapters.items()}
    replace = dict(whole)
    # In-memory names -> the files' keys (transformers' own renaming, e.g. a VL decoder's prefix).
    on_disk = {}
    for table in (changes, replace):
        for name in list(table):
            (key,) = revert_weight_conversion(model, {name: table[name]}).keys()
            on_disk[key] = (table is changes, table.pop(name))
    src = Path(info["hf_path"])
    files = safetensors_files(src)
    found = set()
    for f in files:
        tensors = {}
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                t = fh.get_tensor(key)
                if key in on_disk:
                    add, value = on_disk[key]
                    if tuple(value.shape) != tuple(t.shape):
                        raise HFCheckpointError(f"{f}: {key} has shape {tuple(t.shape)}, the trained "
                                                f"{'delta' if add else 'module'} {tuple(value.shape)}")
                    t = (t.float() + value).to(t.dtype) if add else value.to(t.dtype)
                    found.add(key)
                tensors[key] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    missing = sorted(set(on_disk) - found)
    if missing:
        raise HFCheckpointError(f"{src} lacks the base weights {', '.join(missing[:6])} the adapters merge into")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        shutil.copyfile(index, out / index.name)
    return len(found)


def export_lora_checkpoint(ckpt: Path, out: Path, info: dict, *, merge: bool, dtype: str | None) -> Path:
    """Write ``out`` (a peft adapter directory, or with ``merge`` full weights) from the LoRA
    checkpoint ``ckpt``."""
    from .files import DTYPES, copy_tokenizer

    if not info.get("hf_path") or not Path(info["hf_path"]).is_dir():
        raise HFCheckpointError(f"{ckpt} holds LoRA adapters of the base model.hf_path={info.get('hf_path')!r}, "
                                f"which is not a directory here: the export reads the base from it")
    if dtype is not None and dtype not in DTYPES:
        raise HFCheckpointError(f"--dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if out.is_dir() and any(out.glob("*.safetensors")):
        raise HFCheckpointError(f"--out {str(out)!r} already holds *.safetensors files; give a new or empty directory")
    model = _source_model(info)
    adapters, whole = _adapters(ckpt, info)
    out.mkdir(parents=True, exist_ok=True)
    if merge:
        from .transformers import _trained_config

        n = _write_merged(out, info, model, adapters, whole, DTYPES[dtype] if dtype else None)
        config, note = _trained_config(model, info["hf_config"], info)
        if dtype:
            config.update(dtype=dtype, torch_dtype=dtype)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        what = f"merged full weights ({n} tensors changed: {len(adapters)} adapted, {len(whole)} trained whole)"
    else:
        if _rope_changed(model, info):
            raise HFCheckpointError(
                f"{ckpt} was trained with a context stage's rope ({info['rope']}) other than the base's: a peft "
                f"adapter on {info['hf_path']} would run the base's rope; export with --merge (its config.json "
                f"has the trained rope)")
        n = _write_adapter(out, info, adapters, whole, DTYPES[dtype or "float32"])
        what = f"peft adapter directory ({n} tensors: {len(adapters)} adapted modules, {len(whole)} saved whole)"
        note = None
    copied = copy_tokenizer(info, out)
    print(f"exported {ckpt} -> {out}: {what} of {info['hf_path']}; tokenizer files: {', '.join(copied) or 'none'}")
    if note:
        print(f"note: {note}")
    return out
