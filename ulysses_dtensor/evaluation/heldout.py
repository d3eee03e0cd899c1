"""A held-out split of the training documents that training never reads.

Whether a document is held out is decided by a hash of its name
(:meth:`DocumentSource.doc_key`: a path, or file and line offset) and the
fraction, not by its index, its content or any seed: the same document is on
the same side in every run, on every rank, when files are added or the order is
shuffled, and whatever ``job.seed`` is. Training reads a :class:`DocumentSubset`
of the other documents; every document index it can ever produce maps into
that subset. A prepared token store is split the same way (its documents are
named by their index in the store) into :class:`~ulysses_dtensor.data.token_docs.TokenSubset` views.
The subset's fingerprint names the split, so a checkpoint records
in its data cursor whether, and how, its training data was split (the eval
entry point checks it before reporting a held-out loss).
"""

from __future__ import annotations

import hashlib

from ..data import DocumentSource
from ..data.token_docs import TokenDocs, TokenSubset

__all__ = ["DocumentSubset", "is_held_out", "split_held_out", "SPLIT_TAG"]

SPLIT_TAG = "heldout-split"


def is_held_out(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"ulysses_dtensor/{SPLIT_TAG}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


class DocumentSubset(DocumentSource):
    """The documents ``indices`` of ``base``, in that order."""

    def __init__(self, base: DocumentSource, indices: list[int], tag: str):
        self.base = base
        self.indices = list(indices)
        self.tag = tag

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> str:
        return self.base[self.indices[i]]

    def doc_key(self, i: int) -> str:
        return self.base.doc_key(self.indices[i])

    def fingerprint(self) -> str:
        return f"{self.tag}:{len(self.indices)}:{self.base.fingerprint()}"


def split_held_out(source: DocumentSource, fraction: float, *, what: str = "data.path"):
    """``(training documents, held-out documents)``; each non-empty (ValueError if not)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"eval.holdout_fraction={fraction} must be in (0, 1)")
    held = [i for i in range(len(source)) if is_held_out(source.doc_key(i), fraction)]
    held_set = set(held)
    train = [i for i in range(len(source)) if i not in held_set]
    if not held or not train:
        raise ValueError(
            f"eval.holdout_fraction={fraction} of the {len(source)} documents of {what} holds out "
            f"{len(held)} of them, leaving {len(train)} for training; both must be >= 1: change the "
            f"fraction or give held-out documents with eval.data_path"
        )
    tag = f"{SPLIT_TAG}(fraction={fraction:g})"
    subset = TokenSubset if isinstance(source, TokenDocs) else DocumentSubset
    return subset(source, train, f"{tag}/train"), subset(source, held, f"{tag}/held-out")
