"""A step whose loss or gradient norm is not finite: skipped by every rank together, and the
run stopped with one message when too many come in a row.

Used by both trainers (this package's loop and ``UlyssesHFTrainer``) between the gradient
norm and the optimizer step::

    guard = NonFiniteGuard(max_steps=3, setting="training.max_nonfinite_steps")
    ...backward, norm...
    skipped = guard.check(step, loss_share, grad_norm, model)   # collective, the same verdict everywhere
    if skipped is None: optimizer.step()                       # else: the update is not applied
    if guard.should_stop(): raise guard.error(last_checkpoint)

:meth:`NonFiniteGuard.check` gathers two flags from every rank (its own loss share, the
gradient norm), so the decision is taken on all ranks together before any optimizer
step: no rank applies an update that another skips. Only when a flag is set does it look
further (which parameters hold non-finite gradients or weights, on which rank) -- the
finite path costs one gather of two numbers per step and the host sync it needs.

:func:`check_finite_state` is what a checkpoint save calls first: weights and optimizer
state finite on every rank, or :class:`NonFiniteError` (nothing written).

A test hook in the style of :mod:`ulysses_dtensor.trainer.fault_injection`:
``ULYSSES_DTENSOR_TEST_NONFINITE="loss:1:5,grad:0:4"`` makes rank 1's loss NaN at step 5
(before backward: its gradients follow) and puts a NaN into rank 0's local gradient
shard of the first trained parameter at step 4 (after backward: that rank alone).
Without the variable each hook is one dictionary lookup.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["NONFINITE_FAULT_ENV", "NonFiniteError", "NonFiniteGuard", "NonFiniteStep", "check_finite_state",
           "inject_nonfinite_grad", "inject_nonfinite_loss"]

NONFINITE_FAULT_ENV = "ULYSSES_DTENSOR_TEST_NONFINITE"
_SHOWN = 3  # parameter names shown per rank; the rest are counted


class NonFiniteError(RuntimeError):
    """The run stopped: too many steps in a row with a non-finite loss or gradient norm, or
    non-finite weights or optimizer state found before a checkpoint save. The message is
    the same on every rank and names the step, the ranks, and the last good checkpoint."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nonfinite_names(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding any NaN or inf (one host sync for all of them)."""
    if not named:
        return []
    bad = torch.stack([~torch.isfinite(_local(t)).all() for _, t in named]).cpu()
    return [name for (name, _), b in zip(named, bad.tolist()) if b]


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _gather_objects(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _ranks(ranks: list[int], world: int) -> str:
    if world > 1 and len(ranks) == world:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass
class NonFiniteStep:
    """What one skipped step saw, the same on every rank."""

    step: int
    world: int
    grad_norm: float
    loss_ranks: list[int] = field(default_factory=list)  # ranks whose own loss share was not finite
    grads: dict[int, list[str]] = field(default_factory=dict)  # rank -> trained parameters with non-finite gradients
    weights: dict[int, list[str]] = field(default_factory=dict)  # rank -> parameters with non-finite weights
    float8: str = ""  # the model's FP8 layers, when on: an FP8 cast of an inf / NaN gives a non-finite scale

    def cause(self) -> str:
        """Where it showed: the loss (on which ranks; the gradients follow from it), else the
        gradient norm and the parameters whose gradients hold non-finite values, on which
        ranks; and the weights when they are not finite."""
        parts = []
        if self.loss_ranks:
            parts.append(f"loss not finite on {_ranks(self.loss_ranks, self.world)}")
        elif self.grads:
            parts.append(f"gradient norm {self.grad_norm:g}, non-finite gradients on {self._where(self.grads)}")
        else:
            parts.append(f"gradient norm {self.grad_norm:g}")
        if self.weights:
            parts.append(f"weights not finite on {self._where(self.weights)}: an earlier update made them so")
        if self.float8:
            parts.append(f"FP8 was on ({self.float8}): a non-finite amax gives a non-finite scale, and overflow "
                         f"past the FP8 range starts there")
        return "; ".join(parts)

    def _where(self, names: dict[int, list[str]]) -> str:
        ranks = sorted(names)
        if len(ranks) == 1:
            return f"{_ranks(ranks, self.world)} ({_listed(names[ranks[0]])})"
        return f"{_ranks(ranks, self.world)} ({'; '.join(f'rank {r}: {_listed(names[r])}' for r in ranks)})"

    def row(self) -> dict:
        """The fields a metrics row of a skipped step adds."""
        return {"skipped": True, "skip_reason": self.cause()}


class NonFiniteGuard:
    """Skips steps whose loss or gradient norm is not finite; stops after ``max_steps`` in a row.

    ``max_steps``: non-finite steps in a row that are skipped (their update not applied);
    the next one in a row stops the run (0: the first). ``setting``: the name a user sets
    it by, for the message.
    """

    def __init__(self, max_steps: int, setting: str):
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"{setting}={max_steps!r} must be an integer >= 0")
        self.max_steps = max_steps
        self.setting = setting
        self.streak: list[NonFiniteStep] = []  # the skipped steps of the current run of them
        self.skipped_total = 0

    def check(self, step: int, loss_share: torch.Tensor | None, grad_norm: torch.Tensor,
              model: nn.Module) -> NonFiniteStep | None:
        """None when this step is finite on every rank (the update may be applied), else what
        was not finite, the same on every rank. Collective: every rank calls it each step,
        after the gradient norm and before the optimizer step (the gradients still there)."""
        norm = torch.as_tensor(grad_norm).detach().float().reshape(())
        device = norm.device if loss_share is None else loss_share.device
        loss_bad = torch.zeros((), device=device) if loss_share is None else \
            (~torch.isfinite(loss_share.detach())).float().reshape(())
        flags = torch.stack([loss_bad, (~torch.isfinite(norm.to(device))).float()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts = [torch.empty_like(flags) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, flags)
            flags = torch.stack(parts)
        flags = flags.reshape(-1, 2).cpu()  # the host sync: the decision is taken before any update
        if not flags.any():
            self.streak.clear()
            return None
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        mine = {"grads": _nonfinite_names([(n, p.grad) for n, p in trained if p.grad is not None]),
                "weights": _nonfinite_names(list(model.named_parameters()))}
        seen = _gather_objects(mine)
        verdict = NonFiniteStep(
            step=step, world=len(seen), grad_norm=float(norm),
            loss_ranks=[r for r in range(flags.shape[0]) if flags[r, 0]],
            grads={r: s["grads"] for r, s in enumerate(seen) if s["grads"]},
            weights={r: s["weights"] for r, s in enumerate(seen) if s["weights"]},
            float8=_float8_words(model),
        )
        self.streak.append(verdict)
        self.skipped_total += 1
        return verdict

    def skipped(self, step: int) -> NonFiniteStep | None:
        """What was not finite at ``step``, when :meth:`check` skipped it (None: applied)."""
        return self.streak[-1] if self.streak and self.streak[-1].step == step else None

    def should_stop(self) -> bool:
        return len(self.streak) > self.max_steps

    def error(self, last_checkpoint: str) -> NonFiniteError:
        """The one message of a stopped run; ``last_checkpoint`` says where to resume from."""
        first, last = self.streak[0], self.streak[-1]
        n = len(self.streak)
        steps = f"step {last.step}" if n == 1 else f"steps {first.step}-{last.step}"
        allowed = ("stops at the first" if self.max_steps == 0
                   else f"skips {self.max_steps} in a row and stops at the next")
        if n == 1:
            where = f"Step {first.step}: {first.cause()}."
        else:
            then = "the same" if last.cause() == first.cause() else last.cause()
            where = f"It started at step {first.step}: {first.cause()}. Step {last.step}: {then}."
        return NonFiniteError(
            f"training stopped at step {last.step}: {n} step{'s' if n > 1 else ''} in a row with a non-finite loss "
            f"or gradient norm ({steps}; {self.setting}={self.max_steps} {allowed}); no update of "
            f"{'that step' if n == 1 else 'those steps'} was applied. {where} {last_checkpoint}")


def _float8_words(model: nn.Module) -> str:
    report = getattr(model, "float8_report", None)
    return f"float8 {report.recipe}, {report.converted} linear layers" if report is not None and report.converted \
        else ""


def check_finite_state(model: nn.Module, optimizer, *, what: str) -> None:
    """:class:`NonFiniteError` on every rank when any rank's weights or optimizer state hold
    a NaN or inf (``what``: the save it guards, for the message); collective."""
    named = list(model.named_parameters())
    names = {id(p): n for n, p in named}
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            for key, value in getattr(optimizer, "state", {}).get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    named.append((f"optimizer {key} of {names.get(id(p), '?')}", value))
    bad = _gather_objects(_nonfinite_names(named))
    if any(bad):
        where = "; ".join(f"rank {r}: {_listed(n)}" for r, n in enumerate(bad) if n)
        raise NonFiniteError(f"{what} not written: the weights or optimizer state are not finite ({where})")


def _faults(kind: str, step: int) -> bool:
    spec = os.environ.get(NONFINITE_FAULT_ENV)
    if not spec:
        return False
    rank = int(os.environ.get("RANK", 0))
    for fault in spec.split(","):
        name, fault_rank, fault_step = fault.strip().split(":")
        if name == kind and int(fault_rank) == rank and int(fault_step) == step:
            return True
    return False


def inject_nonfinite_loss(step: int, loss: torch.Tensor) -> torch.Tensor:
    """Test hook: this rank's loss times NaN at a chosen step (before backward)."""
    return loss * float("nan") if _faults("loss", step) else loss


def inject_nonfinite_grad(step: int, params) -> None:
    """Test hook: a NaN in this rank's local shard of the first trained gradient at a chosen step."""
    if _faults("grad", step):
        grad = next(p.grad for p in params if p.grad is not None)
        _local(grad).view(-1)[0] = float("nan")
