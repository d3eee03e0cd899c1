"""``UlyssesHFTrainer``: transformers' ``Trainer`` under this package's Ulysses SP, FSDP2 and memory
switches, configured by ``UlyssesArguments`` (the ``trl`` extra adds TRL's SFTTrainer,
:mod:`ulysses_dtensor.integrations.trl`). One module per seam of the Trainer:

* :mod:`.arguments`: ``UlyssesArguments``, the TrainingArguments taken over and those refused;
* :mod:`.accelerator`: the Trainer's accelerator over data-parallel ranks (data, gathering);
* :mod:`.batches`: a collated batch -> the sp slice's inputs, and predictions back whole;
* :mod:`.checkpoints`: ``save_model`` / checkpoints / resuming, shard by shard;
* :mod:`.refusals`: ``UlyssesTrainerError``, what the trainer refuses: one line per node when
  the script does not catch it;
* :mod:`.mixin`: ``UlyssesTrainerMixin`` (the change itself) and ``UlyssesHFTrainer``.

Names load lazily: ``UlyssesArguments`` alone does not import transformers' Trainer.
"""

import warnings
from importlib import import_module

_EXPORTS = {"UlyssesArguments": "arguments", "UlyssesHFTrainer": "mixin", "UlyssesTrainerError": "refusals",
            "UlyssesTrainerMixin": "mixin"}

# Renamed (issue 53): two different classes were both UlyssesTrainer.
_RENAMED = {"UlyssesTrainer": "UlyssesHFTrainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _RENAMED:  # the old name, for one release
        warnings.warn(f"{__name__}.{name} is deprecated: use {_RENAMED[name]} (the same class)",
                      DeprecationWarning, stacklevel=2)
        name = _RENAMED[name]
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
