"""Export of a checkpoint of our own Llama (``model.implementation = "native"``).

Models of our own flavors (interleaved rope layout) get their q/k rows permuted
to the rotate-half layout HF uses; ``config.json`` is the source model's when the
run started from ``model.hf_path``, else one built from the model args.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.llama import Llama, LlamaArgs
from ..models.llama_checkpoint import (
    HFCheckpointError,
    hf_config_from_args,
    hf_names,
    interleaved_to_half,
    quiet_single_process,
    rope_rows,
    write_hf_rope,
)
from ..models.rope import RopeConfig
from .files import DTYPES, copy_tokenizer, parse_size, shard_plan


def export_llama_checkpoint(ckpt: Path, out: Path, info: dict, *, dtype: str | None,
                            max_shard_size: str | int) -> Path:
    """Write the HF model directory ``out`` from the Llama checkpoint ``ckpt``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    args = LlamaArgs.from_dict(info["args"])
    source = info.get("hf_config")
    dtype = dtype or (source or {}).get("dtype") or (source or {}).get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise HFCheckpointError(f"--dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    max_bytes = parse_size(max_shard_size)

    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Llama(args).named_parameters()}
    names = hf_names(args)
    entries = [(n, shapes[n], torch.Size(shapes[n]).numel() * torch_dtype.itemsize) for n in names]
    groups = shard_plan(entries, max_bytes)
    n_files = len(groups)

    if out.is_dir() and any(out.glob("*.safetensors")):
        raise HFCheckpointError(
            f"--out {str(out)!r} already holds *.safetensors files (a loader would mix them with "
            "this export); give a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        file = "model.safetensors" if n_files == 1 else f"model-{i:05d}-of-{n_files:05d}.safetensors"
        state = {n: torch.empty(shape, dtype=torch.float32) for n, shape in group}
        with quiet_single_process():
            dcp.load({"model": state}, checkpoint_id=str(ckpt))
        tensors = {}
        for n, t in state.items():
            if args.rope_layout == "interleaved" and rope_rows(n):
                t = interleaved_to_half(t, args.head_dim)
            tensors[names[n]] = t.to(torch_dtype).contiguous()
            weight_map[names[n]] = file
            total += tensors[names[n]].numel() * torch_dtype.itemsize
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del state, tensors
    if n_files > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    # The rope the checkpoint was trained with last (its context stage's), and the
    # longest sequence trained up to it.
    rope = RopeConfig.from_dict(info["rope"]) if info.get("rope") else args.rope
    max_len = int(info.get("max_seq_len") or 0)
    note = None
    if source is not None:
        config = dict(source)
        note = write_hf_rope(config, rope, trained_len=max_len)
    else:
        config = hf_config_from_args(args, rope=rope, trained_len=max_len)
    # "dtype" is what transformers 5 reads, "torch_dtype" what 4.x (and tools built on it) read.
    config.update(dtype=dtype, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copied = copy_tokenizer(info, out)
    print(
        f"exported {ckpt} -> {out}: {len(names)} tensors, {total / 1e6:.1f} MB {dtype} in "
        f"{n_files} file(s); rope {rope.describe()}, max_position_embeddings "
        f"{config['max_position_embeddings']}; tokenizer files: {', '.join(copied) or 'none'}"
        + (f"\nnote: {note}" if note else "")
    )
    return out
