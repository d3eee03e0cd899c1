"""The hybrid mixers' GPU kernels on a GPU (``gpu`` mark; skipped without CUDA or the
kernel's package): each kernel against the torch code in float32 on the same bf16 inputs,
and against each document run alone, forward and every input's gradient, 2 rows x 300
tokens with documents starting mid-chunk, at chunk starts and of one token. The CPU side
(the decision table, the calls against the installed signatures) is tests/test_mixer_kernels.py.
On an offline GPU machine, ``source scripts/kernel_wheels.sh`` first (fla-core's carried wheel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_mixer_kernels import BF16, F32, _real

from ulysses_dtensor.mixers import dispatch, kernel_choice
from ulysses_dtensor.mixers.kernel_choice import describe_mixer_kernels

CUDA = torch.cuda.is_available()
GPU_SEQ, GPU_STARTS = 300, [[0, 37, 64, 65, 200], [0, 128, 129, 250]]  # mid-chunk, chunk starts, 1-token docs
# bfloat16 inputs against float32 torch on the same (bf16-rounded) values: max |error| over max |reference|.
BF16_RTOL = {"gated_delta": 5e-2, "conv": 1e-2, "ssd": 5e-2, "selective": 3e-2}
F32_RTOL = 1e-4  # the kernels that accumulate in float32 and take float32 inputs


def _kernel_or_skip(name):
    if not CUDA:
        pytest.skip("needs CUDA")
    _real(name)  # skips where the package is absent


def _gpu_documents():
    docs = torch.zeros(2, GPU_SEQ, dtype=torch.long)
    for r, row in enumerate(GPU_STARTS):
        for i, (a, b) in enumerate(zip(row, row[1:] + [GPU_SEQ])):
            docs[r, a:b] = i
    return docs.cuda()


def _gpu_inputs(op: str, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dtype)

    b, s = 2, GPU_SEQ
    if op == "gated_delta":  # Qwen3-Next-like head dims, 2 key heads, 4 value heads
        return [rand(b, s, 2, 128), rand(b, s, 2, 128), rand(b, s, 4, 128),
                -torch.rand(b, s, 4, generator=g, device="cuda"), torch.rand(b, s, 4, generator=g, device="cuda").to(dtype)]
    if op == "conv":
        return [rand(b, s, 64), rand(64, 4, scale=0.5), rand(64)]
    if op == "ssd":
        return [rand(b, s, 4, 32), F.softplus(rand(b, s, 4)).to(dtype), -torch.rand(4, generator=g, device="cuda") - 0.5,
                rand(b, s, 2, 16), rand(b, s, 2, 16), rand(4).float()]
    return [rand(b, s, 32), rand(b, s, 32), rand(32).float(), -torch.rand(32, 16, generator=g, device="cuda") - 0.5,
            rand(b, s, 16), rand(b, s, 16), rand(32).float()]


def _run(op: str, inputs, documents, path: str):
    """One op through the dispatcher, the decision forced to ``path`` (a kernel or "torch")."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dispatch, "kernel_for", lambda *a, **kw: path)
        if op == "gated_delta":
            return dispatch.gated_delta_rule(*inputs, document_ids=documents)
        if op == "conv":
            return dispatch.causal_conv(*inputs, document_ids=documents, activation="silu")
        if op == "ssd":
            x, dt, A, B, C, D = inputs
            return dispatch.ssd_scan(x, dt, A, B, C, 64, D, documents)
        return dispatch.selective_scan(*inputs, document_ids=documents)


def _out_and_grads(op, inputs, documents, path, weight):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = _run(op, leaves, documents, path)
    grads = torch.autograd.grad((out.float() * weight).sum(), [t for t in leaves if t.requires_grad])
    return out.float(), [gr.float() for gr in grads]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _compare(op, kernel, dtype, documents, rtol):
    inputs = _gpu_inputs(op, dtype)
    weight = torch.randn(_run(op, inputs, documents, "torch").shape, device="cuda")
    got, got_grads = _out_and_grads(op, inputs, documents, kernel, weight)
    # The torch code in float32 on the very same (rounded) values.
    want, want_grads = _out_and_grads(op, [t.float() if t.is_floating_point() else t for t in inputs],
                                      documents, "torch", weight)
    errors = {"out": _rel(got, want), **{f"grad{i}": _rel(a, b) for i, (a, b) in enumerate(zip(got_grads, want_grads))}}
    print(f"{op} {kernel} {dtype} documents={documents is not None}: {errors}")
    assert max(errors.values()) < rtol, errors
    return got


# Which of _gpu_inputs' tensors are (batch, seq, ...): the rest are per head / channel.
PER_TOKEN = {"gated_delta": {0, 1, 2, 3, 4}, "conv": {0}, "ssd": {0, 1, 3, 4}, "selective": {0, 1, 4, 5}}
GPU_CASES = [("gated_delta", "fla.chunk_gated_delta_rule"), ("conv", "fla.causal_conv1d"),
             ("conv", "causal_conv1d_fn"), ("ssd", "mamba_chunk_scan_combined")]


@pytest.mark.gpu
@pytest.mark.parametrize("op, kernel", GPU_CASES, ids=[k for _, k in GPU_CASES])
def test_gpu_kernel_matches_torch_and_documents_alone(op, kernel):
    _kernel_or_skip(kernel)
    docs = _gpu_documents()
    _compare(op, kernel, BF16, None, BF16_RTOL[op])
    packed = _compare(op, kernel, BF16, docs, BF16_RTOL[op])
    # Each document run alone through the kernel (batch 1, no documents) equals its slice of the packed run.
    inputs = _gpu_inputs(op, BF16)
    per_token = PER_TOKEN[op]
    worst = 0.0
    for r, row in enumerate(GPU_STARTS):
        for a, b in zip(row, row[1:] + [GPU_SEQ]):
            piece = [t[r:r + 1, a:b] if i in per_token else t for i, t in enumerate(inputs)]
            alone = _run(op, piece, None, kernel).float()
            worst = max(worst, _rel(alone, packed[r:r + 1, a:b]))
    print(f"{op} {kernel}: each document alone vs packed, max rel {worst:.1e}")
    assert worst < BF16_RTOL[op], worst


@pytest.mark.gpu
@pytest.mark.parametrize("op, kernel", [("conv", "fla.causal_conv1d"), ("conv", "causal_conv1d_fn"),
                                        ("selective", "selective_scan_fn")])
def test_gpu_float32_kernels_match_torch(op, kernel):
    _kernel_or_skip(kernel)
    _compare(op, kernel, F32, _gpu_documents() if op == "conv" else None, F32_RTOL)


@pytest.mark.gpu
def test_gpu_selective_scan_kernel_bf16_and_documents_run_torch():
    _kernel_or_skip("selective_scan_fn")
    _compare("selective", "selective_scan_fn", BF16, None, BF16_RTOL["selective"])
    assert dispatch.kernel_for("selective", "cuda", BF16, 16, True) == "torch"


@pytest.mark.gpu
def test_gpu_dispatch_picks_the_kernels_that_import():
    if not CUDA:
        pytest.skip("needs CUDA")
    found = kernel_choice.importable_kernels()
    print("importable mixer kernels:", sorted(found))
    print(describe_mixer_kernels({"conv", "gated_delta", "ssd", "selective"}, "cuda", BF16))
    want = "fla.chunk_gated_delta_rule" if "fla.chunk_gated_delta_rule" in found else "torch"
    assert dispatch.kernel_for("gated_delta", "cuda", BF16, 128, 128) == want
