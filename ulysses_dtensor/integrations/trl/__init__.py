"""TRL's trainers under this package's Ulysses SP, FSDP2 and memory switches (the ``trl`` extra).

* :mod:`.sft_trainer`: ``UlyssesSFTTrainer``, TRL's ``SFTTrainer`` with
  :class:`~ulysses_dtensor.integrations.hf.UlyssesTrainerMixin` (packing, padding-free
  batches, completion-only and assistant-only losses, peft LoRA).

    from ulysses_dtensor.integrations.trl import UlyssesSFTTrainer
"""

from importlib import import_module

_EXPORTS = {"UlyssesSFTTrainer": "sft_trainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
