"""shard_batch: padding, label shift before slicing, global positions, document ids."""

import pytest
import torch

from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.loss import IGNORE_INDEX


def _packed_batch():
    # Row 0: documents of 4, 6, 3 tokens; row 1: 9 and 4. S = 13 (odd on purpose).
    pos = torch.tensor(
        [
            [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2],
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3],
        ]
    )
    ids = torch.arange(26).view(2, 13) + 100
    labels = ids.clone()
    labels[1, 5] = IGNORE_INDEX  # a masked prompt token stays ignored as a target
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _gather(batch, sp):
    parts = [shard_batch(batch, sp_rank=r, sp_size=sp) for r in range(sp)]
    cat = {k: torch.cat([p[k] for p in parts], dim=1) for k in ("input_ids", "labels", "position_ids")}
    return parts, cat


@pytest.mark.parametrize("sp", [1, 2, 4, 8])
def test_round_trip_is_padded_shifted_batch(sp):
    batch = _packed_batch()
    parts, cat = _gather(batch, sp)
    seq = 13
    padded = -(-seq // sp) * sp
    assert cat["input_ids"].shape == (2, padded)
    assert all(p["input_ids"].shape == (2, padded // sp) for p in parts)
    torch.testing.assert_close(cat["input_ids"][:, :seq], batch["input_ids"])
    assert (cat["input_ids"][:, seq:] == 0).all()
    # Global positions: the original ones, then the pads continuing.
    torch.testing.assert_close(cat["position_ids"][:, :seq], batch["position_ids"])

    # Labels: label[t] = input[t+1] inside a document, ignored at each document's
    # last token, at the end and on pads.
    want = torch.full((2, padded), IGNORE_INDEX)
    doc_ends = {0: {3, 9, 12}, 1: {8, 12}}
    for row in range(2):
        for t in range(seq):
            if t not in doc_ends[row]:
                want[row, t] = batch["labels"][row, t + 1]
    torch.testing.assert_close(cat["labels"], want)
    # Document ids are global and identical on every rank.
    for p in parts:
        torch.testing.assert_close(p["document_ids"], parts[0]["document_ids"])
    assert parts[0]["document_ids"].shape == (2, padded)
    assert parts[0]["document_ids"][0, :seq].tolist() == [0] * 4 + [1] * 6 + [2] * 3


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_every_label_appears_exactly_once(sp):
    batch = _packed_batch()
    _, cat = _gather(batch, sp)
    # Each (row, token) target of the unsharded shifted batch is present once.
    ref = shard_batch(batch)["labels"]
    got = cat["labels"]
    for row in range(2):
        ref_valid = ref[row][ref[row] != IGNORE_INDEX].tolist()
        got_valid = got[row][got[row] != IGNORE_INDEX].tolist()
        assert got_valid == ref_valid
        assert len(set(got_valid)) == len(got_valid)
    # No label lost at a shard boundary: 13 tokens, 3 and 2 document ends, 1 masked.
    assert int((got != IGNORE_INDEX).sum()) == (13 - 3) + (13 - 2) - 1


def test_single_document_rows_need_no_mask_and_shift_across_shards():
    ids = torch.arange(16).view(1, 16)
    parts = [shard_batch({"input_ids": ids}, sp_rank=r, sp_size=4) for r in range(4)]
    assert all(p["document_ids"] is None for p in parts)
    # The last token of shard r predicts the first token of shard r+1.
    for r in range(3):
        assert parts[r]["labels"][0, -1].item() == parts[r + 1]["input_ids"][0, 0].item()
    assert parts[3]["labels"][0, -1].item() == IGNORE_INDEX
    assert parts[2]["position_ids"].tolist() == [[8, 9, 10, 11]]


def test_unpadded_sequence_not_divisible_raises():
    with pytest.raises(ValueError, match=r"sequence length 13 is not divisible by sp=4; pad to 16"):
        shard_batch(_packed_batch(), sp_rank=0, sp_size=4, pad=False)


def test_bad_shapes_raise():
    batch = _packed_batch()
    with pytest.raises(ValueError, match=r"labels shape \(2, 12\) must equal input_ids shape \(2, 13\)"):
        shard_batch({**batch, "labels": batch["labels"][:, :12]}, sp_rank=0, sp_size=2)
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\)"):
        shard_batch({"input_ids": torch.zeros(13, dtype=torch.long)}, sp_rank=0, sp_size=2)
    with pytest.raises(ValueError, match=r"sp_rank=2 must be in \[0, sp_size=2\)"):
        shard_batch(batch, sp_rank=2, sp_size=2)
