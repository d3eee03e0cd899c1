"""Token mixers besides attention in transformers' hybrid models, under Ulysses.

* :mod:`.layer_types`: which layer types mix tokens how, and the checks that refuse
  the layer types nothing here runs;
* :mod:`.style`: the ``ParallelStyle`` that installs a mixer's exchange;
* :mod:`.gated_delta_net` (Qwen3-Next, Qwen3.5), :mod:`.mamba` (Mamba-2 and Mamba
  hybrids), :mod:`.short_conv` (LFM2): each layer's exchange around the whole-sequence
  computation of :mod:`ulysses_dtensor.mixers`.
"""
