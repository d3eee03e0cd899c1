"""The family matrix: every causal-LM family of the installed transformers, measured
under Ulysses against its unsharded model.

* :mod:`.tiny_configs`: each family's category and a tiny, deterministic model of it;
* :mod:`.check`: the parity check of one family (loss and every gradient, counted
  collectives), also run at start for a family the matrix has not measured;
* :mod:`.runs`: the matrix run on a group of ranks (``scripts/family_matrix.py``);
* :mod:`.results` with ``results.json``: what was measured, per transformers version.
"""
