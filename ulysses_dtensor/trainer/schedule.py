"""Progressive context length and learning-rate schedules.

Steps are counted from 1: step 1 is the first optimizer step, and the first
context stage must start at step 1. A stage runs from its ``start_step`` up to
the step before the next stage's ``start_step``.

Batch size per stage, in sequences of that stage's length:

* fixed sequences per step (``tokens_per_step=None``): every stage uses
  ``global_batch_size`` sequences, so longer stages see more tokens per step;
* constant tokens per step (``tokens_per_step`` given): a stage of length S uses
  ``tokens_per_step / S`` sequences, which must be a whole number divisible by
  the number of data-parallel streams.

Both schedules are pure functions of the step, so resuming needs only the step.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

__all__ = ["Stage", "ContextSchedule", "LRSchedule", "DECAYS"]

DECAYS = ("linear", "cosine", "none")


@dataclass(frozen=True)
class Stage:
    """From ``start_step`` (1-based) on, train on sequences of ``seq_len`` tokens.

    ``rope_theta`` / ``rope_scaling`` (a table in transformers' ``rope_parameters``
    form) change the model's rope from this stage on; None keeps the previous
    stage's. They are resolved against the model's own rope by the trainer
    (``trainer/rope_stages.py``).
    """

    start_step: int
    seq_len: int
    rope_theta: float | None = None
    rope_scaling: dict | None = field(default=None, hash=False)

    @property
    def sets_rope(self) -> bool:
        return self.rope_theta is not None or self.rope_scaling is not None


class ContextSchedule:
    """Sequence length and global batch size (in sequences) for each step."""

    def __init__(
        self,
        stages: list[Stage],
        *,
        global_batch_size: int | None = None,
        tokens_per_step: int | None = None,
        length_key: str | None = None,
    ):
        # The config key messages name for a stage's length: the schedule's
        # entry, or e.g. "training.seq_len" when that made the only stage.
        self._length_key = length_key
        if not stages:
            raise ValueError("context.schedule needs at least one stage")
        self.stages = list(stages)
        for i, st in enumerate(self.stages):
            if st.seq_len < 1:
                raise ValueError(f"{self.key(i)}={st.seq_len} must be >= 1")
        if self.stages[0].start_step != 1:
            raise ValueError(
                f"context.schedule[0].start_step={self.stages[0].start_step}: the first "
                "stage must start at step 1 (steps are counted from 1)"
            )
        for i in range(1, len(self.stages)):
            if self.stages[i].start_step <= self.stages[i - 1].start_step:
                raise ValueError(
                    f"context.schedule[{i}].start_step={self.stages[i].start_step} must be "
                    f"greater than the previous stage's start_step="
                    f"{self.stages[i - 1].start_step} (stages are listed in step order)"
                )
        if (global_batch_size is None) == (tokens_per_step is None):
            raise ValueError("give exactly one of global_batch_size and tokens_per_step")
        self.global_batch_size = global_batch_size
        self.tokens_per_step = tokens_per_step
        self._starts = [st.start_step for st in self.stages]
        for i, st in enumerate(self.stages):
            if tokens_per_step is not None:
                if tokens_per_step < st.seq_len or tokens_per_step % st.seq_len:
                    raise ValueError(
                        f"training.tokens_per_step={tokens_per_step} is not a whole multiple "
                        f"of {self.key(i)}={st.seq_len} (stage from step "
                        f"{st.start_step}); with constant tokens per step every stage's "
                        f"seq_len must divide tokens_per_step"
                    )
            elif global_batch_size < 1:
                raise ValueError(
                    f"training.global_batch_size={global_batch_size} must be >= 1"
                )

    def key(self, i: int) -> str:
        """The config key stage ``i``'s length came from, for messages."""
        return self._length_key or f"context.schedule[{i}].seq_len"

    # ------------------------------------------------------------------ lookup
    def stage_index(self, step: int) -> int:
        if step < 1:
            raise ValueError(f"step={step}: steps are counted from 1")
        return bisect.bisect_right(self._starts, step) - 1

    def stage(self, step: int) -> Stage:
        return self.stages[self.stage_index(step)]

    def seq_len(self, step: int) -> int:
        return self.stage(step).seq_len

    def batch_for(self, seq_len: int) -> int:
        if self.tokens_per_step is not None:
            return self.tokens_per_step // seq_len
        return self.global_batch_size

    def batch_size(self, step: int) -> int:
        """Global number of sequences at ``step``."""
        return self.batch_for(self.seq_len(step))

    def tokens(self, step: int) -> int:
        return self.batch_size(step) * self.seq_len(step)

    @property
    def max_seq_len(self) -> int:
        return max(st.seq_len for st in self.stages)

    def validate(self, *, sp: int = 1, dp: int = 1) -> None:
        """Check every stage up front: seq_len a multiple of sp, batch divisible by dp."""
        for i, st in enumerate(self.stages):
            if st.seq_len % sp:
                raise ValueError(
                    f"{self.key(i)}={st.seq_len} (stage from step "
                    f"{st.start_step}) is not a multiple of parallelism.sp={sp}; packed "
                    f"training sequences must split evenly over the sp ranks: use a "
                    f"multiple of {sp} (e.g. {max(sp, st.seq_len // sp * sp)})"
                )
            batch = self.batch_for(st.seq_len)
            if batch % dp:
                how = (
                    f"training.tokens_per_step={self.tokens_per_step} / seq_len={st.seq_len}"
                    if self.tokens_per_step is not None
                    else "training.global_batch_size"
                )
                raise ValueError(
                    f"global batch of {batch} sequences ({how}) in the stage from step "
                    f"{st.start_step} is not divisible by the {dp} data-parallel streams "
                    f"(dp_replicate*dp_shard); use a multiple of {dp}"
                )

    def __repr__(self) -> str:
        stages = ", ".join(f"{s.start_step}:{s.seq_len}" for s in self.stages)
        size = (
            f"tokens_per_step={self.tokens_per_step}"
            if self.tokens_per_step is not None
            else f"global_batch_size={self.global_batch_size}"
        )
        return f"ContextSchedule([{stages}], {size})"


class LRSchedule:
    """Multiplier of the base learning rate at a (1-based) step.

    Linear warm-up over ``warmup_steps`` (step w of the warm-up gets w/warmup),
    then decay from 1 to ``min_lr_ratio`` at the last step (linear or cosine),
    or constant 1 (``none``).
    """

    def __init__(self, total_steps: int, warmup_steps: int = 0, decay: str = "linear",
                 min_lr_ratio: float = 0.0):
        if decay not in DECAYS:
            raise ValueError(f"lr_scheduler.decay={decay!r}; valid: {', '.join(DECAYS)}")
        if warmup_steps < 0:
            raise ValueError(f"lr_scheduler.warmup_steps={warmup_steps} must be >= 0")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"lr_scheduler.min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.decay = decay
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return step / self.warmup_steps
        if self.decay == "none":
            return 1.0
        span = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        lo = self.min_lr_ratio
        if self.decay == "linear":
            return 1.0 - (1.0 - lo) * progress
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))
