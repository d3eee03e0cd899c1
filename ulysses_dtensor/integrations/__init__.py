"""Ulysses SP for models from other libraries, through their own extension points.

* ``integrations.hf``: unmodified Hugging Face ``transformers`` causal LMs (the
  ``hf`` extra), hybrids with gated delta-net layers included
  (``integrations.hf_linear_attention``); ``hf_weights`` loads their checkpoints shard by
  shard in any layout transformers converts, ``hf_causal_lm`` gives them the trainer's
  call interface (``model.implementation = "transformers"``);
* ``integrations.lora``: ``peft``'s LoRA adapters on a model about to be parallelized
  (transformers' or this package's Llama; the ``lora`` extra);
* ``integrations.torchtitan``: a plug-in for torchtitan 0.3.0's own models and
  trainer (the ``torchtitan`` extra; ``--module ulysses_dtensor.integrations.torchtitan``).

Import the submodule you need; nothing is imported here.
"""
