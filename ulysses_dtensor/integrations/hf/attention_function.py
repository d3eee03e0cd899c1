"""The Ulysses attention function that transformers' attention registry dispatches to.

A transformers attention module projects q, k, v, applies rope (and q/k norms)
on this rank's slice of the sequence, then calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v,
attention_mask, scaling=..., dropout=..., **kwargs)`` with q, k, v laid out
``(batch, heads, seq/sp, head_dim)``. Registered under :data:`ATTN_IMPLEMENTATION`,
:func:`ulysses_attention_forward` hands them to the module's
:class:`UlyssesCore`: a :class:`~ulysses_dtensor.parallel.ulysses.UlyssesAttention`-
parallelized local attention, which exchanges to ``heads/sp`` heads of the full
sequence, attends, and exchanges back.

transformers builds its attention mask from the tensors it sees, which under SP
are one slice of the sequence: wrong. So the model runs with no mask at all (an
implementation name absent from transformers' mask registry makes
``create_causal_mask`` and ``create_sliding_window_causal_mask`` return
``None``), and the pattern is made here from the global structure: causal,
packed documents from the full-sequence document ids that
:func:`~ulysses_dtensor.integrations.hf.shard_hf_batch` passes as the keyword
argument :data:`DOCUMENT_IDS_KWARG`, and what the model passes per layer --
``sliding_window`` (in global positions), ``softcap``, ``s_aux`` (sinks, split
with the heads by the exchange), ``scaling``. Anything else that shapes the
attention pattern is refused with the model class named, never dropped.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ulysses_dtensor.attention import FEATURES, AttentionCall, check_backend, local_attention
from ulysses_dtensor.attention.select import SUPPORTS
from ulysses_dtensor.runtime.regions import in_region

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DOCUMENT_IDS_KWARG",
    "CallState",
    "call_document_ids",
    "UlyssesCore",
    "check_backend_for_patterns",
    "model_patterns",
    "recording_patterns",
    "ulysses_attention_forward",
]

# The key in transformers' AttentionInterface (and config._attn_implementation).
ATTN_IMPLEMENTATION = "ulysses_sp"
# Model keyword argument carrying the (batch, padded_seq) document ids of the
# WHOLE sequence; transformers passes unknown keywords down to attention.
DOCUMENT_IDS_KWARG = "sp_document_ids"

# Keyword arguments transformers attention functions may receive that would
# change the attention pattern or numerics in ways this function does not
# implement. Present and not None -> error.
_REFUSED_KWARGS = {
    "cu_seq_lens_q": "transformers' own packed-sequence metadata (use shard_hf_batch's document ids)",
    "cu_seq_lens_k": "transformers' own packed-sequence metadata (use shard_hf_batch's document ids)",
    "position_bias": "an additive position bias",
}


class CallState:
    """What the model's pre-hook learns from one call, for its layers and post-hooks: the
    unpadded sequence length and the whole sequence's document ids. The top-level forward
    is never compiled or recomputed, so per-call state is safe here.

    Layers read the document ids from here when the model does not pass its keyword
    arguments down to them (Nemotron's decoder drops them): without the ids, packed
    documents would silently attend to each other. (A layer recomputed by activation
    checkpointing reads them in backward: the same call's, as long as each forward's
    backward runs before the next forward, as in every training loop here.)"""

    seq_len: int | None = None
    document_ids: Tensor | None = None


def call_document_ids(kwargs: dict, call: CallState | None) -> Tensor | None:
    """The whole sequence's document ids of this call: passed down by the model, or from its pre-hook."""
    documents = kwargs.get(DOCUMENT_IDS_KWARG)
    if documents is None and call is not None:
        documents = call.document_ids
    return documents


# The patterns calls passed while :func:`recording_patterns` is active (the family
# matrix records what each family really passes), else None.
_SEEN: set | None = None


class recording_patterns:
    """Collect, as a set of names (``window``, ``softcap``, ``sinks``), the patterns the
    model's layers pass to Ulysses attention inside the ``with`` block (eager calls)."""

    def __enter__(self) -> set:
        global _SEEN
        self.saved, _SEEN = _SEEN, set()
        return _SEEN

    def __exit__(self, *exc) -> None:
        global _SEEN
        _SEEN = self.saved


def model_patterns(text_config, attentions: list[nn.Module]) -> dict:
    """The patterns a model's layers will pass to attention, read off its config
    and attention modules: {feature: value}."""
    found = {}
    if getattr(text_config, "sliding_window", None) is not None:
        found["window"] = text_config.sliding_window
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        found["softcap"] = text_config.attn_logit_softcapping
    sinks = [a.sinks for a in attentions if isinstance(getattr(a, "sinks", None), nn.Parameter)]
    if sinks:
        found["sinks"] = f"a ({sinks[0].shape[0]},) parameter per layer"
    return found


def check_backend_for_patterns(name: str, backend: str, patterns: dict) -> None:
    """Refuse, before anything runs, a named backend whose kernel cannot express a model's pattern."""
    if backend == "auto":
        return  # auto picks a kernel that can, per call
    missing = [f for f in patterns if f not in SUPPORTS[backend]]
    if missing:
        able = [b for b in SUPPORTS if set(patterns) <= SUPPORTS[b]]
        raise ValueError(
            f"{name}: attention backend {backend!r} cannot apply {FEATURES[missing[0]]} "
            f"({missing[0]}={patterns[missing[0]]}), which this model uses; backends that can: "
            f"{', '.join(['auto', *able])}"
        )


class UlyssesCore(nn.Module):
    """Attention over the full sequence for ``heads/sp`` heads: what runs between
    the two all-to-alls. Parameter-free; ``parallelize_hf_model`` attaches one,
    parallelized with ``UlyssesAttention`` on the ulysses mesh, to each attention
    module as ``.ulysses``. The pattern arrives per call (it differs per layer:
    Gemma3 mixes sliding and full layers); ``sinks`` are the model's per-head
    logits, of which the exchange hands each rank its heads' block.

    With a ring mesh (USP, ``ring > 1``) a rank holds ``S/ring`` tokens of its
    heads after the exchange, and ring attention runs over the ring ranks
    (plain causal attention with packed documents: ``parallelize_hf_model``
    refuses the patterns the ring does not implement before anything runs).
    """

    def __init__(self, backend: str, model_name: str, sp: int, ring_mesh=None, call: CallState | None = None):
        super().__init__()
        self.call = call
        self.backend = check_backend(backend)
        self.model_name = model_name
        self.sp = sp
        self.ring_mesh = ring_mesh if ring_mesh is not None and ring_mesh.size() > 1 else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, document_ids: Tensor | None = None,
                scale: float | None = None, window: int | None = None, softcap: float | None = None,
                sinks: Tensor | None = None) -> Tensor:
        if self.ring_mesh is not None:
            return _ring_core(q, k, v, self.ring_mesh, document_ids, scale, window, softcap, sinks)
        return local_attention(q, k, v, backend=self.backend, causal=True, document_ids=document_ids, scale=scale,
                               window=window, softcap=softcap, sinks=sinks)

    def call_spec(self, document_ids: Tensor | None = None, scale: float | None = None, window: int | None = None,
                  softcap: float | None = None):
        """What ``forward`` computes but for its tensors: what head chunks run split into
        forward and backward (:mod:`ulysses_dtensor.parallel.head_chunk_kernels`)."""
        if self.ring_mesh is not None:
            from ulysses_dtensor.parallel.head_chunk_kernels import RingCall
            from ulysses_dtensor.parallel.ring import refused_pattern

            for name, value in (("window", window), ("softcap", softcap)):
                if value is not None:  # parallelize_hf_model refuses these models; a defence in depth
                    raise ValueError(refused_pattern(name, value))
            return RingCall(self.ring_mesh, True, scale, True, document_ids)
        return AttentionCall(self.backend, True, scale, window, softcap, document_ids)

    def extra_repr(self) -> str:
        ring = f", ring={self.ring_mesh.size()}" if self.ring_mesh is not None else ""
        return f"backend={self.backend!r}, sp={self.sp}{ring}"


def _ring_core(q, k, v, mesh, document_ids, scale, window, softcap, sinks) -> Tensor:
    """Ring attention of this rank's block. The ring's kernels take k and v of one
    head dim: MLA's narrower v is padded with zeros and the output cropped (the
    scores, hence the softmax, do not see v), a narrower q/k padded with zeros
    (scores unchanged; the scale is the model's own, passed explicitly)."""
    from ulysses_dtensor.parallel.ring import refused_pattern, ring_attention

    for name, value in (("window", window), ("softcap", softcap), ("sinks", sinks)):
        if value is not None:  # parallelize_hf_model refuses these models; a defence in depth
            raise ValueError(refused_pattern(name, value if name != "sinks" else f"a ({value.shape[0]},) tensor"))
    dk, dv = q.shape[-1], v.shape[-1]
    if dv < dk:
        v = F.pad(v, (0, dk - dv))
    elif dk < dv:
        scale = dk ** -0.5 if scale is None else scale
        q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
    out = ring_attention(q, k, v, mesh, causal=True, document_ids=document_ids, scale=scale)
    return out[..., :dv] if dv < dk else out


@in_region("hf.attention")
def ulysses_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention-function signature; returns ``(B, seq/sp, heads, head_dim)``, no weights."""
    core = getattr(module, "ulysses", None)
    if not isinstance(core, UlyssesCore):
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} was called from {type(module).__name__}, "
            "which parallelize_hf_model did not set up; call parallelize_hf_model(model, pmesh) on the "
            "whole model instead of setting the implementation by hand"
        )
    name = core.model_name
    if attention_mask is not None:
        raise ValueError(
            f"{name}: an attention mask reached Ulysses attention, but a mask built for this rank's "
            "slice is wrong under sequence parallelism; pass no attention_mask and describe packed "
            "documents with position_ids (shard_hf_batch does this)"
        )
    if dropout:
        raise ValueError(
            f"{name}: attention dropout={dropout} is not implemented by Ulysses attention; set "
            "config.attention_dropout=0.0"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"{name}: keys cover {key.shape[2]} positions but queries {query.shape[2]}: a KV cache "
            "(generation) is not supported under Ulysses SP; call the model with use_cache=False"
        )
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{name}: non-causal attention in {type(module).__name__} is not supported")
    for kw, what in _REFUSED_KWARGS.items():
        if kwargs.get(kw) is not None:
            raise ValueError(f"{name}: {what} ({kw}=...) is not supported by Ulysses attention")
    document_ids = call_document_ids(kwargs, core.call)
    window = kwargs.get("sliding_window")
    seq = document_ids.shape[1] if document_ids is not None else query.shape[2] * core.sp
    if window is not None and window >= seq:
        window = None  # every key of the sequence is in the window: plain causal
    if _SEEN is not None:
        _SEEN.update(k for k, v in (("window", window), ("softcap", kwargs.get("softcap")),
                                    ("sinks", kwargs.get("s_aux"))) if v is not None)
    # (B, H, s, D) -> (B, s, H, D), the layout the exchange and local backends use.
    out = core(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        document_ids=document_ids, scale=scaling, window=window, softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    # Contiguous, as transformers' own functions return it: some families .view() it (AFMoE,
    # Dory), which the exchange's output (strided at sp 4) would fail.
    return out.contiguous(), None
