"""What TRL's GRPO and DPO trainers share under Ulysses SP, on top of
:class:`~ulysses_dtensor.integrations.hf.UlyssesTrainerMixin`.

Both compute their loss from per-token log-probabilities of whole sequences, which TRL
asks of its models through a fused head (``model(..., fused_lm_head=True)``). Here
every such call is handed :class:`~.sp_logprobs.SPLogProbs` instead (the policy, or
the reference): every sp rank of a group gets the whole sequences' values and runs
TRL's own loss on them, the same number on each. With gradients flowing only into a
rank's own tokens, the gradients FSDP2 sums over the sp ranks are that loss's; each
rank's loss is divided by the data-parallel size, so that the sum over the
data-parallel ranks is their mean, as DDP's average over TRL's processes is.

* The reference model (TRL builds it when ``beta`` / DPO needs one and there is no
  LoRA) is sharded like the policy, forward only: the policy's mesh and memory
  switches, no activation checkpointing, its parameters frozen. With LoRA there is
  none: TRL's own ``use_adapter`` context turns the adapter off around the policy.
* ``training_step`` returns what TRL's does (the logged loss is the data-parallel
  ranks' mean of their losses, as TRL logs it); ``prediction_step`` is TRL's.
* Refused for both: ``cast_lm_head_to_fp32`` (the head is the sharded module; the
  per-token values are computed in float32 from its output) and vision inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..hf.causal_lm import adapt_causal_lm
from ..hf.parallelize_model import parallelize_hf_model
from ..hf.ulysses_trainer.arguments import parallelize_options
from ..hf.ulysses_trainer.refusals import UlyssesTrainerError
from ..hf.ulysses_trainer.mixin import (
    UlyssesTrainerMixin,
    _accelerator_settings,
    _check_same_weights,
    _transformers_model,
)
from .sp_logprobs import SPLogProbs

__all__ = ["UlyssesRLMixin"]


class UlyssesRLMixin(UlyssesTrainerMixin):
    """The shared seams (see the module doc); ``trl_class`` is the TRL trainer the
    subclass extends, whose own methods the overrides call past the SFT mixin's."""

    trl_class: type

    def __init__(self, *args, **kwargs):
        self._ref_raw = None  # the reference model as TRL built it (sharded in place at first use)
        self._ref_call = None
        self._generation_attn = "sdpa"
        super().__init__(*args, **kwargs)

    # -- setup --------------------------------------------------------------------------

    def check_arguments(self) -> None:
        super().check_arguments()
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            raise UlyssesTrainerError(f"{type(self.args).__name__}.cast_lm_head_to_fp32=True is not supported by "
                             f"{type(self).__name__}: the head is the sharded module and the per-token "
                             "log-probabilities are computed in float32 from its output; leave it False")

    def create_accelerator_and_postprocess(self) -> None:
        inner = _transformers_model(self.model)
        # What generation runs with (the trained model's own attention, before SP replaces it).
        self._generation_attn = getattr(inner.config, "_attn_implementation", None) or "sdpa"
        super().create_accelerator_and_postprocess()

    @staticmethod
    def _router_logits_as_trl_asks(model, args) -> None:
        """Before TRL's ``__init__``: TRL adds the MoE router loss whenever the model's config
        has ``output_router_logits`` (and a coefficient), even False; the model here computes
        it only when the key is True at its first call, which can come during TRL's
        ``__init__`` (DPO's precomputed reference): set it as TRL will read it."""
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None else None
        if text is None or not hasattr(text, "output_router_logits"):
            return
        coef = getattr(args, "router_aux_loss_coef", None)
        if (getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef) != 0.0:
            text.output_router_logits = True

    def _finish_setup(self) -> None:
        """After TRL's ``__init__``: the reference sharded, TRL's offload context off."""
        # Offloading is the parallelized layers' own (parallelize_options).
        self.maybe_activation_offload_context = contextlib.nullcontext()
        ref = getattr(self, "ref_model", None)
        if ref is not None and not isinstance(ref, SPLogProbs):
            self._ref_raw = ref
            self.ref_model = self._reference()

    def _reference(self) -> SPLogProbs:
        """The reference model sharded like the policy, forward only (built at first use)."""
        if self._ref_call is None:
            raw = self._ref_raw
            inner = _transformers_model(raw)
            precision, backend = _accelerator_settings(self)
            options = parallelize_options(self.args, self.ulysses_args, mixed_precision=precision,
                                          dynamo_backend=backend)
            # No backward: nothing checkpointed, offloaded or kept for one.
            options["memory"] = dataclasses.replace(options["memory"], ac_mode="none", offload_activations=False,
                                                    save_attention=False)
            inner.requires_grad_(False)
            inner.eval()
            _check_same_weights(inner, self.args.device)
            parallelize_hf_model(inner, self.pmesh, **options)
            inner.__dict__.pop("forward", None)  # TRL's fused head, set on the instance
            lm = adapt_causal_lm(inner, self.pmesh, loss_chunks=self.ulysses_args.loss_chunks or None)
            self._ref_call = SPLogProbs(lm, self.pmesh, temperature=self._logprob_temperature(),
                                        chunks=self.ulysses_args.loss_chunks or None, name="the reference model")
        return self._ref_call

    def _logprob_temperature(self) -> float:
        return 1.0

    # -- the model calls TRL makes ----------------------------------------------------------

    def sp_call(self, model, fields=("log_probs",)) -> SPLogProbs:
        """What TRL calls in ``model``'s place: the reference's or the policy's
        :class:`~.sp_logprobs.SPLogProbs`."""
        if isinstance(model, SPLogProbs):
            return model
        ref = getattr(self, "ref_model", None)
        if model is self._ref_raw or (ref is not None and model is ref):  # TRL's reference (maybe not yet sharded)
            self._ref_raw = model
            return self._reference()
        return SPLogProbs(self.causal_lm(), self.pmesh, fields=fields, temperature=self._logprob_temperature(),
                          chunks=self.ulysses_args.loss_chunks or None, aux_grad_scale=self.pmesh.dims.dp,
                          name=type(self._sp_model).__name__)

    # -- the Trainer's seams ------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples, device):
        return None  # TRL's losses count their own tokens

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = self.trl_class.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        loss = loss / self.pmesh.dims.dp  # summed over the data-parallel ranks: their mean
        return (loss, *rest) if rest is not None else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self.trl_class.training_step(self, model, inputs, num_items_in_batch) * self.pmesh.dims.dp

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = self.trl_class.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)
        return (None if loss is None else loss * self.pmesh.dims.dp), logits, labels

    def _generation_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.args.bf16 else torch.float32
