"""``UlyssesSFTTrainer``: TRL's ``SFTTrainer`` under Ulysses SP and FSDP2, the change in one place::

    trainer = UlyssesSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok,
                                peft_config=LoraConfig(...), ulysses_args=UlyssesArguments(sp_size=4))

TRL prepares the data as it always does (tokenizing, ``packing=True`` with best-fit
decreasing, padding-free batches of ``position_ids``, completion-only and assistant-only
labels) and builds the peft model; :class:`~ulysses_dtensor.integrations.hf.UlyssesTrainerMixin`
takes over where the model is sharded and called. What differs from ``SFTTrainer``:

* the loss is this package's sp-sharded token mean (tiled with ``loss_chunks``) instead
  of TRL's fused head: packed documents stay apart in attention, in the recurrences of
  hybrid layers and in the loss (TRL made packing with context parallelism an error,
  trl #6843, because its documents attended across each other);
* the MoE router loss is TRL's (``router_aux_loss_coef``), over the global batch;
* ``activation_offloading`` is this package's host offload of checkpointed layer inputs;
* logged: ``num_tokens`` (over the data-parallel ranks) and ``aux_loss``; not
  ``entropy`` and ``mean_token_accuracy``, which need the whole logits;
* refused: ``loss_type="dft"`` (a per-token weight of the probabilities, not implemented
  here) and vision datasets (the text path runs under SP).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ulysses_dtensor.parallel.loss import global_loss

from ..hf.ulysses_trainer.refusals import UlyssesTrainerError
from ..hf.ulysses_trainer.mixin import UlyssesTrainerMixin

try:
    from trl import SFTTrainer
except ImportError as e:  # pragma: no cover - the trl extra is absent
    raise ImportError("UlyssesSFTTrainer needs TRL: pip install 'ulysses-dtensor[trl]'") from e

__all__ = ["UlyssesSFTTrainer"]


class UlyssesSFTTrainer(UlyssesTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with Ulysses SP, FSDP2 / HSDP and the memory switches
    (``ulysses_args=UlyssesArguments(...)``); see the module doc for what differs."""

    version_checks = UlyssesTrainerMixin.version_checks + (("trl", "SFTTrainer"),)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Offloading is the parallelized layers' own (parallelize_options); TRL's context would
        # offload every saved tensor a second time.
        self.maybe_activation_offload_context = contextlib.nullcontext()
        if getattr(self, "aux_loss_enabled", False):
            # TRL's coefficient (its config key or the model's), read by the adapted model.
            self._sp_model.router_aux_loss_coef = self.router_aux_loss_coef

    def check_arguments(self) -> None:
        super().check_arguments()
        args = self.args
        if getattr(args, "loss_type", "nll") != "nll":
            raise UlyssesTrainerError(f"{type(args).__name__}.loss_type={args.loss_type!r} is not supported by "
                                      "UlyssesSFTTrainer: the loss is the sp-sharded token-mean cross entropy ('nll')")
        if getattr(self, "_is_vision_dataset", False):
            raise UlyssesTrainerError(
                "a vision dataset is not supported by UlyssesSFTTrainer: the model's text path runs "
                "on a slice of the sequence, and images would have to be split with it")

    def record_batch(self, batch, inputs, lm) -> None:
        mode = "train" if lm.training else "eval"
        mask = inputs.get("attention_mask")
        tokens = (mask.sum() if mask is not None else torch.tensor(batch["input_ids"].numel())).to(self.args.device)
        if self.pmesh.dims.dp > 1:  # the sp ranks of a group hold the same batch: one count per group
            dist.all_reduce(tokens, group=self.pmesh.dp.get_group())
        if mode == "train":
            self._total_train_tokens += int(tokens)
            self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        router = lm.pop_router_aux_loss()
        if router is not None and mode == "train":
            # The share of this micro-batch, weighted 1 / micro-batches: a step's shares sum to its mean.
            value = global_loss(router.to(self.args.device), self.pmesh.loss)
            self._metrics[mode]["aux_loss"].append(float(value) * self.current_gradient_accumulation_steps)
