"""Data loading at pretraining scale: raw files versus a prepared token store.

    python benchmarks/bench_data.py                      # 2 GB generated corpus (tens of minutes)
    python benchmarks/bench_data.py --quick              # 1 MB smoke run (seconds)
    python benchmarks/bench_data.py --dir /tmp/bd --size-gb 2 --workers 2 --dp 1 8 64

What it does, printing one JSON object per line:

1. ``data_corpus``: generates ``.jsonl`` files of synthetic text (pseudo-words
   with Zipf frequencies; document lengths log-normal, median ~2 KB, some
   documents of hundreds of KB) and trains a byte-level BPE ``tokenizer.json``
   (``--vocab`` tokens, default 8192) on its first 32 MiB, offline.
2. ``data_prepare``: ``python -m ulysses_dtensor.prepare_data``'s work
   (``prepare_store``) with ``--workers`` processes: seconds, tokens/s, bytes.
3. ``data_loader``: for each dp of ``--dp`` and each path, one simulated rank
   (a fresh forked process; ranks 0 and dp-1 for the store) builds its loader
   as the trainer does and reads ``--steps`` steps of ``--rows`` x ``--seq``
   tokens (its own rows of a global batch of dp x rows):

   * ``prepared``: open the store, check it (manifest, tokenizer, file sizes),
     read. Nothing is tokenized.
   * ``raw``: index the ``.jsonl`` files (vectorised newline scan), then this
     rank's share of the length index: it tokenizes documents ``rank, rank +
     dp, ...`` (the other ranks' shares, which a real run all-gathers, are taken
     from the store's index: same documents, same tokenizer), then read,
     tokenizing the documents its rows touch.

   ``time_to_first_step_s`` is from nothing to the first batch in hand;
   ``tokens_per_s_per_rank`` is this rank's tokens over the following steps;
   ``rss_anon_mib`` is the process's private memory growth (the memory-mapped
   store's pages are shared page cache, counted separately as ``rss_file_mib``).
   The same rows come out of both paths (``same_rows_as_prepared``).
   A ``--long-seq`` row reads one 1M-token row per rank per step from the store.
4. ``data_need``: the tokens/s one rank must load for a Llama-3-8B at 1M tokens
   per step on 8 H100 (see ``need()`` for the arithmetic), against the
   prepared loader's measured rate.
5. ``data_packing`` (SFT rows): a realistic length mix (``--packing-samples``
   samples, log-normal around ``--packing-median`` tokens with a long tail),
   rows of ``--packing-seq`` tokens (64K): the padding share of best-fit
   decreasing packing per window size (``data.packing_window``; samples longer
   than a row split, ``data.overlong = "split"``), the end-to-end cut's padding
   (none) and how many samples it splits, and the packing time. Then
   ``data_loader`` rows with ``"packing": "bfd"``: the best-fit loader on the
   store (its documents taken as samples), tokens/s beside the stream cut's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ulysses_dtensor.data import FileCorpus, PackedLoader, TokenStore, TokenStream, build_tokenizer  # noqa: E402
from ulysses_dtensor.data.bestfit import BestFitRows  # noqa: E402
from ulysses_dtensor.data.prepare import prepare_store  # noqa: E402
from ulysses_dtensor.data.token_docs import TokenDocs  # noqa: E402

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, as trainer/metrics.py


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def env() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"device": f"CPU {cpu} ({len(os.sched_getaffinity(0))} cores)", "python": platform.python_version(),
            "date": datetime.date.today().isoformat()}


# --------------------------------------------------------------------------- #
# Corpus and tokenizer
# --------------------------------------------------------------------------- #


def _vocabulary(rng, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    sylls = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "qu", "st", "ng"]
    words = {"".join(rng.choice(sylls, rng.integers(1, 4))) for _ in range(n * 2)}
    words = sorted(words)[:n]
    blob = np.frombuffer("".join(w + " " for w in words).encode(), dtype=np.uint8)
    lens = np.array([len(w) + 1 for w in words], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    return blob, starts, lens, np.cumsum(p / p.sum())


def generate_corpus(folder: Path, total_bytes: int, n_files: int, seed: int = 0) -> dict:
    """``n_files`` .jsonl files of about ``total_bytes`` in all (kept if present)."""
    done = folder / "corpus.json"
    if done.is_file():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    blob, wstart, wlen, cdf = _vocabulary(rng, 30000)
    t0 = time.perf_counter()
    docs = written = 0
    for f in range(n_files):
        target = total_bytes // n_files
        with open(folder / f"part-{f:03d}.jsonl", "wb") as fh:
            size = 0
            while size < target:
                n_words = int(np.clip((target - size) // 6, 1 << 12, 1 << 20))
                ids = np.searchsorted(cdf, rng.random(n_words))
                lens = wlen[ids]
                ends = np.cumsum(lens)
                idx = np.repeat(wstart[ids] - (ends - lens), lens) + np.arange(ends[-1])
                text = blob[idx].tobytes()
                # documents: log-normal word counts (median ~300 words), a few very long
                cut = np.cumsum(np.clip(rng.lognormal(np.log(300), 1.3, n_words // 100 + 1), 5, 100_000).astype(np.int64))
                cut = cut[cut < n_words]
                byte_cut = np.concatenate([[0], ends[cut - 1]])
                lines = [b'{"text": "' + text[a:b - 1] + b'"}\n' for a, b in zip(byte_cut[:-1], byte_cut[1:])]
                chunk = b"".join(lines)
                fh.write(chunk)
                size += len(chunk)
                docs += len(lines)
            written += size
    info = {"bytes": written, "files": n_files, "documents": docs, "seconds": time.perf_counter() - t0}
    done.write_text(json.dumps(info))
    return info


def train_tokenizer(folder: Path, vocab: int, sample_bytes: int = 32 << 20) -> Path:
    out = folder / "tokenizer.json"
    if out.is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        for f in sorted(folder.glob("*.jsonl")):
            with open(f) as fh:
                for line in fh:
                    seen += len(line)
                    yield json.loads(line)["text"]
                    if seen >= sample_bytes:
                        return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(out))
    return out


# --------------------------------------------------------------------------- #
# One simulated rank
# --------------------------------------------------------------------------- #


def _mem() -> dict:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("RssAnon:", "RssFile:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) / 1024
    return out


def _measure(kind: str, raw_dir: str, store_dir: str, tok_path: str, dp: int, rank: int, rows: int,
             seq: int, steps: int, queue, packing: str = "stream") -> None:
    try:
        tok = build_tokenizer(tok_path)
        before = _mem()
        t0 = time.perf_counter()
        store = TokenStore(store_dir)
        if kind == "prepared":
            store.check(tok)
            stream = TokenStream(store, seed=0)
        else:
            corpus = FileCorpus(raw_dir)
            stream = TokenStream(corpus, tok, seed=0)
            full = np.diff(np.load(Path(store_dir) / "documents.npy", mmap_mode="r"))
            t_idx = time.perf_counter()
            stream.docs.build_index(rank, dp, lambda mine: [mine if q == rank else full[q::dp] for q in range(dp)])
            index_s = time.perf_counter() - t_idx
        loader = PackedLoader(stream, dp_rank=rank, dp_size=dp, packing=packing, overlong="split")
        first = loader.next_batch(rows * dp, seq)
        t_first = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(steps):
            loader.next_batch(rows * dp, seq)
        dt = time.perf_counter() - t1
        after = _mem()
        rec = {"time_to_first_step_s": round(t_first, 4), "step_ms": round(1e3 * dt / steps, 3),
               "tokens_per_s_per_rank": round(rows * seq * steps / dt),
               "rss_anon_mib": round(after["RssAnon"] - before["RssAnon"], 1),
               "rss_file_mib": round(after["RssFile"] - before["RssFile"], 1),
               "first_rows": first["input_ids"][:, :64].tolist()}
        if kind == "raw":
            rec["length_index_share_s"] = round(index_s, 3)
        queue.put(rec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put({"error": repr(e)})


def measure(*args, packing: str = "stream") -> dict:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(*args, q, packing))
    p.start()
    rec = q.get()
    p.join()
    if "error" in rec:
        raise RuntimeError(rec["error"])
    return rec


# --------------------------------------------------------------------------- #
# SFT rows: best-fit decreasing vs the end-to-end cut
# --------------------------------------------------------------------------- #


class SampleLengths(TokenDocs):
    """Samples of given lengths (tokens made on demand): what packing needs is lengths."""

    def __init__(self, lengths):
        self.cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def __len__(self):
        return len(self.cum) - 1

    def cum_tokens(self, ids):
        return self.cum[np.asarray(ids, dtype=np.int64)]

    def tokens(self, i, start, stop):
        return np.arange(start, stop, dtype=np.int64)

    def fingerprint(self):
        return f"lengths:{len(self)}"


def sft_lengths(n: int, median: int, seed: int = 0) -> np.ndarray:
    """A chat-SFT-like mix: log-normal around ``median`` tokens (sigma 0.8), plus 3% long
    samples (log-normal around 8x the median, sigma 0.6): a long tail past 64K."""
    rng = np.random.default_rng(seed)
    body = rng.lognormal(np.log(median), 0.8, n)
    tail = rng.random(n) < 0.03
    body[tail] = rng.lognormal(np.log(8 * median), 0.6, int(tail.sum()))
    return np.maximum(16, body).astype(np.int64)


def packing_figures(n: int, median: int, seq: int, windows: list[int]) -> list[dict]:
    """One epoch of ``n`` samples packed into rows of ``seq`` tokens, each way."""
    lengths = sft_lengths(n, median)
    docs = SampleLengths(lengths)
    stream = TokenStream(docs, seed=0)
    order = stream.order.docs_between(0, 0, n)
    cum = np.cumsum(lengths[order])
    starts = cum - lengths[order]
    cut = int(((starts // seq) != ((cum - 1) // seq)).sum())  # samples a row end falls inside
    base = {"samples": n, "tokens": int(lengths.sum()), "median_tokens": int(np.median(lengths)),
            "mean_tokens": round(float(lengths.mean())), "p99_tokens": int(np.percentile(lengths, 99)),
            "longest": int(lengths.max()), "seq": seq, "longer_than_row": int((lengths > seq).sum())}
    out = [{**base, "packing": "stream", "pad_share": 0.0, "rows": -(-int(lengths.sum()) // seq),
            "samples_split": cut, "samples_split_share": round(cut / n, 4)}]
    for w in windows:
        packer = BestFitRows(TokenStream(docs, seed=0), window=w, overlong="split")
        t0 = time.perf_counter()
        rows = used = 0
        while packer.epoch == 0:  # the packer moves to epoch 1 right after the epoch's last row
            (row,) = packer.take(1, seq)
            rows += 1
            used += sum(b - a for _, a, b in row)
        secs = time.perf_counter() - t0
        assert used == int(lengths.sum())  # every token of the epoch once (samples longer than a row: split)
        out.append({**base, "packing": "bfd", "window": w, "rows": rows, "pad_share": round(1.0 - used / (rows * seq), 5),
                    "samples_split": packer.split, "pack_seconds": round(secs, 2),
                    "pack_us_per_sample": round(1e6 * secs / n, 1)})
    return out


# --------------------------------------------------------------------------- #
# What a run needs
# --------------------------------------------------------------------------- #


def need(mfu: float, step_tokens: int = 1 << 20, seq_len: int = 1 << 20, gpus: int = 8,
         sp: int = 8) -> dict:
    """Tokens/s one rank must load for Llama-3-8B at ``step_tokens`` per step.

    FLOPs per token = models/llama.py ``flops_per_token(seq_len)`` = 6 N (N:
    parameters without the embedding) + 12 L H d S / 2 (causal attention,
    forward + backward), the formula MFU uses in trainer/metrics.py. The
    cluster trains ``gpus * peak * mfu / flops_per_token`` tokens/s. With
    sp ranks per sequence, every sp rank reads its group's whole rows
    (``shard_batch`` slices after loading), so one rank loads ``step_tokens /
    (gpus / sp)`` tokens per step.
    """
    import torch

    from ulysses_dtensor.models.llama import Llama, llama_args

    with torch.device("meta"):
        model = Llama(llama_args("llama3_8b", vocab_size=128256))
    n = model.num_params(exclude_embeddings=True)
    fpt = model.flops_per_token(seq_len)
    cluster_tps = gpus * H100_BF16_PEAK * mfu / fpt
    step_s = step_tokens / cluster_tps
    per_rank = step_tokens / (gpus // sp) / step_s
    return {"model": "llama3_8b", "params_no_embedding": n, "seq_len": seq_len, "step_tokens": step_tokens,
            "gpus": gpus, "sp": sp, "dp": gpus // sp, "peak_flops_per_gpu": H100_BF16_PEAK, "mfu": mfu,
            "flops_per_token": fpt, "cluster_tokens_per_s": round(cluster_tps, 1), "step_s": round(step_s, 2),
            "rank_tokens_per_s": round(per_rank, 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/ulysses_bench_data")
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rows", type=int, default=8, help="rows per rank per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--long-seq", type=int, default=1 << 20, help="one row of this length per step (store); 0: skip")
    p.add_argument("--mfu", type=float, default=0.5)
    p.add_argument("--paths", nargs="+", default=["prepared", "raw"], choices=["prepared", "raw"])
    p.add_argument("--packing-samples", type=int, default=100_000, help="SFT samples of the packing figures")
    p.add_argument("--packing-median", type=int, default=3000, help="their median length in tokens")
    p.add_argument("--packing-seq", type=int, default=65536, help="row length of the packing figures")
    p.add_argument("--packing-windows", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--quick", action="store_true", help="1 MB corpus, 512-token vocabulary, dp 1 8, few steps")
    a = p.parse_args(argv)
    if a.quick:
        a.size_gb, a.files, a.vocab, a.dp, a.steps, a.long_seq = 1 / 1024, 2, 512, [1, 8], 3, 1 << 16
        a.workers = min(a.workers, 2)
        a.packing_samples, a.packing_windows = 2000, [256, 1024]
    root = Path(a.dir)
    raw, store = root / "raw", root / "store"
    base = {**env(), "corpus_bytes_target": int(a.size_gb * (1 << 30))}

    corpus = generate_corpus(raw, int(a.size_gb * (1 << 30)), a.files)
    t0 = time.perf_counter()
    tok_path = train_tokenizer(raw, a.vocab)
    emit({"bench": "data_corpus", **base, **corpus, "tokenizer_vocab": build_tokenizer(str(tok_path)).vocab_size,
          "tokenizer_train_s": round(time.perf_counter() - t0, 2)})

    if not store.exists():
        t0 = time.perf_counter()
        m = prepare_store([str(raw)], str(tok_path), store, workers=a.workers, log=lambda s: print(s, file=sys.stderr))
        secs = time.perf_counter() - t0
        emit({"bench": "data_prepare", **base, "workers": a.workers, "seconds": round(secs, 2),
              "documents": m["documents"], "tokens": m["tokens"], "tokens_per_s": round(m["tokens"] / secs),
              "store_bytes": sum(f.stat().st_size for f in store.iterdir()), "shards": len(m["shards"])})

    for rec in packing_figures(a.packing_samples, a.packing_median, a.packing_seq, a.packing_windows):
        emit({"bench": "data_packing", **base, **rec})

    best = 0.0
    for dp in a.dp:
        ref_rows = None
        for kind in a.paths:
            for rank in ([0, dp - 1] if kind == "prepared" and dp > 1 else [0]):
                rec = measure(kind, str(raw), str(store), str(tok_path), dp, rank, a.rows, a.seq, a.steps)
                rows = rec.pop("first_rows")
                if rank == 0:
                    ref_rows = ref_rows if ref_rows is not None else rows
                    rec["same_rows_as_prepared"] = rows == ref_rows
                if kind == "prepared":
                    best = max(best, rec["tokens_per_s_per_rank"])
                emit({"bench": "data_loader", **base, "path": kind, "dp": dp, "rank": rank, "rows": a.rows,
                      "seq": a.seq, "steps": a.steps, **rec})
    # best-fit rows read from the store: the loader's own cost beside the stream cut's
    rec = measure("prepared", str(raw), str(store), str(tok_path), a.dp[-1], 0, a.rows, a.seq, a.steps, packing="bfd")
    rec.pop("first_rows")
    emit({"bench": "data_loader", **base, "path": "prepared", "packing": "bfd", "dp": a.dp[-1], "rank": 0,
          "rows": a.rows, "seq": a.seq, "steps": a.steps, **rec})
    bfd_best = rec["tokens_per_s_per_rank"]
    if a.long_seq:
        rec = measure("prepared", str(raw), str(store), str(tok_path), 1, 0, 1, a.long_seq, max(2, a.steps // 4))
        rec.pop("first_rows")
        emit({"bench": "data_loader", **base, "path": "prepared", "dp": 1, "rank": 0, "rows": 1,
              "seq": a.long_seq, "steps": max(2, a.steps // 4), **rec})
        best = max(best, rec["tokens_per_s_per_rank"])
    # the 1M-token stage (sp 8: every rank reads the whole row), and an 8K stage of the
    # same 1M tokens per step (sp 1, dp 8: the most tokens per second of the schedule)
    for n in (need(a.mfu), need(a.mfu, seq_len=8192, sp=1)):
        emit({"bench": "data_need", **base, **n, "prepared_tokens_per_s_per_rank": best or None,
              "headroom": round(best / n["rank_tokens_per_s"], 1) if best else None,
              "bfd_tokens_per_s_per_rank": bfd_best, "bfd_headroom": round(bfd_best / n["rank_tokens_per_s"], 1)})


if __name__ == "__main__":
    main()
