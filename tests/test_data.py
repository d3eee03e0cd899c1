"""Tokenizer, document sources, the token stream, packing: exact token accounting,
and each data-parallel rank reading (and tokenizing) only its own rows."""

import json
import sys

import numpy as np
import pytest
import torch

from ulysses_dtensor.data import (
    ByteTokenizer,
    FileCorpus,
    PackedLoader,
    StdlibCorpus,
    TokenStream,
    build_source,
    build_tokenizer,
    padded_vocab_size,
)
from ulysses_dtensor.parallel.batch import shard_batch


class ListSource:
    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]

    def fingerprint(self):
        return f"list:{len(self.docs)}"


DOCS = [
    "hello world",
    "",
    "a" * 70,
    "ünïcödé ✓ text",
    "x",
    "the quick brown fox jumps over the lazy dog " * 3,
    "zz",
]


def reference_stream(tok, source, order_fn, n_tokens):
    """The stream written out the slow way: docs in epoch order, concatenated."""
    out, epoch = [], 0
    while len(out) < n_tokens:
        for i in order_fn(epoch):
            out.extend(tok.encode(source[int(i)]).tolist())
        epoch += 1
    return np.array(out[:n_tokens])


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'ünïcödé ✓'\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.vocab_size == 258 and int(ids.max()) < tok.vocab_size
    assert padded_vocab_size(tok.vocab_size, 64) == 320
    assert build_tokenizer("byte").vocab_size == 258


def test_hf_tokenizer_missing_package_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'ulysses-dtensor\[tokenizers\]'"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("shuffle, block", [(False, 8192), (True, 8192), (True, 3)])
def test_packing_exact_across_stage_change_and_dp(shuffle, block):
    """Concatenating every emitted row (all dp ranks, both stages) is the stream:
    the epochs' documents, in each epoch's order, one after another. ``block=3``
    shuffles blocks of 3 documents and the documents inside each."""
    tok = ByteTokenizer()
    src = ListSource(DOCS)
    plan = [(4, 16)] * 6 + [(2, 32)] * 8 + [(8, 8)] * 4  # (global batch, seq_len)
    total = sum(b * s for b, s in plan)
    # Enough steps to wrap the corpus several times (epoch boundary included).
    assert total > 3 * sum(len(tok.encode(d)) for d in DOCS)
    for dp in (1, 2):
        loaders = [
            PackedLoader(TokenStream(src, tok, seed=3, shuffle=shuffle, block=block), dp_rank=r, dp_size=dp)
            for r in range(dp)
        ]
        rows = []
        for b, s in plan:
            parts = [ld.next_batch(b, s) for ld in loaders]
            for p in parts:
                assert p["input_ids"].shape == (b // dp, s)
            rows.append(torch.cat([p["input_ids"] for p in parts]).reshape(-1))
        got = torch.cat(rows).numpy()
        ref_stream = TokenStream(src, tok, seed=3, shuffle=shuffle, block=block)
        orders = [_order(ref_stream, e) for e in range(8)]
        ref = reference_stream(tok, src, lambda e: orders[e], total)
        np.testing.assert_array_equal(got, ref)
        assert all(ld.tokens_seen == total for ld in loaders)
        # the sequential reader (evaluation rows) gives the same stream
        np.testing.assert_array_equal(ref_stream.take(total)[0], ref)
    if shuffle:  # each epoch a permutation of every document, and epochs differ
        assert all(sorted(o) == list(range(len(DOCS))) for o in orders)
        assert orders[0] != orders[1] and orders[0] != list(range(len(DOCS)))


def _order(stream, epoch):
    return [stream.order.doc_at(epoch, p) for p in range(stream.order.n)]


def test_position_ids_restart_at_documents_and_rows():
    tok = ByteTokenizer()
    docs = ["ab", "cdefghij", "k"]  # 4, 10, 3 tokens with BOS/EOS
    loader = PackedLoader(TokenStream(ListSource(docs), tok, shuffle=False))
    b = loader.next_batch(2, 6)
    # stream: [B a b E][B c d e f g h i j E][B k E]...
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert b["input_ids"][0, 4].item() == tok.bos_id
    # The second row continues doc 2 with positions restarting at 0.
    assert b["input_ids"][1].tolist() == [ord(c) for c in "defghi"]
    b2 = loader.next_batch(1, 8)  # [j E][B k E][B a b]
    assert b2["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    # shard_batch finds the documents from the positions.
    sharded = shard_batch(b2, sp_rank=0, sp_size=2)
    assert sharded["document_ids"].tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]]
    # The label of a document's last token is ignored (no cross-document target).
    assert sharded["labels"][0].tolist() == [tok.eos_id, -100, ord("k"), tok.eos_id]


def test_state_dict_resumes_exactly():
    tok = ByteTokenizer()
    src = ListSource(DOCS)
    a = PackedLoader(TokenStream(src, tok, seed=1), dp_rank=1, dp_size=2)
    for _ in range(5):
        a.next_batch(4, 12)
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON (checkpoint format)
    expect = [a.next_batch(2, 24) for _ in range(6)]
    b = PackedLoader(TokenStream(src, tok, seed=1), dp_rank=1, dp_size=2)
    b.load_state_dict(state)
    for e in expect:
        got = b.next_batch(2, 24)
        assert torch.equal(got["input_ids"], e["input_ids"])
        assert torch.equal(got["position_ids"], e["position_ids"])
    assert b.tokens_seen == a.tokens_seen
    # A different seed would not continue the same stream: refused.
    c = PackedLoader(TokenStream(src, tok, seed=2), dp_rank=1, dp_size=2)
    with pytest.raises(ValueError, match="seed"):
        c.load_state_dict(state)
    # So would other data; and a cursor of the old sequential format is named as such.
    d = PackedLoader(TokenStream(ListSource(DOCS[:-1]), tok, seed=1), dp_rank=1, dp_size=2)
    with pytest.raises(ValueError, match=r"data source\(s\) \['list:7'\] but this run reads \['list:6'\]"):
        d.load_state_dict(state)
    with pytest.raises(ValueError, match="older format"):
        b.load_state_dict({"epoch": 0, "doc_index": 3, "doc_offset": 0, "tokens_seen": 9})


def test_dp_shares_disjoint_and_cover_global_batch():
    tok = ByteTokenizer()
    src = ListSource(DOCS)
    glob = PackedLoader(TokenStream(src, tok, seed=0)).next_batch(8, 10)
    for dp in (2, 4, 8):
        shares = [
            PackedLoader(TokenStream(src, tok, seed=0), dp_rank=r, dp_size=dp).next_batch(8, 10)
            for r in range(dp)
        ]
        for key in ("input_ids", "position_ids"):
            assert torch.equal(torch.cat([s[key] for s in shares]), glob[key])
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        PackedLoader(TokenStream(src, tok), dp_rank=0, dp_size=3).next_batch(8, 10)


def test_stdlib_corpus_deterministic_and_capped():
    a = StdlibCorpus(max_bytes=1 << 20)
    b = StdlibCorpus(max_bytes=1 << 20)
    assert a.files == b.files and a.files == sorted(a.files)
    assert 0 < a.total_bytes <= 1 << 20
    for f in a.files:
        parts = f.relative_to(a.root).parts[:-1]
        assert not {"test", "tests", "site-packages"} & set(parts)
    assert "import" in "".join(a[i] for i in range(min(len(a), 20)))
    assert len(build_source("", max_corpus_mb=1.0)) == len(a)


def test_file_corpus_txt_and_jsonl(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n\nstill second")
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n"
    )
    (tmp_path / "ignored.csv").write_text("x")
    src = FileCorpus(tmp_path)
    assert [src[i] for i in range(len(src))] == ["one", "two", "second file\n\nstill second"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="data.text_key"):
        FileCorpus(tmp_path)[3]


class CountingTokenizer(ByteTokenizer):
    """Records which documents (by text) it encodes."""

    def __init__(self):
        super().__init__()
        self.encoded: list[str] = []

    def encode(self, text, bos=True, eos=True):
        self.encoded.append(text)
        return super().encode(text, bos, eos)


def test_ranks_tokenize_only_their_own_rows():
    """Raw text: after the length index (each of the world's ranks counts 1/world of
    the documents), a rank tokenizes only the documents its own rows touch; its
    batch is still its slice of the same global batch."""
    docs = [f"document number {i} " + "x" * (5 + 7 * (i % 9)) for i in range(400)]
    dp, seq, batch = 8, 16, 64
    ref = PackedLoader(TokenStream(ListSource(docs), ByteTokenizer(), seed=5)).next_batch(batch, seq)
    for rank in (0, 5):
        tok = CountingTokenizer()
        stream = TokenStream(ListSource(docs), tok, seed=5)
        stream.docs.build_index(rank=rank, world=dp, gather=lambda mine: [
            np.array([len(ByteTokenizer().encode(docs[i])) for i in range(r, len(docs), dp)]) if r != rank
            else mine for r in range(dp)])
        assert len(tok.encoded) == len(range(rank, len(docs), dp))  # its share of the index
        tok.encoded.clear()
        got = PackedLoader(stream, dp_rank=rank, dp_size=dp).next_batch(batch, seq)
        mine = slice(rank * batch // dp, (rank + 1) * batch // dp)
        assert torch.equal(got["input_ids"], ref["input_ids"][mine])
        # documents touched: each starts with BOS, plus one cut at the rows' start
        touched = int((got["input_ids"] == tok.bos_id).sum()) + 1
        assert len(set(tok.encoded)) <= touched and len(tok.encoded) <= touched + 1
        assert sum(len(t) for t in tok.encoded) < 2 * (batch // dp) * seq  # not the global batch's


def test_read_at_any_offset_equals_the_sequential_stream():
    """Random access by global token offset (what a rank uses for its first row)
    equals the sequential walk, across document, block and epoch boundaries."""
    tok = ByteTokenizer()
    for block in (1, 4, 8192):
        walk = TokenStream(ListSource(DOCS * 3), tok, seed=9, block=block).take(3000)[0]
        stream = TokenStream(ListSource(DOCS * 3), tok, seed=9, block=block)
        for start in (0, 1, 17, 399, 1200, 2500):
            toks, pos, targets = stream.read(start, 500)
            np.testing.assert_array_equal(toks, walk[start:start + 500])
            assert pos[0] == 0 and targets is None
