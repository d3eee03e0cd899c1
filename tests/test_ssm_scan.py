"""The document-restarting Mamba-2 and Mamba scans against transformers' own, each document alone.

fp64 inputs (transformers' torch scans and ours compute in fp32 inside or
follow the inputs' dtype): 2 rows of 37 tokens with documents starting mid-chunk,
at a chunk start and a one-token document, chunks of 8. Outputs and the
gradients of every input must match transformers' scan run per document, and
without the restarts the documents would mix (the whole rows differ).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs the hf extra (transformers)", allow_module_level=True)

from distributed import run_ranks  # noqa: E402

STARTS = [[0, 5, 16, 30], [0, 8, 9, 24]]
BATCH, SEQ, CHUNK = 2, 37, 8


def _segments():
    import torch

    docs = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for r, row in enumerate(STARTS):
        for i, (a, b) in enumerate(zip(row, row[1:] + [SEQ])):
            docs[r, a:b] = i
    return docs


def _per_document(fn, tensors):
    """fn over each document alone, pasted back into a whole-sequence output."""
    import torch

    out = None
    for r, row in enumerate(STARTS):
        for a, b in zip(row, row[1:] + [SEQ]):
            piece = fn(*[t[r:r + 1, a:b] for t in tensors])
            if out is None:
                out = torch.zeros(BATCH, SEQ, *piece.shape[2:], dtype=piece.dtype)
            out[r:r + 1, a:b] = piece
    return out


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers.models.jamba import modeling_jamba as jamba
    from transformers.models.mamba2 import modeling_mamba2 as mamba2

    from ulysses_dtensor.mixers.ssm_scan import selective_scan_documents, ssd_documents

    g = torch.Generator().manual_seed(rank)
    f64 = dict(generator=g, dtype=torch.float64)
    segments = _segments()
    out = {}

    # Mamba-2: 4 heads of 3, state 5 (groups already expanded to heads).
    x, b, c = torch.randn(BATCH, SEQ, 4, 3, **f64), torch.randn(BATCH, SEQ, 4, 5, **f64), torch.randn(
        BATCH, SEQ, 4, 5, **f64)
    dt = F.softplus(torch.randn(BATCH, SEQ, 4, **f64))
    A = -torch.rand(4, **f64) - 0.5
    inputs = [t.requires_grad_() for t in (x, dt, b, c)]
    got = ssd_documents(x, dt, A, b, c, segments, CHUNK)
    want = _per_document(lambda x_, dt_, b_, c_: mamba2.mamba2_chunk_scan(x_, dt_, A, b_, c_, CHUNK).double(), inputs)
    whole = mamba2.mamba2_chunk_scan(x, dt, A, b, c, CHUNK).double()
    w = torch.randn(got.shape, **f64)
    grads = [torch.autograd.grad((y * w).sum(), inputs) for y in (got.double(), want)]
    out["mamba2"] = {"out": (got.double() - want).abs().max().item(), "scale": want.abs().max().item(),
                     "grads": max((p - q).abs().max().item() for p, q in zip(*grads)),
                     "crossing": (whole - want).abs().max().item()}

    # Mamba: 6 channels, state 4.
    x, dt = torch.randn(BATCH, SEQ, 6, **f64), F.softplus(torch.randn(BATCH, SEQ, 6, **f64))
    b, c = torch.randn(BATCH, SEQ, 4, **f64), torch.randn(BATCH, SEQ, 4, **f64)
    A = -torch.rand(6, 4, **f64) - 0.5
    inputs = [t.requires_grad_() for t in (x, dt, b, c)]

    def theirs(x_, dt_, b_, c_):
        return jamba.mamba_selective_scan(x_.transpose(1, 2), dt_.transpose(1, 2), A, b_.transpose(1, 2),
                                          c_.transpose(1, 2)).transpose(1, 2).double()

    got = selective_scan_documents(x, dt, A, b, c, segments)
    want = _per_document(theirs, inputs)
    whole = theirs(x, dt, b, c)
    w = torch.randn(got.shape, **f64)
    grads = [torch.autograd.grad((y * w).sum(), inputs) for y in (got.double(), want)]
    out["mamba"] = {"out": (got.double() - want).abs().max().item(), "scale": want.abs().max().item(),
                    "grads": max((p - q).abs().max().item() for p, q in zip(*grads)),
                    "crossing": (whole - want).abs().max().item()}
    return out


def test_mamba_scans_restart_as_each_document_alone():
    out = run_ranks(2, _worker)[0]
    print(out)
    for kind, r in out.items():
        # Both compute in fp32 inside: agreement to fp32 rounding of the scale.
        assert r["out"] < 1e-5 * r["scale"] and r["grads"] < 1e-4 * max(1.0, r["scale"]), (kind, r)
        assert r["crossing"] > 1e-2 * r["scale"], (kind, r)  # without the restarts the documents would mix
