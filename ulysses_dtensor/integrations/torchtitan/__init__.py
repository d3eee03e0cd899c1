"""Ulysses sequence parallelism inside torchtitan 0.3.0: its own models, trainer and configs.

Launch (torchtitan looks up ``<module>.config_registry``)::

    torchrun --nproc_per_node=8 -m torchtitan.train \\
        --module ulysses_dtensor.integrations.torchtitan --config llama3_8b_ulysses

Pieces, each on one of torchtitan's extension points:

* :mod:`.config_registry`: torchtitan's stock llama3 / qwen3 / qwen3 MoE /
  deepseek_v3 configs with Ulysses switched on (``ulysses.degree``,
  ``ulysses.attention_backend``);
* :mod:`.trainer`: ``UlyssesTorchtitanTrainer`` (a ``Trainer`` subclass with its
  ``Config``), ``UlyssesValidator``;
* :mod:`.metrics_processor`: ``UlyssesMetricsProcessor`` (torchtitan's, with the max
  loss taken over whole samples, not sp slices);
* :mod:`.parallelize`: the ``ModelSpec.parallelize_fn`` (our ``UlyssesAttention``
  inside ``layers.*.attention.inner_attention``, then torchtitan's TP / EP, AC,
  compile, FSDP2; its pipeline split calls it per stage);
* :mod:`.attention`: our local backends as an inner-attention module, installed
  by a torchtitan override;
* :mod:`.sp_batch`: the sp slice of a batch with global positions and masks.

The version is checked here, before anything imports torchtitan.
"""

import warnings
from importlib import import_module

from ._requirements import require_torchtitan

require_torchtitan()

_EXPORTS = {
    "UlyssesConfig": ".trainer",
    "UlyssesTorchtitanTrainer": ".trainer",
    "UlyssesValidator": ".trainer",
    "UlyssesMetricsProcessor": ".metrics_processor",
    "UlyssesInnerAttention": ".attention",
    "parallelize_ulysses": ".parallelize",
    "ulysses_model_spec": ".parallelize",
    "shard_for_sp": ".sp_batch",
    "ulysses_config": ".config_registry",
}

# Renamed (issue 53): two different classes were both UlyssesTrainer.
_RENAMED = {"UlyssesTrainer": "UlyssesTorchtitanTrainer"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _RENAMED:  # the old name, for one release
        warnings.warn(f"{__name__}.{name} is deprecated: use {_RENAMED[name]} (the same class)",
                      DeprecationWarning, stacklevel=2)
        name = _RENAMED[name]
    # Lazy: importing torchtitan costs seconds; the version check above does not.
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
