"""Non-finite steps under ``UlyssesHFTrainer``: skipped on every rank, and the run stopped
after ``UlyssesArguments.max_nonfinite_steps`` in a row (the trainer's
``training.max_nonfinite_steps``, :mod:`ulysses_dtensor.runtime.nonfinite`).

The Trainer's seams, between the last backward and ``optimizer.step()``:

* ``training_step``: this rank's loss of each micro-batch, summed for the step;
* ``_clip_grad_norm`` (``max_grad_norm > 0``) / ``_get_grad_norm`` (otherwise): the
  gradient norm by :func:`~ulysses_dtensor.models.llama_parallelize.clip_grad_norm_` (the
  same norm and clipping as accelerate's; a non-finite norm leaves the gradients
  unscaled), then the guard's decision on every rank together. A skipped step's
  gradients are dropped (``zero_grad(set_to_none=True)``), so the optimizer's step
  changes no parameter and no optimizer state (torch's optimizers skip parameters
  without a gradient); the learning-rate schedule moves on, as the step count does;
* ``_save_checkpoint``: not at a skipped step, and never from weights or optimizer state
  that are not finite (``save_model`` checks the weights too).

After too many in a row, ``train()`` raises :class:`~ulysses_dtensor.runtime.nonfinite.NonFiniteError`
on every rank, naming the step, the ranks and the last checkpoint.
"""

from __future__ import annotations

import logging

import torch

from ulysses_dtensor.models.llama_parallelize import clip_grad_norm_
from ulysses_dtensor.runtime.nonfinite import NonFiniteGuard, check_finite_state, inject_nonfinite_grad

from .refusals import install_report_hook

__all__ = ["NonFiniteSteps"]

logger = logging.getLogger(__name__)


class NonFiniteSteps:
    """Mixed into :class:`~.mixin.UlyssesTrainerMixin` (above the Trainer in the MRO)."""

    _nonfinite_guard: NonFiniteGuard | None = None
    _step_loss: torch.Tensor | None = None  # this rank's loss of the step so far (micro-batches summed)

    def nonfinite_guard(self) -> NonFiniteGuard:
        if self._nonfinite_guard is None:
            self._nonfinite_guard = NonFiniteGuard(self.ulysses_args.max_nonfinite_steps,
                                                   "UlyssesArguments.max_nonfinite_steps")
        return self._nonfinite_guard

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss = loss.detach() if self._step_loss is None else self._step_loss + loss.detach()
        return loss

    def _clip_grad_norm(self, model):
        return self._checked_norm(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self._checked_norm(model, float("inf")) if grad_norm is None else grad_norm

    def _checked_norm(self, model, max_norm: float) -> torch.Tensor:
        """The step's gradient norm (clipped to ``max_norm`` when finite); a step that is not
        finite on some rank loses its gradients on every rank, or stops the run."""
        step = self.state.global_step + 1
        params = [p for p in model.parameters() if p.grad is not None]
        inject_nonfinite_grad(step, params)  # a test hook (runtime/nonfinite.py)
        norm = clip_grad_norm_(params, max_norm)
        guard = self.nonfinite_guard()
        skipped = guard.check(step, self._step_loss, norm, model)
        self._step_loss = None
        if skipped is None:
            return norm
        model.zero_grad(set_to_none=True)  # optimizer.step() then updates nothing
        if self.is_world_process_zero():
            logger.warning("step %d skipped (update not applied), non-finite: %s", step, skipped.cause())
        if guard.should_stop():
            install_report_hook()  # uncaught in the user's script: one line per node
            raise guard.error(self._last_checkpoint())
        return norm

    def _last_checkpoint(self) -> str:
        from transformers.trainer_utils import get_last_checkpoint

        found = get_last_checkpoint(self.args.output_dir) if self.args.output_dir else None
        if found is None:
            return f"No checkpoint in {self.args.output_dir} (save_strategy={self.args.save_strategy!s})."
        return (f"Last checkpoint: {found}; resume_from_checkpoint={found!r} resumes there: change what diverged "
                f"first (e.g. a lower learning_rate), or it will diverge again.")

    def _save_checkpoint(self, model, trial):
        guard = self.nonfinite_guard()
        if guard.streak:  # this step was skipped: its weights are the last applied step's
            if self.is_world_process_zero():
                logger.warning("checkpoint of step %d not written: the step was skipped (non-finite)",
                               self.state.global_step)
            return
        check_finite_state(model, self.optimizer, what=f"checkpoint of step {self.state.global_step}")
        super()._save_checkpoint(model, trial)
