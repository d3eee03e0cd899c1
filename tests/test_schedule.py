"""Context-length stages and the learning-rate schedule."""

import math

import pytest

from ulysses_dtensor.trainer.schedule import ContextSchedule, LRSchedule, Stage

STAGES = [Stage(1, 8192), Stage(100, 65536), Stage(200, 262144), Stage(300, 1048576)]


def test_stage_lookup():
    s = ContextSchedule(STAGES, global_batch_size=8)
    assert [s.seq_len(t) for t in (1, 99, 100, 199, 200, 299, 300, 10**6)] == [
        8192, 8192, 65536, 65536, 262144, 262144, 1048576, 1048576
    ]
    assert s.stage_index(150) == 1 and s.stage(150) == STAGES[1]
    assert s.batch_size(1) == s.batch_size(300) == 8
    assert s.tokens(300) == 8 * 1048576
    assert s.max_seq_len == 1048576
    with pytest.raises(ValueError, match="counted from 1"):
        s.seq_len(0)


def test_constant_tokens_per_step():
    s = ContextSchedule(STAGES, tokens_per_step=1 << 21)
    assert [s.batch_size(t) for t in (1, 100, 200, 300)] == [256, 32, 8, 2]
    assert {s.tokens(t) for t in (1, 100, 200, 300)} == {1 << 21}
    s.validate(sp=8, dp=2)
    with pytest.raises(ValueError, match="stage from step 300.*not divisible by the 4"):
        s.validate(sp=8, dp=4)
    with pytest.raises(ValueError, match=r"tokens_per_step=1000000 is not a whole multiple"):
        ContextSchedule(STAGES, tokens_per_step=10**6)


def test_validate_every_stage_against_sp():
    s = ContextSchedule([Stage(1, 128), Stage(5, 250)], global_batch_size=4)
    s.validate(sp=2, dp=4)
    with pytest.raises(ValueError, match=r"schedule\[1\].seq_len=250.*parallelism.sp=4"):
        s.validate(sp=4)


def test_bad_stages():
    with pytest.raises(ValueError, match="must start at step 1"):
        ContextSchedule([Stage(0, 128)], global_batch_size=1)
    with pytest.raises(ValueError, match="must be greater"):
        ContextSchedule([Stage(1, 128), Stage(5, 256), Stage(5, 512)], global_batch_size=1)
    with pytest.raises(ValueError, match="at least one stage"):
        ContextSchedule([], global_batch_size=1)


def test_lr_warmup_then_linear():
    f = LRSchedule(total_steps=10, warmup_steps=4, decay="linear", min_lr_ratio=0.1)
    assert [f(t) for t in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    # 6 decay steps from 1 down to 0.1 at step 10.
    for t in range(5, 11):
        assert f(t) == pytest.approx(1 - 0.9 * (t - 4) / 6)
    assert f(10) == pytest.approx(0.1)


def test_lr_cosine_and_none():
    f = LRSchedule(total_steps=12, warmup_steps=2, decay="cosine", min_lr_ratio=0.0)
    assert f(1) == 0.5 and f(2) == 1.0
    assert f(7) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(12) == pytest.approx(0.0, abs=1e-12)
    g = LRSchedule(total_steps=5, warmup_steps=0, decay="none")
    assert [g(t) for t in range(1, 6)] == [1.0] * 5
    with pytest.raises(ValueError, match="valid: linear, cosine, none"):
        LRSchedule(5, decay="step")
