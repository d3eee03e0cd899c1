"""Entry point: tokenize raw documents once into a token store for training.

    python -m ulysses_dtensor.prepare_data --input PATH [PATH ...] --tokenizer SPEC \\
        --output DIR [--format text|chat|prompt_completion] [--workers N] [--text-key text] [--shard-mb 64]

``--input``: files (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow) or
directories of them, in the order given (repeatable). ``--tokenizer``: the
same specs as ``data.tokenizer`` ('byte' or an HF tokenizer.json). The store
(see :mod:`ulysses_dtensor.data.store`) is written to ``DIR.partial`` and
renamed to ``DIR`` when complete; an interrupted run is finished by the same
command. Then train with ``data.path = DIR`` (or a ``[[data.sources]]`` path).
``--format`` (as ``data.format``): ``text`` trains on every token; ``chat``
(``messages`` records, rendered with the chat template beside the tokenizer)
and ``prompt_completion`` store target flags: only assistant / completion
tokens are trained on (:mod:`ulysses_dtensor.data.sft`).

Unusable input exits with status 2 and one ``data error:`` message naming the
file and line.
"""

from __future__ import annotations

import argparse
import os
import sys

from .data.errors import DataError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ulysses_dtensor.prepare_data",
                                description="Tokenize documents once into a memory-mapped token store.")
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="PATH",
                   help="data files or directories (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .arrow)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or the path of an HF tokenizer.json")
    p.add_argument("--output", required=True, help="the store directory to write")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="tokenizing processes (default: up to 8, one per core)")
    p.add_argument("--format", default="text", choices=("text", "chat", "prompt_completion"),
                   help="text: every token trained on; chat: 'messages' records (assistant turns trained "
                        "on); prompt_completion: 'prompt' + 'completion' (completion trained on)")
    p.add_argument("--text-key", default="text", help="the field of each record holding the text (--format text)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="input MiB per shard (work unit)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.workers < 1 or args.shard_mb <= 0:
        print("data error: --workers must be >= 1 and --shard-mb > 0", file=sys.stderr)
        return 2
    from .data.prepare import prepare_store
    from .data.sft import build_renderer

    try:
        renderer = build_renderer(args.format, args.tokenizer, args.text_key)
        prepare_store(args.input, args.tokenizer, args.output, workers=args.workers,
                      text_key=args.text_key, shard_mb=args.shard_mb, renderer=renderer)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: run the same command again to finish {args.output}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
