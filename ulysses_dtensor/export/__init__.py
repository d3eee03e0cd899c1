"""Export a trainer checkpoint to a Hugging Face model directory.

    python -m ulysses_dtensor.export --checkpoint DUMP/checkpoint/step-N --out OUT
        [--dtype bfloat16] [--max-shard-size 5GB] [--merge]

A LoRA run's checkpoint (``[lora]``) is written as a peft adapter directory, or
with ``--merge`` as full weights in the base's layout (:mod:`.adapters`).

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
import sys
from pathlib import Path

from ..models.llama_checkpoint import HFCheckpointError, require_safetensors
from .files import DTYPES, parse_size, read_info
from .native import export_llama_checkpoint

__all__ = ["export_checkpoint", "main", "parse_size"]


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

    ckpt, out = Path(checkpoint), Path(out)
    info = read_info(ckpt)
    if info.get("lora"):
        from .adapters import export_lora_checkpoint

        return export_lora_checkpoint(ckpt, out, info, merge=merge, dtype=dtype)
    if merge:
        raise HFCheckpointError(f"--merge: {ckpt} holds every weight of the model (no [lora] adapters to merge); "
                                f"export it without --merge")
    if info.get("implementation") == "transformers":  # a transformers model: its own layout
        from .transformers import export_transformers_checkpoint

        return export_transformers_checkpoint(ckpt, out, info, dtype=dtype, max_shard_size=max_shard_size)
    return export_llama_checkpoint(ckpt, out, info, dtype=dtype, max_shard_size=max_shard_size)


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
