"""What every export writes the same way: dtypes, shard sizes, the checkpoint's
``model.json``, and the tokenizer files next to the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..models.llama_checkpoint import HFCheckpointError
from ..trainer.checkpoint import COMPLETE_MARKER, MODEL_INFO_FILE

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


def read_info(ckpt: Path) -> dict:
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


def shard_plan(entries: list[tuple[str, tuple, int]], max_bytes: int) -> list[list[tuple[str, tuple]]]:
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


def copy_tokenizer(info: dict, out: Path) -> list[str]:
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
