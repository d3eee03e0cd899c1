"""Weighted mixtures, up-sampling and background loading: realised shares by count,
the same global batches on any dp, exact resume through a read-ahead thread."""

from __future__ import annotations

import gc
import json
import time

import numpy as np
import pytest
import torch

from ulysses_dtensor.data import (
    ByteTokenizer,
    PackedLoader,
    Prefetcher,
    RowMixture,
    StepLoader,
    TokenStream,
    Upsampled,
    as_token_docs,
)


class Letters:
    """Documents made of one letter only, so a row's source shows in its tokens."""

    def __init__(self, letter: str, n: int = 50):
        self.docs = [letter * (3 + (i * 11) % 40) for i in range(n)]
        self.letter = letter

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]

    def fingerprint(self):
        return f"letters:{self.letter}"


LETTERS = "abc"
STAGE_WEIGHTS = [[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]
# (global batch, seq_len, stage) per step: 150 steps of 16 x 64, then 100 of 8 x 128
PLAN = [(16, 64, 0)] * 150 + [(8, 128, 1)] * 100


def _loader(rank=0, dp=1):
    streams = [TokenStream(Letters(c), ByteTokenizer(), seed=[7, k]) for k, c in enumerate(LETTERS)]
    return PackedLoader(streams, dp_rank=rank, dp_size=dp, names=list(LETTERS), seed=7)


def _plan(step):  # steps count from 1
    b, s, stage = PLAN[step - 1]
    return b, s, STAGE_WEIGHTS[stage]


def _letter_tokens(ids: torch.Tensor) -> np.ndarray:
    """Tokens per letter in a batch (BOS/EOS count for the row's letter)."""
    rows = ids.numpy()
    letter = np.array([[r[(r < 256)][0] if (r < 256).any() else -1] for r in rows]).ravel()
    return np.array([rows.shape[1] * int((letter == ord(c)).sum()) for c in LETTERS])


def test_realised_shares_within_one_percent_per_stage():
    loader = _loader()
    counts = np.zeros((2, 3), dtype=np.int64)
    for step in range(1, len(PLAN) + 1):
        batch = loader.next_batch(*_plan(step))
        counts[PLAN[step - 1][2]] += _letter_tokens(batch["input_ids"])
    for stage, w in enumerate(STAGE_WEIGHTS):
        share = counts[stage] / counts[stage].sum()
        print(f"stage {stage}: weights {w}, realised token shares {np.round(share, 4).tolist()}")
        assert np.abs(share - np.array(w)).max() < 0.01, (stage, share, w)
    # the per-stage weights took effect: the two stages' shares differ
    assert counts[0, 0] / counts[0].sum() > 0.45 and counts[1, 0] / counts[1].sum() < 0.25
    # the loader's own account (logged as data_share_*) is the same count
    assert list(loader.source_tokens().values()) == counts.sum(axis=0).tolist()


def test_same_global_batches_on_any_dp():
    steps = [1, 2, 3, 150, 151, 152]
    full = _loader()
    ref = {}
    for step in range(1, 153):
        b = full.next_batch(*_plan(step))
        if step in steps:
            ref[step] = b
    for dp in (2, 8):
        loaders = [_loader(r, dp) for r in range(dp)]
        for step in range(1, 153):
            parts = [ld.next_batch(*_plan(step)) for ld in loaders]
            if step in steps:
                for key in ("input_ids", "position_ids"):
                    assert torch.equal(torch.cat([p[key] for p in parts]), ref[step][key]), (dp, step, key)


def test_resume_through_the_prefetch_thread_is_exact():
    """A checkpoint taken while the thread has read ahead: the batches it held are
    neither lost nor repeated by the resumed run (which here reads without a thread)."""
    uninterrupted = Prefetcher(_loader(1, 2), _plan, 1, len(PLAN), depth=3)
    expected = [uninterrupted.batch_for(s) for s in range(1, 161)]
    uninterrupted.close()

    run = Prefetcher(_loader(1, 2), _plan, 1, len(PLAN), depth=3)
    for step in range(1, 149):
        torch.testing.assert_close(run.batch_for(step), expected[step - 1], rtol=0, atol=0)
    deadline = time.monotonic() + 30
    while run.loader.rows <= 148 * 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.loader.rows > 148 * 16  # the thread has read ahead of the loop
    state = json.loads(json.dumps(run.state_dict()))  # as the checkpoint stores it
    assert state["rows"] == 148 * 16 and state["tokens_seen"] == run.tokens_seen == 148 * 16 * 64
    run.close()
    resumed = _loader(1, 2)
    resumed.load_state_dict(state)
    steps = StepLoader(resumed, _plan)
    for step in range(149, 161):  # across the stage change at step 151
        torch.testing.assert_close(steps.batch_for(step), expected[step - 1], rtol=0, atol=0)


def test_prefetch_error_reaches_the_training_thread():
    def bad_plan(step):
        if step == 3:
            raise RuntimeError("plan broke at step 3")
        return _plan(step)

    p = Prefetcher(_loader(), bad_plan, 1, 10)
    p.batch_for(1), p.batch_for(2)
    with pytest.raises(RuntimeError, match="plan broke at step 3"):
        p.batch_for(3)
    p.close()
    # A run that fails without close(): dropping the prefetcher stops its thread.
    p = Prefetcher(_loader(), _plan, 1, 10)
    p.batch_for(1)
    thread = p._thread
    del p
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_row_mixture_counts_are_exact():
    mix = RowMixture(4, seed=3)
    rng = np.random.default_rng(0)
    for _ in range(5):
        w = rng.uniform(0.05, 1.0, 4)
        t = mix.taken(np.arange(0, 3001), w)
        step = np.diff(t, axis=0)
        assert (step.sum(axis=1) == 1).all() and (step >= 0).all()  # each row: exactly one source
        n = np.arange(0, 3001)[:, None]
        assert np.abs(t - n * w / w.sum()).max() <= 4  # within (sources) rows of the weight, always
        np.testing.assert_array_equal(mix.sources(1000, 500, w), np.argmax(step[1000:1500], axis=1))


def test_upsampling_repeats_long_documents_each_epoch():
    tok = ByteTokenizer()
    src = Letters("a", 60)
    docs = as_token_docs(src, tok)
    lengths = docs.lengths(0, len(docs))
    long = np.flatnonzero(lengths > 30)
    assert 0 < len(long) < len(docs)
    for factor, copies in ((3.0, 2 * len(long)), (1.5, round(0.5 * len(long)))):
        up = Upsampled(docs, 30, factor)
        assert len(up) == len(docs) + copies
        stream = TokenStream(up, seed=1)
        epoch = [up._base_id(stream.order.doc_at(0, p)) for p in range(len(up))]
        seen = np.bincount(epoch, minlength=len(docs))
        assert (seen[np.setdiff1d(np.arange(len(docs)), long)] == 1).all()
        if factor == 3.0:
            assert (seen[long] == 3).all()
        else:
            assert set(seen[long].tolist()) == {1, 2} and int((seen[long] == 2).sum()) == copies
        assert stream.epoch_tokens == lengths.sum() + lengths[up.extra_ids].sum()
        # a whole epoch of the stream reads those copies (as whole documents)
        toks = stream.read(0, stream.epoch_tokens)[0]
        assert int((toks == tok.bos_id).sum()) == len(up)
