"""The planner and FP8 linear layers (issue 55, item 6): a GPU's FP8 step planned on CPU.

The planner traces torchao's FP8 layers as an H100 runs them (FP8 matmuls by their shape
functions, not emulated): the FP8 copies of weights and activations, their scales and the
casts' temporaries are counted as the step makes them; with ``enable_fsdp_float8_all_gather``
the gathered weights are FP8. A GPU without FP8 is refused by name. (The CPU figure against
a real step, FP8 emulated: ``w2_sp2_float8`` of tests/test_estimate.py.)
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("torchao.float8", reason="the float8 extra (torchao) is not installed")

from ulysses_dtensor.attention import Capabilities  # noqa: E402
from ulysses_dtensor.estimate import plan_memory  # noqa: E402
from ulysses_dtensor.trainer.config import ConfigError, load_config  # noqa: E402

DIM, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
TINY = [
    "--model.flavor", "debug", "--model.dim", str(DIM), "--model.ffn_dim", str(FFN), "--model.n_heads", str(HEADS),
    "--model.n_kv_heads", str(KV_HEADS), "--model.vocab_size", "1024", "--model.n_layers", "2",
    "--training.global_batch_size", "1", "--parallelism.sp", "2", "--activation_checkpoint.mode", "full",
    "--training.mixed_precision_param", "bfloat16", "--memory.tiled_loss", "true",
]
SEQ = 8192
TENSORWISE = ["--float8.enable", "true", "--float8.recipe_name", "tensorwise"]


@functools.cache
def _plan(*extra: str):
    return plan_memory(load_config(TINY + list(extra)), 2, SEQ, device="cuda")


def test_fp8_all_gathers_gather_one_byte_per_weight_and_a_scale_per_layer():
    fp8, fp8_gather = _plan(*TENSORWISE), _plan(*TENSORWISE, "--float8.enable_fsdp_float8_all_gather", "true")
    head_dim = DIM // HEADS
    # One block's linear layers (q, k, v, o, and the SwiGLU's three) and its two norms.
    linear = DIM * (HEADS + 2 * KV_HEADS + HEADS) * head_dim + 3 * DIM * FFN
    norms = 2 * DIM
    # The same block is gathered at both peaks: bf16 weights, then FP8 weights (one byte
    # each) with one float32 scale per linear layer; the norms stay bf16.
    assert fp8.breakdown["Unsharded Param"] == 2 * (linear + norms)
    assert fp8_gather.breakdown["Unsharded Param"] == linear + 2 * norms + 4 * 7
    # The peak falls by the bytes saved, less the scales (each also alive once as a temporary).
    assert fp8.peak_bytes - fp8_gather.peak_bytes == linear - 2 * 4 * 7
    assert fp8_gather.features["float8_all_gather"] and not fp8.features["float8_all_gather"]


def test_fp8_casts_are_counted_in_the_plan():
    bf16, rowwise = _plan(), _plan("--float8.enable", "true")
    assert rowwise.features["float8"] == "rowwise" and bf16.features["float8"] is None
    # Eager FP8 casts go through float32 copies of each matmul's operands (torch.compile fuses
    # them away): more temporaries at the peak than bf16, never fewer.
    tokens = SEQ // 2
    assert rowwise.breakdown["Temp"] - bf16.breakdown["Temp"] >= tokens * FFN * 4


def test_a_gpu_without_fp8_is_refused_by_name():
    cfg = load_config(TINY + ["--float8.enable", "true"])
    with pytest.raises(ConfigError, match=r"^float8.enable=true planned for sm80.*compute capability 8\.9 or "
                                          r"newer \(sm80 has none\)"):
        plan_memory(cfg, 2, SEQ, device="cuda", target=Capabilities.target("A100"))
