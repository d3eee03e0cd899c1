#!/usr/bin/env python
"""Write a .jsonl corpus of passkey prompts (with their answers) for a tiny demo run.

    python scripts/passkey_corpus.py outputs/passkey.jsonl --docs 4000 --max-len 512

A model of a few layers trained briefly on ordinary text retrieves nothing, so its
retrieval heat map is all red. Trained on these prompts at up to ``--max-len``
tokens it learns to copy the pass key, and ``[eval]`` then shows what context
extension is about: retrieval at the trained lengths, and whether it holds past
them. Documents come from the evaluation's own generator (byte tokenizer), with a
different seed than ``eval.seed``'s default and random lengths and depths.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ulysses_dtensor.data import ByteTokenizer
from ulysses_dtensor.evaluation.tasks import SampleGenerator


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output .jsonl")
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--min-len", type=int, default=256, help="shortest prompt in byte tokens")
    ap.add_argument("--max-len", type=int, default=512, help="longest prompt in byte tokens")
    ap.add_argument("--seed", type=int, default=99)
    a = ap.parse_args(argv)
    tok = ByteTokenizer()
    gen = SampleGenerator(tok, seed=a.seed)
    rng = np.random.default_rng(a.seed)
    with open(a.out, "w") as fh:
        for i in range(a.docs):
            length = int(rng.integers(a.min_len, a.max_len + 1))
            sample = gen.sample("passkey", length, float(rng.random()), index=i)
            # the BOS / EOS the data loader adds are not part of the text
            fh.write(json.dumps({"text": tok.decode(sample.tokens[1:])}) + "\n")
    print(f"wrote {a.docs} passkey prompts of {a.min_len}-{a.max_len} tokens to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
