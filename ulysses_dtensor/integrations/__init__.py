"""Ulysses SP for models from other libraries, through their own extension points.

``integrations.hf``: unmodified Hugging Face ``transformers`` causal LMs
(needs the ``hf`` extra). Import the submodule; nothing is imported here.
"""
