"""Ulysses SP for models from other libraries, through their own extension points.
One folder or module per library:

* ``integrations.hf``: unmodified Hugging Face ``transformers`` causal LMs (the ``hf``
  extra): the parallelize entry, the registry attention function, batches and positions,
  rope, MoE, memory switches, the trainer's causal-LM adapter, weights in and out, the
  hybrid layers' token mixers (``hf/mixers/``), the family matrix (``hf/matrix/``) and
  transformers' ``Trainer`` under all of it (``hf/ulysses_trainer/``);
* ``integrations.trl``: TRL's ``SFTTrainer`` on top of ``integrations.hf``'s ``UlyssesTrainerMixin``
  (the ``trl`` extra);
* ``integrations.lora``: ``peft``'s LoRA adapters on a model about to be parallelized
  (transformers' or this package's Llama; the ``lora`` extra);
* ``integrations.torchtitan``: a plug-in for torchtitan 0.3.0's own models and
  trainer (the ``torchtitan`` extra; ``--module ulysses_dtensor.integrations.torchtitan``).
* ``integrations.versions``: the library versions the parity tests ran and the private
  members each integration relies on, checked where it starts (a warning for another
  version, a refusal naming a member it lacks).

Import the submodule you need; nothing is imported here.
"""
