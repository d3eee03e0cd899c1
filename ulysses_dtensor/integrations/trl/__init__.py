"""TRL's trainers under this package's Ulysses SP, FSDP2 and memory switches (the ``trl`` extra).

* :mod:`.sft_trainer`: ``UlyssesSFTTrainer``, TRL's ``SFTTrainer`` with
  :class:`~ulysses_dtensor.integrations.hf.UlyssesTrainerMixin` (packing, padding-free
  batches, completion-only and assistant-only losses, peft LoRA);
* :mod:`.grpo_trainer`: ``UlyssesGRPOTrainer`` (TRL's GRPO: generation, ``rollout_func``,
  vLLM, rewards, every loss type, on whole sequences); :mod:`.dpo_trainer`:
  ``UlyssesDPOTrainer`` (every DPO loss type, the reference on the fly or precomputed);
  both on :mod:`.rl_mixin` (the reference sharded like the policy, the loss scaled over
  the data-parallel ranks) and :mod:`.sp_logprobs` (TRL's per-token log-probability
  call under SP); GRPO's rollouts: :mod:`.rollouts` (who generates and scores which
  rows) and :mod:`.policy_copy` (the full weights for generation and vLLM).

    from ulysses_dtensor.integrations.trl import UlyssesSFTTrainer, UlyssesGRPOTrainer, UlyssesDPOTrainer
"""

from importlib import import_module

_EXPORTS = {"UlyssesSFTTrainer": "sft_trainer", "UlyssesGRPOTrainer": "grpo_trainer",
            "UlyssesDPOTrainer": "dpo_trainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
