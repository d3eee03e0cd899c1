"""torchtitan's metrics processor with its max loss taken over whole samples, not sp slices.

torchtitan logs ``loss_metrics/global_max_loss`` as the maximum, over the ranks
of its loss mesh, of ``loss sum of the rank / valid tokens of the rank's data``.
It counts the valid tokens on the batch the data loader gave (before any
sequence split) but sums the loss over the tokens the rank computed. Under
Ulysses (sp on torchtitan's cp axis) a rank computes 1/sp of its batch, so the
logged maximum came out about sp times too small.

:class:`UlyssesMetricsProcessor` logs instead the maximum over the data-parallel
ranks of each one's token-mean loss over its WHOLE sequences: the sp ranks of a
group add their loss sums first. That is what torchtitan logs without a
sequence split (its definition at ``ulysses.degree = 1``). Every other figure is
torchtitan's and already right under Ulysses: the average loss (loss shares
summed over dp x sp), the gradient norm (of the full gradients), tokens seen
(each rank counts the real tokens of its slice, summed over dp x sp), and
tokens/s, TFLOPS and MFU per device (a data rank's tokens divided by the cp
axis, i.e. by sp). Memory figures are the logging rank's. The validator's loss
(:class:`~.trainer.UlyssesValidator`) is right as torchtitan computes it: the
slices' loss sums added over dp x sp, over the valid tokens counted over dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils

__all__ = ["SampleLossTally", "UlyssesMetricsProcessor", "max_loss_config"]


class SampleLossTally:
    """One step's figures for the max loss: this rank's loss shares and its data's token counts."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.share: Tensor | None = None  # sum over micro-batches of (loss sum of this slice / global valid)
        self.valid: Tensor | None = None  # valid labels of this data rank's rows (whole sequences)
        self.global_valid: Tensor | None = None  # valid labels of the global batch

    @property
    def recorded(self) -> bool:
        return self.share is not None

    def add(self, share: Tensor, labels: Tensor | list[Tensor], global_valid: Tensor) -> None:
        """``share``: what the forward-backward step returned; ``labels``: the data
        rank's rows before the sequence split (a list of micro-batches under pipeline
        parallelism); ``global_valid``: the step's global count."""
        share = share.detach()
        if isinstance(share, DTensor):
            share = share.to_local()
        valid = sum((lab != IGNORE_INDEX).sum() for lab in labels) if isinstance(labels, list) else (
            (labels != IGNORE_INDEX).sum())
        self.share = share.clone() if self.share is None else self.share + share
        self.valid = valid if self.valid is None else self.valid + valid
        self.global_valid = global_valid

    def max_loss(self, parallel_dims: ParallelDims) -> float:
        """Max over the data ranks of the token-mean loss of each one's whole sequences.

        A collective: every rank calls it.
        """
        share = self.share.float()
        sp_mesh = parallel_dims.get_optional_mesh("cp")
        if sp_mesh is not None:  # the slices of one sample: add them
            share = funcol.all_reduce(share, "sum", sp_mesh.get_group()).wait()
        # share is (loss sum of the data rank) / global valid
        rank_loss = share * self.global_valid.to(share.device) / self.valid.clamp(min=1).to(share.device)
        return dist_utils.dist_max(rank_loss, parallel_dims.get_optional_mesh("batch"))


class UlyssesMetricsProcessor(MetricsProcessor):
    """torchtitan's ``MetricsProcessor``; the trainer records each step's loss into
    ``sample_losses``, and the max loss is computed from it (see the module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.sample_losses = SampleLossTally()

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict | None = None,
    ):
        # torchtitan's value (a slice's loss sum over its data rank's token count) is replaced.
        if self.sample_losses.recorded:
            global_max_loss = self.sample_losses.max_loss(self.parallel_dims)
        self.sample_losses.reset()
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


def max_loss_config(metrics: MetricsProcessor.Config) -> UlyssesMetricsProcessor.Config:
    """``metrics`` as the Ulysses processor's config (torchtitan's stock one is converted)."""
    from torchtitan.config.override import derive

    if isinstance(metrics, UlyssesMetricsProcessor.Config):
        return metrics
    if type(metrics) is not MetricsProcessor.Config:
        raise ValueError(
            f"metrics: {type(metrics).__qualname__} would log torchtitan's max loss, which is "
            f"wrong under a sequence split; derive your metrics processor from "
            f"{UlyssesMetricsProcessor.__module__}.UlyssesMetricsProcessor (and its Config), or "
            "use torchtitan's MetricsProcessor.Config"
        )
    return derive(metrics, UlyssesMetricsProcessor.Config)

