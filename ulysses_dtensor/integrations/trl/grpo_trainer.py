"""``UlyssesGRPOTrainer``: TRL's ``GRPOTrainer`` under Ulysses SP and FSDP2, the change in one place::

    trainer = UlyssesGRPOTrainer(model=model, reward_funcs=[...], args=GRPOConfig(...), train_dataset=ds,
                                 peft_config=LoraConfig(...), ulysses_args=UlyssesArguments(sp_size=4))

TRL does everything it does -- sampling prompts, rollouts (its own generation, vLLM,
or ``rollout_func``), rewards and advantages, old-policy and reference log-probs, the
loss of every ``loss_type`` with its clipping, KL, entropy masking and importance
sampling, and every metric -- on whole sequences; what changes:

* the per-token log-probabilities and entropies (policy, old policy, reference) are
  computed under SP on packed rows and handed back whole to every sp rank
  (:mod:`.sp_logprobs`), so each normalisation sees whole sequences;
* rollouts and rewards are split over the sp ranks of a group, each an equal share
  of the rows, and joined back (:mod:`.rollouts`): generation with transformers runs
  on an unsharded copy of the policy (:mod:`.policy_copy`), vLLM is sent the full
  weights (LoRA merged) where TRL syncs them;
* a data stream is a data-parallel rank: ``per_device_train_batch_size`` rows per
  data-parallel rank, ``generation_batch_size`` is
  ``per_device_train_batch_size x data-parallel ranks x steps_per_generation``;
* the MoE router loss is that of the whole global batch (as in one process).

Refused, by name, before the first step: what :class:`~.rl_mixin.UlyssesRLMixin`
refuses; with ``sp_size > 1`` ``tools`` / ``environment_factory`` (tool calls run
inside generation, on each rank's rows) and a batch of rows per data-parallel rank
not divisible by ``sp_size``; vision-language processors.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import UlyssesArguments
from ulysses_dtensor.integrations.hf.ulysses_trainer.batches import check_same_batch
from ulysses_dtensor.integrations.hf.ulysses_trainer.refusals import UlyssesTrainerError

from .policy_copy import named_full_weights, unsharded_policy
from .rl_mixin import UlyssesRLMixin
from .rollouts import (
    data_parallel_view,
    fit_generation_batch,
    gather_rows,
    make_rank_views,
    share,
    sync_rng,
    world_view,
)

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - the trl extra is absent
    raise ImportError("UlyssesGRPOTrainer needs TRL: pip install 'ulysses-dtensor[trl]'") from e

__all__ = ["UlyssesGRPOTrainer"]

# Model inputs of vision-language models TRL passes to the log-probability call.
_VISION_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                  "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _join_lists(parts: dict, group) -> defaultdict:
    """A dict of per-row (or per-call) lists, each sp rank's entries joined in rank order."""
    joined = defaultdict(list)
    for ranks in gather_rows([dict(parts)], group):
        for key, values in ranks.items():
            joined[key].extend(values)
    return joined


class UlyssesGRPOTrainer(UlyssesRLMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with Ulysses SP, FSDP2 / HSDP and the memory switches
    (``ulysses_args=UlyssesArguments(...)``); see the module doc for what differs."""

    trl_class = GRPOTrainer
    version_checks = UlyssesRLMixin.version_checks + (("trl", "GRPOTrainer"),)

    def __init__(self, model, reward_funcs=None, args=None, *rest, ulysses_args: UlyssesArguments | None = None,
                 **kwargs):
        self.check_versions()  # before the batch sizes are fitted to TRL's config
        ulysses_args = UlyssesArguments() if ulysses_args is None else ulysses_args
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        if isinstance(ulysses_args, UlyssesArguments):  # the mixin names a wrong type
            for name in ("tools", "environment_factory"):
                if kwargs.get(name) and ulysses_args.sp_size > 1:
                    raise UlyssesTrainerError(
                        f"{name}= is not supported by UlyssesGRPOTrainer with sp_size > 1: tool calls run inside "
                        "generation on each rank's rows, which the sp ranks of a group split among themselves")
            fit_generation_batch(args, ulysses_args)
        self._router_logits_as_trl_asks(model, args)
        super().__init__(model, reward_funcs, args, *rest, ulysses_args=ulysses_args, **kwargs)
        self._finish_setup()
        make_rank_views(self.accelerator)
        from accelerate.utils import set_seed

        # The sp ranks of a group draw alike (TRL seeds each process apart).
        set_seed(self.args.seed + self.pmesh.dp_rank)
        for i, func in enumerate(self.reward_funcs):  # reward models: on this rank's device, whole
            if hasattr(func, "to") and hasattr(func, "parameters"):
                self.reward_funcs[i] = func.to(self.args.device)
        if self.use_vllm:
            self.send_full_weights(self.vllm_generation)

    def send_full_weights(self, vllm_generation) -> None:
        """Make TRL's vLLM weight sync (server and colocate) send the policy's full weights,
        LoRA merged, under the checkpoint's names: TRL reads each parameter as it is, which
        here is a shard."""
        vllm_generation._iter_named_params = lambda: named_full_weights(
            self.model, self._sp_model, dtype=self._generation_dtype(), device=self.args.device)

    def check_arguments(self) -> None:
        super().check_arguments()
        if getattr(self, "_is_vlm", False):
            raise UlyssesTrainerError("a vision-language processor is not supported by UlyssesGRPOTrainer: the model's text "
                             "path runs on a slice of the sequence, and images would have to be split with it")

    def _logprob_temperature(self) -> float:
        return float(self.temperature)

    # -- rollouts ---------------------------------------------------------------------------

    def _sp_group(self):
        return self.pmesh.sp.get_group() if self.pmesh.dims.sp > 1 else None

    @contextlib.contextmanager
    def _generation_model(self):
        """transformers' generation (TRL's own path): on an unsharded copy of the policy."""
        if self.use_vllm or self.rollout_func is not None:
            yield
            return
        saved = self.model_wrapped
        self.model_wrapped = unsharded_policy(self.model, self._sp_model, attn_implementation=self._generation_attn,
                                              dtype=self._generation_dtype(), device=self.args.device)
        try:
            yield
        finally:
            self.model_wrapped = saved

    def _generate(self, prompts: list):
        sp, group = self.pmesh.dims.sp, self._sp_group()
        # Each sp rank samples its share from a stream of its own (drawn alike on the group's ranks).
        seed = int(torch.randint(0, 2**31 - 1 - sp, ()))
        devices = [torch.cuda.current_device()] if self.args.device.type == "cuda" else []
        with world_view(self.accelerator), self._generation_model(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + self.pmesh.sp_rank)
            out = super()._generate(share(prompts, self.pmesh.sp_rank, sp))
        if group is not None:
            out = gather_rows(out, group)
            sync_rng(group)  # TRL shuffles the rows next: alike on every sp rank
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        sp, rank, group = self.pmesh.dims.sp, self.pmesh.sp_rank, self._sp_group()
        with world_view(self.accelerator):
            rewards = super()._calculate_rewards(*(share(x, rank, sp) for x in (inputs, prompts, completions,
                                                                                 completion_ids_list)))
        if group is not None:  # what reward functions logged about their share: the group's whole
            self._pending_extra_logs = _join_lists(self._pending_extra_logs, group)
            self._pending_metrics = _join_lists(self._pending_metrics, group)
        return rewards

    def _generate_and_score_completions(self, inputs):
        with data_parallel_view(self.accelerator):
            return super()._generate_and_score_completions(inputs)

    # -- the loss ---------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **inputs):
        given = [k for k in _VISION_INPUTS if inputs.get(k) is not None]
        if given:
            raise UlyssesTrainerError(f"UlyssesGRPOTrainer runs the model's text path under SP; got {given[0]}=...")
        call = self.sp_call(model, ("log_probs", "entropy") if compute_entropy else ("log_probs",))
        return super()._get_per_token_logps_and_entropies(call, input_ids, attention_mask, logits_to_keep,
                                                          batch_size, compute_entropy, compute_aux_loss, **inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.ulysses_args.check_batches and self.pmesh.dims.sp > 1:
            rows = {k: inputs[k] for k in ("prompt_ids", "completion_ids", "completion_mask")}
            rows["advantages"] = inputs["advantages"].float().reshape(-1).view(torch.int32)  # bit for bit
            check_same_batch(rows, self.pmesh.sp.get_group(), self.pmesh.dims.sp)
        with data_parallel_view(self.accelerator):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
