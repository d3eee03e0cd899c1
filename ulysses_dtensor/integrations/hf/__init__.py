"""Ulysses SP for unmodified Hugging Face ``transformers`` causal LMs (the ``hf`` extra).

The public face, importable from here as the docs show it::

    from ulysses_dtensor.integrations.hf import parallelize_hf_model, shard_hf_batch
    from ulysses_dtensor.integrations.hf import load_hf_weights, save_hf_weights
    from ulysses_dtensor.integrations.hf import UlyssesArguments, UlyssesHFTrainer

What each module owns, in the order a model meets them:

* :mod:`.parallelize_model`: ``parallelize_hf_model`` (Ulysses, AC, compile, FSDP2, memory
  switches, ring and tp) and the checks that refuse what cannot run;
* :mod:`.families`: which family a model is and what the family matrix measured for it;
* :mod:`.attention_function`: the Ulysses function in transformers' attention registry;
* :mod:`.model_inputs`, :mod:`.positions`: a batch's sp slice with global positions and
  document ids (multimodal rope positions included);
* :mod:`.rotary`: rope from ``config.rope_parameters``, and a context stage's rope swapped in;
* :mod:`.moe`: routers' auxiliary loss under SP;
* :mod:`.memory_switches`: tiled MLP, norms and offloaded blocks on transformers' layers;
* :mod:`.causal_lm`, :mod:`.output_head`: the trainer's call interface and the tiled head;
* :mod:`.weights`, :mod:`.checkpoint_io`: HF directories in and out, shard by shard;
* ``ulysses_trainer/``: ``UlyssesHFTrainer`` / ``UlyssesTrainerMixin`` and ``UlyssesArguments``:
  transformers' ``Trainer`` under all of the above (``UlyssesTrainerError``: what it refuses);
* ``mixers/``: token mixers besides attention (gated delta-net, Mamba, short convolution);
* ``matrix/``: the family matrix (tiny model per family, the parity check, the recorded
  results for the installed transformers).

Names load lazily: importing this package imports transformers only when a name is used.
"""

import warnings
from importlib import import_module

_EXPORTS = {
    "parallelize_hf_model": "parallelize_model",
    "register_ulysses_attention": "parallelize_model",
    "check_ring_model": "parallelize_model",
    "check_tp_model": "parallelize_model",
    "ATTN_IMPLEMENTATION": "attention_function",
    "DOCUMENT_IDS_KWARG": "attention_function",
    "SEQ_LEN_KWARG": "model_inputs",
    "shard_hf_batch": "model_inputs",
    "load_hf_weights": "checkpoint_io",
    "save_hf_weights": "checkpoint_io",
    "adapt_causal_lm": "causal_lm",
    "UlyssesArguments": "ulysses_trainer.arguments",
    "UlyssesHFTrainer": "ulysses_trainer.mixin",
    "UlyssesTrainerError": "ulysses_trainer.refusals",
    "UlyssesTrainerMixin": "ulysses_trainer.mixin",
}

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
