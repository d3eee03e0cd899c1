"""Our local attention backends as a torchtitan inner-attention module, and the override that installs it.

torchtitan's attention calls ``inner_attention(q, k, v, attention_masks=...,
scale=..., enable_gqa=...)`` with q, k, v ``(B, L, heads, head_dim)`` after
rope. Under Ulysses that module sees the FULL sequence for ``heads / sp``
heads, so any single-rank kernel works there. torchtitan 0.3.0 ships SDPA
(causal only, no document masks), Flex and Varlen; :class:`UlyssesInnerAttention`
adds ours: ``sdpa`` with document masks (CPU and GPU), the flash-attn package,
torch varlen and flex, all taking packed documents as GLOBAL document ids in
``attention_masks`` (built by :mod:`.sp_batch` from the unsharded positions).

The swap is a torchtitan override (``config/override.py``): listing
``ulysses_dtensor.integrations.torchtitan.attention.ulysses_inner_attention``
in ``--override.imports`` (with ``{"backend": ...}``) replaces the inner
attention of every attention config (GQA: llama3, qwen3; MLA: deepseek_v3).
The replaced config keeps the sharding config torchtitan declared on the inner
attention (its ``local_map`` under tensor parallelism: q, k, v arrive as the
local heads of a tp rank). :class:`~.trainer.UlyssesTorchtitanTrainer` activates it from
``ulysses.attention_backend``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor
from torchtitan.config.override import override
from torchtitan.models.common.attention import BaseAttention
from torchtitan.protocols.module import Module

from ulysses_dtensor.attention import check_backend, local_attention

__all__ = ["OVERRIDE_TARGET", "UlyssesInnerAttention", "ulysses_inner_attention"]


class UlyssesInnerAttention(Module):
    """Causal attention over the local sequence with one of our backends.

    ``attention_masks`` is ``None`` (one document per row) or the ``(B, S)``
    integer document ids of the whole (padded) sequence: the same tensor on
    every sp rank, since after the all-to-all every rank holds every token.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: str = "auto"
        """auto, sdpa, flex, varlen or flash_attn (see ulysses_dtensor.attention)."""

        def __post_init__(self):
            check_backend(self.backend)

    def __init__(self, config: Config):
        super().__init__()
        self.backend = check_backend(config.backend)

    # torchtitan's argument names: its sharding configs (local_map) key on them.
    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,  # implied by the head counts
        **kwargs,
    ) -> Tensor:
        if attention_masks is not None and not isinstance(attention_masks, Tensor):
            raise TypeError(
                "UlyssesInnerAttention takes attention_masks as (batch, seq) document ids "
                f"(ulysses_dtensor.integrations.torchtitan.sp_batch builds them), got "
                f"{type(attention_masks).__name__}"
            )
        return local_attention(
            q_BLNH, k_BLNH, v_BLNH, backend=self.backend, causal=True, document_ids=attention_masks, scale=scale
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}"


@override(
    target=BaseAttention.Config,
    description="ulysses_dtensor: our local attention backends as the inner attention",
)
def ulysses_inner_attention(cfg: BaseAttention.Config, *, backend: str = "auto") -> BaseAttention.Config:
    # torchtitan sets sharding configs before overrides run: keep the inner attention's.
    sharding = cfg.inner_attention.sharding_config
    return dataclasses.replace(cfg, inner_attention=UlyssesInnerAttention.Config(backend=backend, sharding_config=sharding))


OVERRIDE_TARGET = f"{ulysses_inner_attention.__module__}.{ulysses_inner_attention.__name__}"
