"""Model definitions. Import the module you need, e.g. ``ulysses_dtensor.models.llama``."""

from .llama import FLAVORS, Llama, LlamaArgs, llama_args

__all__ = ["FLAVORS", "Llama", "LlamaArgs", "llama_args"]
