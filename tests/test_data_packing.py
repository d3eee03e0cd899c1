"""Best-fit decreasing packing (``data.packing = "bfd"``): whole samples into rows,
padding ignored, the same rows on every dp split, exact resume (also across a stage
change inside a window, and for a mixture), and the four rules for samples longer
than a row."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ulysses_dtensor.data import DataError, PackedLoader, TokenStream
from ulysses_dtensor.data.bestfit import best_fit_decreasing
from ulysses_dtensor.data.token_docs import TokenDocs
from ulysses_dtensor.parallel.batch import shard_batch
from ulysses_dtensor.parallel.loss import IGNORE_INDEX


class Samples(TokenDocs):
    """Samples of given lengths: sample i's tokens are 1000 * (i + 1) + t (so every token
    names its sample and place), the first ``prompt`` of them context, the rest targets."""

    has_targets = True

    def __init__(self, lengths, prompt: int = 3, tag: str = "s"):
        self.n = np.asarray(lengths, dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(self.n)])
        self.prompt, self.tag = prompt, tag

    def __len__(self):
        return len(self.n)

    def cum_tokens(self, ids):
        return self.cum[np.asarray(ids, dtype=np.int64)]

    def tokens(self, i, start, stop):
        return 1000 * (int(i) + 1) + np.arange(start, min(stop, self.n[i]), dtype=np.int64)

    def targets(self, i, start, stop):
        return (np.arange(start, min(stop, self.n[i])) >= self.prompt).astype(np.uint8)

    def fingerprint(self):
        return f"{self.tag}:{len(self)}"


def lengths(n=60, seed=0, hi=40):
    return np.random.default_rng(seed).integers(4, hi, n)


def loader(docs, dp_rank=0, dp=1, window=16, overlong="error", seed=0, **kw):
    return PackedLoader(TokenStream(docs, seed=seed), dp_rank=dp_rank, dp_size=dp, packing="bfd", window=window,
                        overlong=overlong, **kw)


def pieces_of(batch):
    """(sample, first token, last token + 1, targets as labels) of every piece in the rows, and the pad count."""
    out, pad = [], 0
    for ids, pos, lab in zip(batch["input_ids"], batch["position_ids"], batch["labels"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
        for a, b in zip(starts[:-1], starts[1:]):
            toks = ids[a:b]
            if toks[0] == 0:  # padding: token 0, labels ignored, positions from 0
                assert (toks == 0).all() and (lab[a:b] == IGNORE_INDEX).all() and b == len(pos)
                pad += b - a
                continue
            sample, first = divmod(int(toks[0]), 1000)
            assert toks.tolist() == list(range(int(toks[0]), int(toks[0]) + b - a))  # contiguous, in order
            out.append((sample - 1, first, first + b - a))
    return out, pad


def test_best_fit_decreasing_rule():
    # 7 -> row 0 (room 3), 6 -> row 1 (4), 5 fits neither -> row 2, 3 fills row 0, 2 and 1 best fit row 1
    assert best_fit_decreasing([5, 7, 3, 2, 6, 1], 10) == [[1, 2], [4, 3, 5], [0]]
    rows = best_fit_decreasing(lengths(200, hi=64), 64)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(sum(lengths(200, hi=64)[r]) <= 64 for r in rows)


def test_every_sample_once_and_whole_with_padding_ignored():
    n = lengths()
    docs = Samples(n)
    ld = loader(docs)
    seen, pad_total, tokens = [], 0, 0
    while len(seen) < len(n):
        b = ld.next_batch(4, 48)
        got, pad = pieces_of(b)
        seen += got
        pad_total += pad
        tokens += b["input_ids"].numel()
        assert ld.batch_stats()["pad_share"] == pytest.approx(pad / b["input_ids"].numel())
        # targets: the sample's own tokens past its prompt; prompts and padding ignored
        flat_ids, flat_lab, flat_pos = b["input_ids"].flatten(), b["labels"].flatten(), b["position_ids"].flatten()
        real = flat_ids != 0
        assert torch.equal(flat_lab[real] != IGNORE_INDEX, flat_pos[real] >= docs.prompt)
    first_epoch = seen[:len(n)]
    assert sorted(s for s, _, _ in first_epoch) == list(range(len(n)))  # each sample exactly once ...
    assert all(a == 0 and b == n[s] for s, a, b in first_epoch)  # ... whole
    print(f"bfd: {len(n)} samples of 4..39 tokens in rows of 48: padding {pad_total / tokens:.1%}")
    # shard_batch sees every piece (and the padding) as its own document
    local = shard_batch(b, sp_rank=0, sp_size=2)
    assert int(local["document_ids"][0].max()) + 1 == int((b["position_ids"][0] == 0).sum())


def test_same_rows_on_every_dp_split_and_exact_resume_across_a_stage_change():
    docs = Samples(lengths(90, seed=1))
    plan = [(4, 40)] * 3 + [(4, 64)] * 4  # the stage boundary falls inside a window of 16 samples
    glob = loader(docs)
    want = [glob.next_batch(b, s) for b, s in plan]
    for dp in (2, 4):
        shares = [loader(docs, r, dp) for r in range(dp)]
        for (b, s), w in zip(plan, want):
            got = [ld.next_batch(b, s) for ld in shares]
            for key in ("input_ids", "position_ids", "labels"):
                assert torch.equal(torch.cat([g[key] for g in got]), w[key]), (dp, key)
    for cut in (2, 3, 5):
        a = loader(docs, 1, 2)
        for b, s in plan[:cut]:
            a.next_batch(b, s)
        state = json.loads(json.dumps(a.state_dict()))  # the checkpoint's JSON
        r = loader(docs, 1, 2)
        r.load_state_dict(state)
        for (b, s), w in zip(plan[cut:], want[cut:]):
            assert torch.equal(r.next_batch(b, s)["input_ids"], w["input_ids"][2:]), cut
    with pytest.raises(ValueError, match="data.packing_window=16 differs from this run's 8"):
        loader(docs, window=8).load_state_dict(state)
    stream = PackedLoader(TokenStream(docs, seed=0))
    with pytest.raises(ValueError, match="data.packing='bfd' and this run packs with 'stream'"):
        stream.load_state_dict(state)


def test_mixture_rows_resume_exactly():
    a_docs, b_docs = Samples(lengths(40, seed=2, hi=32), tag="a"), Samples(lengths(30, seed=3, hi=20), tag="b")

    def mix(rank=0, dp=1):
        return PackedLoader([TokenStream(a_docs, seed=[0, 0]), TokenStream(b_docs, seed=[0, 1])], dp_rank=rank,
                            dp_size=dp, weights=[2, 1], packing="bfd", window=8)

    glob = mix()
    want = [glob.next_batch(6, 32) for _ in range(5)]
    a, b = mix(0, 2), mix(1, 2)
    for w in want[:2]:
        assert torch.equal(torch.cat([a.next_batch(6, 32)["input_ids"], b.next_batch(6, 32)["input_ids"]]),
                           w["input_ids"])
    r = mix(1, 2)
    r.load_state_dict(json.loads(json.dumps(b.state_dict())))
    for w in want[2:]:
        assert torch.equal(r.next_batch(6, 32)["input_ids"], w["input_ids"][3:])
    assert sum(glob.source_tokens().values()) == sum(int((w["input_ids"] != 0).sum()) for w in want)


def test_samples_longer_than_a_row():
    n = [10, 70, 12, 150, 8]  # two samples longer than 64
    def first_epoch(overlong):  # one window holds the whole epoch
        ld = loader(Samples(n), window=8, overlong=overlong, seed=3)
        got = []
        while ld.packers[0].epoch == 0:
            got += pieces_of(ld.next_batch(1, 64))[0]
        return sorted(got), ld.batch_stats()

    got, stats = first_epoch("truncate")  # the first 64 tokens: the prompt, the answer cut at its end
    assert got == [(0, 0, 10), (1, 0, 64), (2, 0, 12), (3, 0, 64), (4, 0, 8)] and stats["samples_truncated"] == 2
    got, stats = first_epoch("split")  # pieces of 64 tokens, each its own document
    assert got == [(0, 0, 10), (1, 0, 64), (1, 64, 70), (2, 0, 12), (3, 0, 64), (3, 64, 128), (3, 128, 150),
                   (4, 0, 8)] and stats["samples_split"] == 2
    got, stats = first_epoch("drop")
    assert got == [(0, 0, 10), (2, 0, 12), (4, 0, 8)] and stats["samples_dropped"] == 2
    with pytest.raises(DataError, match=r"s:5: sample [13] has (70|150) tokens, more than a row of seq_len 64, and data.overlong='error'"):
        first_epoch("error")
    with pytest.raises(DataError, match="no sample fits a row of 6 tokens"):
        loader(Samples(n), overlong="drop").next_batch(2, 6)
