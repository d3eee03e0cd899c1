"""``UlyssesTrainer``: transformers' ``Trainer`` under this package's Ulysses SP, FSDP2 and memory
switches, configured by ``UlyssesArguments`` (the ``trl`` extra adds TRL's SFTTrainer,
:mod:`ulysses_dtensor.integrations.trl`). One module per seam of the Trainer:

* :mod:`.arguments`: ``UlyssesArguments``, the TrainingArguments taken over and those refused;
* :mod:`.accelerator`: the Trainer's accelerator over data-parallel ranks (data, gathering);
* :mod:`.batches`: a collated batch -> the sp slice's inputs, and predictions back whole;
* :mod:`.checkpoints`: ``save_model`` / checkpoints / resuming, shard by shard;
* :mod:`.refusals`: ``UlyssesTrainerError``, what the trainer refuses: one line per node when
  the script does not catch it;
* :mod:`.mixin`: ``UlyssesTrainerMixin`` (the change itself) and ``UlyssesTrainer``.

Names load lazily: ``UlyssesArguments`` alone does not import transformers' Trainer.
"""

from importlib import import_module

_EXPORTS = {"UlyssesArguments": "arguments", "UlyssesTrainer": "mixin", "UlyssesTrainerError": "refusals",
            "UlyssesTrainerMixin": "mixin"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
