"""Long-context evaluation: generators, scorer, position buckets, held-out split, SP invariance.

* the retrieval generators give exactly the asked length, put the needle at the
  asked token index (instruction + round(depth x filler)), are deterministic, and
  work with the byte tokenizer and an HF ``tokenizer.json`` (trained here);
* the teacher-forced scorer gives 100% to logits that put the answer first and
  0% when one answer token is not the argmax (logits built directly);
* position buckets: log-spaced edges; bucket losses sum to the overall loss with
  the exact token counts of the held-out rows;
* the held-out split is disjoint from what training reads, over epochs;
* the evaluation gives the same numbers on 1 process and under sp 2, sp 4 and
  dp 2 x sp 2 (with FSDP2, and with activation checkpointing + tiled MLP), at a
  length sp divides and one it does not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from distributed import run_ranks
from eval_helpers import build_bpe_tokenizer, write_held_out

from ulysses_dtensor.data import (
    ByteTokenizer,
    FileCorpus,
    HFTokenizer,
    StdlibCorpus,
    TokenStream,
)
from ulysses_dtensor.evaluation.heldout import split_held_out
from ulysses_dtensor.evaluation.position_loss import BucketSums, bucket_edges
from ulysses_dtensor.evaluation.runner import EvalSpec, Evaluator
from ulysses_dtensor.evaluation.scoring import teacher_forced_score
from ulysses_dtensor.evaluation.tasks import (
    _INSTRUCTIONS,
    RETRIEVAL_TASKS,
    SampleGenerator,
    depth_grid,
)

LENGTHS = [256, 259]  # 259: not a multiple of 2 or 4
# vartrack shares the scoring path of these two and needs ~330 tokens with the test tokenizer.
SPEC = dict(tasks=["loss", "passkey", "multikey"], depths=2, samples=1, loss_rows=3, seed=7)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    return {"tokenizer": str(build_bpe_tokenizer(d)), "held_out": str(write_held_out(d))}


def _needle_text(task: str, sample) -> str:
    if task == "passkey":
        return f"The pass key is {sample.answer}. Remember it. {sample.answer} is the pass key. "
    if task == "multikey":
        return "One of the special magic numbers for "  # the key follows; checked by prefix
    return f"VAR {sample.answer.split()[0]} = "


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_generators_exact_position_length_determinism(kind, files):
    tok = ByteTokenizer() if kind == "byte" else HFTokenizer(files["tokenizer"])
    gen = SampleGenerator(tok, seed=3)
    lengths = [700, 1601] if kind == "byte" else [350, 1001]
    for task in RETRIEVAL_TASKS:
        head = len(gen.encode(_INSTRUCTIONS[task])) + 1  # + BOS
        for depth in depth_grid(10):
            for length in lengths:
                s = gen.sample(task, length, depth)
                filler = length - gen.fixed_tokens(task, depth, 0)
                assert len(s.tokens) == length and s.tokens.dtype == np.int64
                assert s.tokens[0] == tok.bos_id
                # the answer closes the sample, tokenized on its own
                assert list(s.tokens[s.answer_start:]) == list(gen.encode(" " + s.answer))
                assert tok.decode(s.tokens[s.answer_start:]) == " " + s.answer
                needle = tok.decode(s.tokens[s.needle_index:s.needle_index + s.needle_len])
                assert needle.startswith(_needle_text(task, s)), (task, depth, needle)
                if task == "passkey":  # one needle: exactly at instruction + round(depth * filler)
                    assert s.needle_index == head + round(depth * filler), (depth, length)
                    assert needle == _needle_text(task, s)
                else:  # distractor needles may come first; never after the depth's filler share
                    assert s.needle_index >= head + round(depth * filler)
            # the same needle at every length: only the haystack grows
            a, b = (gen.sample(task, n, depth) for n in lengths)
            assert a.answer == b.answer and a.needle_len == b.needle_len
    # deterministic: a fresh generator, same seed -> same tokens; another seed -> other samples
    for task in RETRIEVAL_TASKS:
        x = SampleGenerator(tok, seed=3).sample(task, lengths[0], 0.5)
        y = gen.sample(task, lengths[0], 0.5)
        z = SampleGenerator(tok, seed=4).sample(task, lengths[0], 0.5)
        assert np.array_equal(x.tokens, y.tokens) and x.needle_index == y.needle_index
        assert not np.array_equal(x.tokens, z.tokens)
    with pytest.raises(ValueError, match=r"eval length 50 is too short for task 'multikey'"):
        gen.sample("multikey", 50, 0.5)


def test_teacher_forced_scorer_on_constructed_logits():
    vocab, answer = 50, torch.tensor([7, 3, 41, 3])
    right = torch.full((4, vocab), -2.0)
    right[torch.arange(4), answer] = 5.0  # the answer token first everywhere
    ok, logprob = teacher_forced_score(right, answer)
    expected = torch.log_softmax(right, -1)[torch.arange(4), answer].mean()
    assert ok is True and logprob == pytest.approx(float(expected), abs=1e-6)
    wrong = right.clone()
    wrong[2, 9] = 6.0  # one answer token is not the argmax -> the whole answer is wrong
    assert teacher_forced_score(wrong, answer)[0] is False
    tie = right.clone()
    tie[1, 0] = 5.0  # a tie with a smaller token id: greedy takes the first maximum
    assert teacher_forced_score(tie, answer)[0] is False
    none = torch.zeros(4, vocab)
    none[:, 0] = 1.0
    ok, logprob = teacher_forced_score(none, answer)
    assert ok is False and logprob < float(expected)
    with pytest.raises(ValueError, match="must be"):
        teacher_forced_score(right[:3], answer)


def test_position_buckets():
    assert bucket_edges(131072) == [0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert bucket_edges(256) == [0, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_edges(347) == [0, 2, 4, 8, 16, 32, 64, 128, 256, 347]
    sums = BucketSums(bucket_edges(16))  # [0, 1, 2, 4, 8, 16]
    nll = torch.arange(16, dtype=torch.float32)
    sums.add(nll, torch.arange(16))
    rows = sums.rows(sums.pack())
    assert [r["tokens"] for r in rows] == [1, 1, 2, 4, 8]
    assert [r["loss"] for r in rows] == [0.0, 1.0, 2.5, 5.5, 11.5]


def test_held_out_split_never_read_by_training():
    src = StdlibCorpus(max_bytes=1 << 20)
    train, held = split_held_out(src, 0.1, what="stdlib")
    keys = {src.doc_key(i) for i in range(len(src))}
    assert set(train.indices).isdisjoint(held.indices)
    assert len(train) + len(held) == len(src) and len(held) > 0
    # decided by name, not index: the same documents on a re-ordered corpus
    assert {held.doc_key(i) for i in range(len(held))} < keys

    class Recording:  # the training stream's view of the corpus, logging every read
        def __init__(self, base):
            self.base, self.read = base, set()

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            self.read.add(self.base.indices[i])
            return self.base[i]

        def fingerprint(self):
            return self.base.fingerprint()

    rec = Recording(train)
    stream = TokenStream(rec, ByteTokenizer(), seed=0, shuffle=True)
    total = sum(len(ByteTokenizer().encode(train[i])) for i in range(len(train)))
    stream.take(int(total * 2.2), materialize=False)  # more than two epochs
    assert stream.epoch >= 2 and rec.read == set(train.indices)  # all training documents ...
    assert rec.read.isdisjoint(held.indices)  # ... and never a held-out one
    assert "heldout-split(fraction=0.1)/train" in train.fingerprint()


# --------------------------------------------------------------------------- #
# SP invariance
# --------------------------------------------------------------------------- #


def _model(pmesh, vocab: int, features: bool):
    from ulysses_dtensor.models.llama import Llama, llama_args
    from ulysses_dtensor.models.llama_parallelize import parallelize_llama

    with torch.device("meta"):
        model = Llama(llama_args("debug", vocab_size=vocab))
    if pmesh is not None:
        model = parallelize_llama(model, pmesh, ac_mode="full" if features else "none",
                                  tiled_mlp=features, mlp_tiles=3 if features else None)
    model.to_empty(device="cpu")
    model.init_weights(seed=11)
    return model


def _evaluate(pmesh, files, features=False, loss_chunks=None):
    tok = HFTokenizer(files["tokenizer"])
    vocab = -(-tok.vocab_size // 64) * 64
    model = _model(pmesh, vocab, features)
    ev = Evaluator(model, pmesh, tok, EvalSpec(**SPEC, loss_chunks=loss_chunks), "cpu",
                   FileCorpus(files["held_out"]))
    return ev.run(5, LENGTHS).rows


def _eval_worker(rank, world, meshes, files):
    from ulysses_dtensor.parallel.mesh import ParallelDims

    out = []
    for rep, shard, sp, features, ring in meshes:
        pmesh = ParallelDims(rep, shard, sp, ring=ring, world_size=world).build_mesh("cpu")
        out.append(_evaluate(pmesh, files, features, loss_chunks=5 if features else None))
    return out if rank == 0 else None


def _max_diff(rows, ref, label) -> float:
    worst = 0.0
    assert [r["kind"] for r in rows] == [r["kind"] for r in ref], label
    for a, b in zip(rows, ref):
        if a["kind"] == "eval":
            continue
        for key in ("tokens", "correct", "needle_index", "answer", "start", "end", "samples", "accuracy"):
            assert a.get(key) == b.get(key), (label, a, b)
        for key in ("loss", "mean_logprob"):
            if b.get(key) is not None:
                worst = max(worst, abs(a[key] - b[key]))
    return worst


def test_same_results_on_every_mesh(files):
    ref = _evaluate(None, files)  # one process, no FSDP, no SP
    results = {"sp2": run_ranks(2, _eval_worker, [(1, 1, 2, False, 1)], files)[0][0]}
    # dp 2 x sp 2 with full activation checkpointing, tiled MLP and a chunked head:
    # the memory features of training change nothing; ring 2 x ulysses 2 (USP) lays
    # the sequence out in mirrored chunks, which the scoring must undo
    four = run_ranks(4, _eval_worker, [(1, 1, 4, False, 1), (1, 2, 2, True, 1), (1, 1, 4, False, 2)], files)[0]
    results.update({"sp4": four[0], "dp2xsp2+ac+tiled_mlp": four[1], "ring2xulysses2": four[2]})
    diffs = {label: _max_diff(rows, ref, label) for label, rows in results.items()}
    print("max abs diff of bucket losses / mean log-probs vs 1 process:", diffs)
    assert max(diffs.values()) < 1e-5, diffs

    # Bucket losses sum to the overall loss, with the exact counts of the held-out rows.
    tok = HFTokenizer(files["tokenizer"])
    for length in LENGTHS:
        stream = TokenStream(FileCorpus(files["held_out"]), tok, shuffle=False)
        pos = np.stack([stream.take(length)[1] for _ in range(SPEC["loss_rows"])])
        valid = pos[:, 1:] != 0  # label t exists when token t+1 continues t's document
        buckets = [r for r in ref if r["kind"] == "position_loss" and r["length"] == length]
        (total,) = [r for r in ref if r["kind"] == "loss" and r["length"] == length]
        for b in buckets:
            in_bucket = (pos[:, :-1] >= b["start"]) & (pos[:, :-1] < b["end"])
            assert b["tokens"] == int((valid & in_bucket).sum()), b
        assert total["tokens"] == int(valid.sum()) == sum(b["tokens"] for b in buckets)
        weighted = sum(b["loss"] * b["tokens"] for b in buckets if b["tokens"]) / total["tokens"]
        assert weighted == pytest.approx(total["loss"], rel=1e-12)
    cells = [r for r in ref if r["kind"] == "retrieval"]
    assert len(cells) == len(LENGTHS) * 2 * SPEC["depths"]
    assert all(r["mean_logprob"] < 0 for r in cells)


def test_report_rows_round_trip_and_redraw_the_plots(tmp_path):
    """eval.jsonl keeps every row of two evaluations (a NaN loss as null); the redraw
    command reads the newest one back and draws both PNGs from it."""
    pytest.importorskip("matplotlib")
    from ulysses_dtensor.evaluation import redraw
    from ulysses_dtensor.evaluation.report import read_jsonl, write_jsonl
    from ulysses_dtensor.evaluation.runner import EvalResult

    def rows(step):
        cells = [{"kind": "retrieval", "step": step, "task": "passkey", "length": n, "depth": d,
                  "accuracy": float(d < 0.5), "mean_logprob": -1.0} for n in (64, 128) for d in (0.0, 0.5, 1.0)]
        buckets = [{"kind": "position_loss", "step": step, "length": 128, "start": s, "end": 2 * s, "tokens": s,
                    "loss": 3.0 / s} for s in (1, 2, 4, 8)]
        return cells + buckets + [{"kind": "loss", "step": step, "length": 128, "loss": float("nan")}]

    for step in (1, 2):
        path = write_jsonl(EvalResult(step=step, rows=rows(step), seconds=0.1, forward_passes=1), tmp_path)
    newest = read_jsonl(path, step=-1)
    assert len(read_jsonl(path)) == 2 * len(rows(1)) and {r["step"] for r in newest} == {2}
    assert [r for r in newest if r["kind"] == "loss"][0]["loss"] is None
    assert redraw.main([str(path), str(tmp_path / "png")]) == 0
    for name in ("heatmap_step2.png", "loss_by_position_step2.png"):
        png = (tmp_path / "png" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000, name
    assert redraw.main([str(path), str(tmp_path / "png"), "--step", "7"]) == 2  # no such evaluation


# --------------------------------------------------------------------------- #
# Training after an evaluation
# --------------------------------------------------------------------------- #


def _step_after_eval_worker(rank, world, files, by_hand):
    from ulysses_dtensor.parallel import fsdp_reset

    # The rank processes are pooled: patch for this task only.
    reset = fsdp_reset.reset_fsdp
    if by_hand:  # the path torch < 2.12 takes
        fsdp_reset.reset_fsdp = fsdp_reset.reset_fsdp_by_hand
    try:
        return _steps_with_and_without_eval(rank, world, files)
    finally:
        fsdp_reset.reset_fsdp = reset


def _steps_with_and_without_eval(rank, world, files):
    from torch.distributed.tensor import DTensor

    from ulysses_dtensor.parallel.batch import shard_batch
    from ulysses_dtensor.parallel.loss import count_valid_tokens
    from ulysses_dtensor.parallel.mesh import ParallelDims
    from ulysses_dtensor.trainer.step import train_step

    pmesh = ParallelDims(1, 2, 1, world_size=world).build_mesh("cpu")
    tok = HFTokenizer(files["tokenizer"])
    vocab = -(-tok.vocab_size // 64) * 64
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))[rank:rank + 1]
    batch = shard_batch({"input_ids": ids}, pmesh.sp)
    n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
    out = {}
    for evaluate in (False, True):
        model = _model(pmesh, vocab, features=False)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # new weight = old - gradient
        if evaluate:
            ev = Evaluator(model, pmesh, tok, EvalSpec(**SPEC), "cpu", FileCorpus(files["held_out"]))
            ev.run(1, [LENGTHS[0]])
            state = model._get_fsdp_state()
            # Nothing gathered is left behind: no all-gather result, every parameter a shard.
            assert state._comm_ctx.all_gather_state is None
            assert not state._comm_ctx.post_forward_order
            unsharded = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
            assert not unsharded, unsharded
        result = train_step(model, opt, batch, n_valid)
        out[evaluate] = (result.loss_sum.item(), result.grad_norm.item(),
                         {n: p.detach().full_tensor() for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("by_hand", [False, True], ids=["torch_reset", "by_hand"])
def test_a_training_step_after_an_evaluation_is_unchanged(files, by_hand):
    # FSDP2 dp_shard 2: the evaluation runs the model's parts without the root's
    # forward, so the root never frees its last all-gather; the reset must.
    got = run_ranks(2, _step_after_eval_worker, files, by_hand)
    for rank_out in got:
        (loss, norm, weights), (loss_e, norm_e, weights_e) = rank_out[False], rank_out[True]
        assert loss_e == loss and norm_e == norm
        for name, w in weights.items():
            torch.testing.assert_close(weights_e[name], w, atol=0, rtol=0, msg=name)
