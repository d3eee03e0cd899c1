"""Attention as the memory planner traces it (attention/planning.py): each call is
planned with the kernel the target GPU runs for its case, stood in for on the CPU by
a call of the same memory class, and counted.

The property that matters: a sliding window, sinks or packed documents planned for a
GPU whose kernel keeps O(S) build no (S, S) tensor, while the same call run on the
CPU (sdpa's dense mask / explicit scores) does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_dtensor.attention import Capabilities, local_attention
from ulysses_dtensor.attention.planning import planning_for, planning_target

H100 = Capabilities.target("H100", "2.11")
A100 = Capabilities.target("A100", "2.11")
S = 128


class _LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _call(**pattern):
    torch.manual_seed(0)
    q = torch.randn(1, S, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, S, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, S, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    if pattern.pop("sinks", False):
        pattern["sinks"] = torch.zeros(4, requires_grad=True)
    if pattern.pop("documents", False):
        pattern["document_ids"] = torch.arange(S).div(S // 4, rounding_mode="floor")[None]
    with _LargestTensor() as seen:
        out = local_attention(q, k, v, **pattern)
        out.float().sum().backward()
    return out, seen.largest


@pytest.mark.parametrize("pattern, kernel", [
    ({}, "cudnn"),
    ({"documents": True}, "varlen"),
    ({"window": 16}, "varlen"),
    ({"window": 16, "sinks": True}, "flex"),
    ({"softcap": 30.0}, "flex"),
])
def test_planned_for_a_gpu_builds_no_seq_by_seq_tensor(pattern, kernel):
    dense = bool(pattern)
    _, on_cpu = _call(**dict(pattern))
    with planning_for(H100) as counts:
        assert planning_target() is H100
        out, planned = _call(**dict(pattern))
    assert planning_target() is None
    assert out.shape == (1, S, 4, 16)
    (choice,) = counts
    assert choice.backend == kernel and choice.memory == "lse" and counts[choice] == 1
    assert planned < S * S, f"planned for {kernel}, a tensor of {planned} elements (S*S = {S * S})"
    if dense:  # the same call on the CPU runs sdpa's dense mask or scores
        assert on_cpu >= S * S


def test_a_named_backend_is_planned_as_named_or_refused_for_that_machine():
    with planning_for(H100) as counts:
        _, largest = _call(backend="sdpa", window=16)  # sdpa's dense mask, as it would run
    (choice,) = counts
    assert (choice.backend, choice.memory, choice.row) == ("sdpa", "dense_mask", "named")
    assert largest >= S * S
    with planning_for(A100), pytest.raises(ValueError) as e:
        _call(backend="fa4")
    assert "'fa4'" in str(e.value) and "sm80" in str(e.value) and "planned machine" in str(e.value)
    with planning_for(H100), pytest.raises(ValueError) as e:
        _call(backend="varlen", softcap=30.0)
    assert "'varlen'" in str(e.value) and "soft-capping" in str(e.value)
