"""The Llama model on one process: sizes, rope, init, errors, document packing.

Sharded-init independence and SP parity are in test_parallelize.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from ulysses_dtensor.models.llama import (
    FLAVORS,
    Llama,
    LlamaArgs,
    RopeConfig,
    apply_rope,
    llama_args,
    rope_cos_sin,
    rope_frequencies,
)


def expected_params(a: LlamaArgs) -> int:
    """Parameter count derived from the shapes alone."""
    hd = a.dim // a.n_heads
    attn = a.dim * a.n_heads * hd * 2 + a.dim * a.n_kv_heads * hd * 2  # wq, wo; wk, wv
    mlp = 3 * a.dim * a.ffn_dim
    per_layer = attn + mlp + 2 * a.dim  # + two RMSNorm weights
    emb = a.vocab_size * a.dim
    return a.n_layers * per_layer + a.dim + emb * (1 if a.tie_embeddings else 2)


# Published sizes: Llama 3.2 1B / 3B (tied), Llama 3.1 8B / 70B.
PUBLISHED = {
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_published_parameter_counts(flavor):
    with torch.device("meta"):
        model = Llama(llama_args(flavor))
    assert model.num_params() == expected_params(model.args) == PUBLISHED[flavor]
    assert all(p.device.type == "meta" for p in model.parameters())


def test_published_shapes_and_flops():
    a = llama_args("llama3_8b")
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, a.ffn_dim) == (
        4096, 32, 32, 8, 128256, 14336,
    )
    assert llama_args("llama3_1b").tie_embeddings and llama_args("llama3_3b").tie_embeddings
    assert not llama_args("llama3_70b").tie_embeddings
    with torch.device("meta"):
        model = Llama(a)
    non_emb = 8_030_261_248 - 128256 * 4096
    assert model.num_params(exclude_embeddings=True) == non_emb
    # 6N + causal attention: 12 * L * dim * S / 2.
    assert model.flops_per_token(8192) == 6 * non_emb + 6 * 32 * 4096 * 8192
    assert model.flops_per_token(8192, causal=False) == 6 * non_emb + 12 * 32 * 4096 * 8192
    # Tied: the shared table is the output matmul, it counts.
    with torch.device("meta"):
        tied = Llama(llama_args("llama3_1b"))
    assert tied.num_params(exclude_embeddings=True) == PUBLISHED["llama3_1b"]


def test_debug_flavors_fit_sp():
    assert FLAVORS["debug"].n_kv_heads == 4 and FLAVORS["debug"].n_heads == 8
    assert FLAVORS["debug_gqa"].n_kv_heads == 2  # < sp 4: kv heads replicated


def test_unknown_flavor_and_override():
    with pytest.raises(ValueError, match=r"unknown model flavor 'llama3_8B'.*llama3_70b.*did you mean 'llama3_8b'"):
        llama_args("llama3_8B")
    with pytest.raises(ValueError, match=r"'n_layer'.*did you mean 'n_layers'"):
        llama_args("debug", n_layer=3)
    with pytest.raises(ValueError, match="unknown attention backend"):
        llama_args("debug", attn_backend="sdap")
    with pytest.raises(ValueError, match="n_kv_heads"):
        llama_args("debug", n_kv_heads=3)
    assert llama_args("debug", n_layers=3).n_layers == 3
    assert FLAVORS["debug"].n_layers == 2  # overrides do not leak into FLAVORS


# ---------------------------------------------------------------------------
# Rotary embeddings
# ---------------------------------------------------------------------------


def test_rope_on_slice_with_global_positions_equals_full_sequence():
    args = llama_args("debug")
    inv = rope_frequencies(args.rope, args.head_dim)
    b, s, sp = 2, 64, 4
    q = torch.randn(b, s, args.n_heads, args.head_dim)
    # Packed positions: two documents, restart at 0.
    pos = torch.cat([torch.arange(20), torch.arange(44)]).expand(b, s)
    full = apply_rope(q, *rope_cos_sin(pos, inv))
    n = s // sp
    for r in range(sp):
        sl = slice(r * n, (r + 1) * n)
        part = apply_rope(q[:, sl], *rope_cos_sin(pos[:, sl], inv))
        assert torch.equal(part, full[:, sl])
    # Local positions (0..n-1) on a slice would be wrong.
    wrong = apply_rope(q[:, n : 2 * n], *rope_cos_sin(torch.arange(n).expand(b, n), inv))
    assert not torch.allclose(wrong, full[:, n : 2 * n])


def test_rope_is_a_rotation_and_relative():
    args = llama_args("debug")
    inv = rope_frequencies(args.rope, args.head_dim)
    q, k = torch.randn(1, 1, 1, args.head_dim), torch.randn(1, 1, 1, args.head_dim)

    def rot(x, p):
        return apply_rope(x, *rope_cos_sin(torch.tensor([[p]]), inv))

    assert torch.allclose(rot(q, 12345).norm(), q.norm(), rtol=1e-5)
    # <R_m q, R_n k> depends on m - n only.
    d1 = (rot(q, 1_000_007) * rot(k, 1_000_000)).sum()
    d2 = (rot(q, 7) * rot(k, 0)).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-5)


def test_rope_angles_are_exact_at_a_million_tokens():
    args = llama_args("llama3_8b")
    inv = rope_frequencies(args.rope, args.head_dim)
    pos = torch.tensor([[1_048_575, 3_999_999]])
    cos, sin = rope_cos_sin(pos, inv)
    for j in (0, 1, 17, 40):
        for i, p in enumerate(pos[0].tolist()):
            angle = p * inv[j].item()  # float64 reference
            assert abs(cos[0, i, j].item() - math.cos(angle)) < 1e-6
            assert abs(sin[0, i, j].item() - math.sin(angle)) < 1e-6


def test_rope_scaling_reduces_low_frequencies():
    scaled = rope_frequencies(llama_args("llama3_8b").rope, 128)
    plain = rope_frequencies(RopeConfig(theta=500000.0), 128)
    assert scaled.shape == plain.shape == (64,)
    assert torch.equal(plain, 500000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4  # short wavelengths: unchanged
    low = wavelen > 8192 / 1  # long wavelengths: divided by the factor 8
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    assert (scaled[mid] < plain[mid]).all() and (scaled[mid] > plain[mid] / 8).all()
    assert (scaled[1:] < scaled[:-1]).all()  # still monotonic
    # 1B / 3B (Llama 3.2) use factor 32.
    assert llama_args("llama3_1b").rope.factor == 32.0


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def _model(flavor="debug", seed=0, **overrides):
    model = Llama(llama_args(flavor, **overrides))
    model.init_weights(seed)
    return model


def test_forward_shapes_defaults_and_hidden_states():
    model = _model()
    ids = torch.randint(0, 512, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 512)
    assert torch.equal(logits, model(ids, torch.arange(16).expand(2, 16)))
    torch.testing.assert_close(model.output(model.hidden_states(ids)), logits)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, torch.arange(8).expand(2, 8))


def test_packed_documents_do_not_see_each_other():
    """Logits of a document packed after another equal those of it alone."""
    model = _model("debug_gqa")
    a, b = torch.randint(0, 512, (1, 11)), torch.randint(0, 512, (1, 21))
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(11), torch.arange(21)])[None]
    doc = torch.cat([torch.zeros(11), torch.ones(21)]).long()[None]
    out = model(packed, pos, doc)
    torch.testing.assert_close(out[:, :11], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 11:], model(b), rtol=1e-5, atol=1e-5)
    # Without the document mask the second document would attend to the first.
    assert not torch.allclose(model(packed, pos)[:, 11:], model(b), atol=1e-3)


def test_tied_embeddings_share_the_table():
    model = _model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == expected_params(model.args)


# ---------------------------------------------------------------------------
# init_weights
# ---------------------------------------------------------------------------


def test_init_weights_deterministic_and_seeded():
    m1, m2, m3 = _model(seed=3), _model(seed=3), _model(seed=4)
    for (n, p1), p2, p3 in zip(m1.named_parameters(), m2.parameters(), m3.parameters()):
        assert torch.equal(p1, p2), n
        if not n.endswith("norm.weight"):
            assert not torch.equal(p1, p3), n
    # Does not depend on the global RNG.
    torch.manual_seed(99)
    m4 = _model(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m4.parameters()))


def test_init_weights_statistics():
    args = llama_args("debug", dim=256, n_heads=8, n_kv_heads=4, ffn_dim=512, n_layers=4)
    model = Llama(args)
    model.init_weights(0)
    l0, l3 = model.layers["0"], model.layers["3"]
    assert torch.equal(l0.attention_norm.weight, torch.ones(256))
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert abs(l0.attention.wq.weight.std().item() - 0.02 * 0.986) < 2e-3  # 3-sigma truncation
    assert l0.attention.wq.weight.abs().max() <= 0.06 + 1e-6
    assert l3.attention.wo.weight.std() < l0.attention.wo.weight.std()  # depth-scaled
    assert abs(model.tok_embeddings.weight.std().item() - 1.0) < 0.02


def test_init_weights_blocks_are_sliceable(monkeypatch):
    """The row blocks a shard draws reproduce the rows of the full draw."""
    import ulysses_dtensor.models.init as init

    monkeypatch.setattr(init, "_BLOCK_NUMEL", 64 * 5)  # 5 rows of the 64-wide table per block
    full = torch.empty(512, 64)
    init.init_param(full, "t", "normal", 1.0, seed=7)

    # A shard holding rows 123..300 (crossing block boundaries) draws only its blocks.
    local = torch.empty(178, 64)
    monkeypatch.setattr(init, "_local_region", lambda p: (local, (178, 64), (123, 0)))
    init.init_param(full, "t", "normal", 1.0, seed=7)
    assert torch.equal(local, full[123:301])


def test_init_weights_on_meta_is_a_clear_error():
    with torch.device("meta"):
        model = Llama(llama_args("debug"))
    with pytest.raises(RuntimeError, match="to_empty"):
        model.init_weights(0)
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
