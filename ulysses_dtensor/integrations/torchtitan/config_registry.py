"""Config functions for ``--module ulysses_dtensor.integrations.torchtitan --config <name>``.

Each is torchtitan's stock config of the same model with Ulysses switched on
(its tensor, pipeline and expert parallelism kept, e.g. Llama-3-70B's tp 8):
``UlyssesTorchtitanTrainer.Config`` with every stock field copied, ``ulysses.degree``
and ``ulysses.attention_backend`` set, the metrics processor whose max loss
is right under a sequence split, and the torchtitan settings our layout needs (``parallelism.spmd_backend='partial_dtensor'``, no
context-parallel load balancer, no CUDA graphs). Any field can still be changed on the
command line, e.g. ``--ulysses.degree 4 --training.seq_len 65536``.
"""

from __future__ import annotations

import dataclasses

from torchtitan.config.override import derive
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.models.qwen3 import config_registry as qwen3
from torchtitan.trainer import Trainer

from .metrics_processor import max_loss_config
from .trainer import UlyssesConfig, UlyssesTorchtitanTrainer, UlyssesValidator

__all__ = [
    "deepseek_v3_16b_ulysses",
    "deepseek_v3_debugmodel_ulysses",
    "llama3_70b_ulysses",
    "llama3_8b_ulysses",
    "llama3_debugmodel_ulysses",
    "qwen3_14b_ulysses",
    "qwen3_1_7b_ulysses",
    "qwen3_30b_a3b_ulysses",
    "qwen3_debugmodel_ulysses",
    "qwen3_moe_debug_ulysses",
    "ulysses_config",
]


def ulysses_config(
    base: Trainer.Config, *, degree: int, attention_backend: str = "auto"
) -> UlyssesTorchtitanTrainer.Config:
    """``base`` (any torchtitan ``Trainer.Config``) as a ``UlyssesTorchtitanTrainer.Config`` with Ulysses on."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    fields["parallelism"] = dataclasses.replace(
        base.parallelism, spmd_backend="partial_dtensor", context_parallel_load_balancer=None
    )
    fields["training"] = dataclasses.replace(base.training, disable_cuda_graphs=True)
    fields["validator"] = derive(base.validator, UlyssesValidator.Config)
    fields["metrics"] = max_loss_config(base.metrics)
    return UlyssesTorchtitanTrainer.Config(
        **fields, ulysses=UlyssesConfig(degree=degree, attention_backend=attention_backend)
    )


def llama3_debugmodel_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Llama-3 debug model (16 heads), sp 2."""
    return ulysses_config(llama3.llama3_debugmodel(), degree=2)


def llama3_8b_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Llama-3.1-8B (32 heads, 8 kv heads), sp 8: one node, every GPU on one sample."""
    return ulysses_config(llama3.llama3_8b(), degree=8)


def qwen3_debugmodel_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Qwen3 debug model (16 heads, 8 kv heads), sp 2."""
    return ulysses_config(qwen3.qwen3_debugmodel(), degree=2)


def qwen3_1_7b_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Qwen3-1.7B (16 heads, 8 kv heads), sp 8."""
    return ulysses_config(qwen3.qwen3_1_7b(), degree=8)


def qwen3_14b_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Qwen3-14B (40 heads, 8 kv heads), sp 8."""
    return ulysses_config(qwen3.qwen3_14b(), degree=8)


def llama3_70b_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Llama-3.1-70B (64 heads, 8 kv heads) with torchtitan's tp 8 inside a node, sp 4 across nodes:
    a tp rank's 8 heads and 1 kv head (replicated 4 times) over the sp ranks."""
    return ulysses_config(llama3.llama3_70b(), degree=4)


def qwen3_moe_debug_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Qwen3 MoE debug model (16 heads, 8 kv heads, 64 experts), sp 2; add expert parallelism with
    ``--parallelism.expert_parallel_degree``."""
    return ulysses_config(qwen3.qwen3_moe_debug(), degree=2)


def qwen3_30b_a3b_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """Qwen3-30B-A3B (32 heads, 4 kv heads, 128 experts), sp 8 x ep 8: the experts spread over the
    8 ranks of a sample."""
    base = qwen3.qwen3_30b_a3b()
    base.parallelism = dataclasses.replace(base.parallelism, expert_parallel_degree=8)
    return ulysses_config(base, degree=8)


def deepseek_v3_debugmodel_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """DeepSeek-V3 debug model (MLA, 16 heads, 8 experts), sp 2."""
    return ulysses_config(deepseek_v3.deepseek_v3_debugmodel(), degree=2)


def deepseek_v3_16b_ulysses() -> UlyssesTorchtitanTrainer.Config:
    """DeepSeek-V3-16B (MLA, 16 heads, 64 experts) with torchtitan's ep 8, sp 8."""
    return ulysses_config(deepseek_v3.deepseek_v3_16b(), degree=8)
