"""The memory-lean RMSNorm: the plain formula's values and gradients, only x kept."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import ulysses_dtensor.models.norm as N
from ulysses_dtensor.models.norm import RMSNorm, rms_norm

EPS = 1e-5


def plain(x, w, eps=EPS):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


@pytest.fixture
def small_chunks(monkeypatch):
    # 7-token chunks of the dim-16 tensors (fewer tokens at dim 8): several per tensor, and a ragged last one.
    monkeypatch.setattr(N, "CHUNK_ELEMENTS", 7 * 16)


def _assert_matches(formula, reference, dtype, atol):
    """Forward bitwise equal to ``reference``; gradients to float32 rounding (bf16: to its own)."""
    torch.manual_seed(0)
    x = torch.randn(3, 20, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(16, dtype=dtype, requires_grad=True)
    y, ref = formula(x, w), reference(x, w)
    assert y.dtype == ref.dtype
    torch.testing.assert_close(y, ref, atol=0, rtol=0)  # forward: bitwise
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g)
    for a, b, name in zip(got, want, ("dx", "dw")):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_the_plain_formula(small_chunks, dtype, atol):
    _assert_matches(lambda x, w: rms_norm(x, w, EPS), plain, dtype, atol)


def plain_scaled(x, w, offset, eps=EPS):
    """gpt-oss / OLMo2 (offset 0) and Gemma / Qwen3-Next (offset 1): the weight applied in float32."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (n * (offset + w.to(xf.dtype))).to(x.dtype)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_weight_in_float32_formulas_match(small_chunks, offset, dtype, atol):
    formula = functools.partial(rms_norm, eps=EPS, offset=offset, cast_first=False)
    _assert_matches(formula, functools.partial(plain_scaled, offset=offset), dtype, atol)
    if dtype == torch.float32:
        x64 = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
        w64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(formula, (x64, w64))


def test_gradcheck_float64(small_chunks):
    x = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, EPS), (x, w))


def test_module_and_input_only_gradient():
    norm = RMSNorm(16)
    x = torch.randn(2, 5, 16, requires_grad=True)
    norm.weight.requires_grad_(False)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is None
    torch.testing.assert_close(x.grad, torch.autograd.grad(plain(x, norm.weight).sum(), x)[0], atol=1e-5, rtol=1e-5)


def _saved_bytes(fn, *args) -> int:
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total


def test_keeps_only_its_input_for_backward():
    s, d = 4096, 64
    x = torch.randn(1, s, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(d, dtype=torch.bfloat16, requires_grad=True)
    lean = _saved_bytes(rms_norm, x, w, EPS)
    # x itself (bf16), the weight, one float32 rstd per token: nothing of size (s, d) but x.
    assert lean == s * d * 2 + d * 2 + s * 4
    # The plain formula keeps the float32 upcast and more: at least 3 copies of x.
    assert _saved_bytes(plain, x, w) >= 3 * s * d * 2
