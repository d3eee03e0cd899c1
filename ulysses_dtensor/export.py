"""Export a trainer checkpoint to a Hugging Face model directory.

    python -m ulysses_dtensor.export --checkpoint DUMP/checkpoint/step-N --out OUT
        [--dtype bfloat16] [--max-shard-size 5GB] [--merge]

A LoRA run's checkpoint (``[lora]``) is written as a peft adapter directory, or
with ``--merge`` as full weights in the base's layout (:mod:`.export_lora`).

Writes ``OUT/config.json`` (the source model's config when the run started from
``model.hf_path``, else one built from the model args) with the rope the
checkpoint was trained with last (its context stage's: after a schedule of rope
changes, the last stage's) and ``max_position_embeddings`` = the longest trained
sequence or the source's when larger, adjusted as the rope type needs
(``hf_checkpoint.hf_rope_fields``), ``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, and the
tokenizer files of the source directory (or the trained ``tokenizer.json``).
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads the result.

Runs offline in one process, no process group: ``torch.distributed.checkpoint``
reads the model entries of the DCP checkpoint (written by any mesh) one output
shard at a time, so host memory is bounded by one shard, not the model. Models
of our own flavors (interleaved rope layout) get their q/k rows permuted to the
rotate-half layout HF uses.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from .models.hf_checkpoint import (
    HFCheckpointError,
    hf_config_from_args,
    hf_names,
    interleaved_to_half,
    quiet_single_process,
    require_safetensors,
    rope_rows,
    write_hf_rope,
)
from .models.llama import Llama, LlamaArgs
from .models.rope import RopeConfig
from .trainer.checkpoint import COMPLETE_MARKER, MODEL_INFO_FILE

__all__ = ["export_checkpoint", "main", "parse_size"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"200KB"`` or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            t, scale = t[: -len(unit)], mult
            break
    else:
        scale = 1
    try:
        value = int(float(t) * scale)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--max-shard-size {text!r} must be a size like 5GB, 500MB or a byte count")
    return value


def _read_info(ckpt: Path) -> dict:
    if not (ckpt / COMPLETE_MARKER).is_file():
        raise HFCheckpointError(
            f"--checkpoint {str(ckpt)!r} is not a complete checkpoint folder (no "
            f"{COMPLETE_MARKER} file); give DUMP/checkpoint/step-N"
        )
    info = ckpt / MODEL_INFO_FILE
    if not info.is_file():
        raise HFCheckpointError(
            f"{ckpt} has no {MODEL_INFO_FILE} (saved before export support); resume it for one "
            "step with checkpoint.enable=true to write a checkpoint that can be exported"
        )
    return json.loads(info.read_text())


def _shard_plan(entries: list[tuple[str, tuple, int]], max_bytes: int) -> list[list[tuple[str, tuple]]]:
    """Consecutive groups of (name, shape) of at most max_bytes each (a larger tensor alone)."""
    groups: list[list] = [[]]
    size = 0
    for name, shape, nbytes in entries:
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    return groups


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    merge: bool = False,
) -> Path:
    """Write the HF model directory ``out`` from the trainer checkpoint folder ``checkpoint``
    (a LoRA checkpoint: a peft adapter directory, or with ``merge`` merged full weights)."""
    require_safetensors("ulysses_dtensor.export")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    ckpt, out = Path(checkpoint), Path(out)
    info = _read_info(ckpt)
    if info.get("lora"):
        from .export_lora import export_lora_checkpoint

        return export_lora_checkpoint(ckpt, out, info, merge=merge, dtype=dtype)
    if merge:
        raise HFCheckpointError(f"--merge: {ckpt} holds every weight of the model (no [lora] adapters to merge); "
                                f"export it without --merge")
    if info.get("implementation") == "transformers":  # a transformers model: its own layout
        from .export_transformers import export_transformers_checkpoint

        return export_transformers_checkpoint(ckpt, out, info, dtype=dtype, max_shard_size=max_shard_size)
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
    groups = _shard_plan(entries, max_bytes)
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
    copied = _copy_tokenizer(info, out)
    print(
        f"exported {ckpt} -> {out}: {len(names)} tensors, {total / 1e6:.1f} MB {dtype} in "
        f"{n_files} file(s); rope {rope.describe()}, max_position_embeddings "
        f"{config['max_position_embeddings']}; tokenizer files: {', '.join(copied) or 'none'}"
        + (f"\nnote: {note}" if note else "")
    )
    return out


def _copy_tokenizer(info: dict, out: Path) -> list[str]:
    copied = []
    src = info.get("hf_path")
    if src and Path(src).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(src) / name).is_file():
                shutil.copyfile(Path(src) / name, out / name)
                copied.append(name)
    tok = info.get("tokenizer")
    if "tokenizer.json" not in copied and tok and tok != "byte" and Path(tok).is_file():
        shutil.copyfile(tok, out / "tokenizer.json")
        copied.append("tokenizer.json")
    return copied


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ulysses_dtensor.export",
        description="Write a Hugging Face model directory from a trainer checkpoint.",
    )
    p.add_argument("--checkpoint", required=True, help="DUMP/checkpoint/step-N (a complete checkpoint)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="tensor dtype (default: the source model's, else float32)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file (default 5GB; a merged LoRA export keeps the base's files)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA checkpoints: merge the adapters into the base weights (default: a peft adapter directory)")
    a = p.parse_args(argv)
    try:
        export_checkpoint(a.checkpoint, a.out, dtype=a.dtype, max_shard_size=a.max_shard_size, merge=a.merge)
    except (HFCheckpointError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
