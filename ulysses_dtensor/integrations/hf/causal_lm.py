"""A parallelized transformers causal LM with the interface of this package's Llama.

The trainer, its ``train_step``, the evaluator and the memory planner call a
model as they call :class:`~ulysses_dtensor.models.llama.Llama`::

    loss  = model(ids, position_ids=, document_ids=, labels=, num_valid_tokens=, seq_len=)
    logit = model(ids, position_ids=, document_ids=)
    h     = model.hidden_states(ids, position_ids=, document_ids=)   # final normed states
    logit = model.output(h)                 # the head; model.output.weight: (vocab, dim)
    model.flops_per_token(seq_len), model.args (sizes), model.num_params()
    model.rope, model.set_rope(rope), model.rope_seq_len   # context stages change the rope

:func:`adapt_causal_lm` gives a transformers model (usually after
:func:`~.hf.parallelize_hf_model`) exactly that, in place: its class becomes a
subclass with these methods (FSDP does the same to install its own), so the
parameter names stay the checkpoint's. transformers' own forward stays
``transformers_class(model).forward``; calling the model means the trainer's.

* The decoder is the model's own (``model.<base_model_prefix>``), called with
  this rank's slice, GLOBAL position ids and the whole sequence's document ids
  (:data:`~.hf_attention.DOCUMENT_IDS_KWARG`).
* The head is ``lm_head`` with the logit transforms its class applies, proven
  on the class (:mod:`.output_head`). With labels, ``lm_head``'s own forward
  returns this rank's share of the global token mean (``sp_cross_entropy``:
  local sum / ``num_valid_tokens``), in one piece or over sequence chunks.
* A call is a module call of the root and of ``lm_head``, as our Llama's: FSDP's
  hooks gather what each uses (and the memory planner's tracker sees them); the
  integration's input checks run first. ``hidden_states`` is registered as a
  forward method of the root, as our Llama's is.
* The rope: ``set_rope`` recomputes the rotary module's frequencies with
  transformers' own functions (:mod:`.rotary`); ``dynamic`` / ``longrope``
  take ``rope_seq_len`` (the trainer pins it to the step's global batch) or
  ``1 + max(position_ids)`` over every sp rank, never one rank's slice.
* MoE models with ``output_router_logits=True``: with labels, the loss share
  adds ``router_aux_loss_coef x`` this rank's share of the router
  load-balancing loss over the tokens of the call on EVERY rank
  (:func:`~.hf_moe.router_aux_loss_share`): summed over ranks, transformers'
  own loss of one unsharded forward over the whole global batch. With
  micro-batches each forward covers one micro-batch of every rank, and the
  trainer weights each by ``aux_loss_weight`` (1 / micro-batches): the step's
  aux is the mean over micro-batches. ``pop_router_aux_loss()`` gives this
  rank's share of that mean (for the metric).
* ``model(ids, ..., token_values=fn, router_aux=...)``: no loss but ``fn(hidden, head)``
  computed inside the head's call (per-token log-probabilities for policy-gradient
  and preference losses, :mod:`~ulysses_dtensor.memory.token_logprobs`), and the
  router loss share when asked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ulysses_dtensor.parallel.ring_layout import layout_position_ids

from .attention_function import DOCUMENT_IDS_KWARG
from .model_inputs import SEQ_LEN_KWARG
from .moe import router_aux_loss_share
from .output_head import OutputHead, SPOutputHead, _is_fake, check_output_head
from .rotary import rope_inv_freq, rope_support, set_rotary

__all__ = [
    "CausalLMShape",
    "SPCausalLM",
    "adapt_causal_lm",
    "auto_model_class",
    "causal_lm_shape",
    "freeze_vision_modules",
    "transformers_class",
    "vision_modules",
]


# ---------------------------------------------------------------------------
# Which class builds a config's model; the parts a text-only run leaves alone
# ---------------------------------------------------------------------------


def auto_model_class(config):
    """transformers' auto class that builds ``config``'s model with a language-model head:
    ``AutoModelForCausalLM``, or for a multimodal config (a text config of its own)
    that class has no entry for, ``AutoModelForImageTextToText`` (Qwen2.5-VL ->
    ``Qwen2_5_VLForConditionalGeneration``, the class its checkpoints name). ValueError
    naming the config class otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kind = type(config)
    if kind in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    multimodal = config.get_text_config() is not config
    if multimodal and kind in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    what = "a multimodal config with no image-text-to-text class" if multimodal else "no causal LM class"
    raise ValueError(f"Unrecognized configuration class {kind.__name__} for AutoModelForCausalLM "
                     f"(model_type={getattr(config, 'model_type', None)!r}): {what} in this transformers")


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """The top-level modules of a multimodal model outside its text decoder and head
    (Qwen2.5-VL: ``model.visual``); empty for a text-only model. A text-only run never
    calls them."""
    from .families import text_config_key

    if text_config_key(model) is None:
        return []
    text = {id(model.get_decoder()), id(model.get_output_embeddings())}
    out = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in text:
                continue
            if any(id(m) in text for m in child.modules()):
                walk(child)  # holds the decoder (Qwen2_5_VLModel): look inside
            else:
                out.append(child)

    walk(model)
    return out


def freeze_vision_modules(model: nn.Module) -> list[nn.Module]:
    """``requires_grad_(False)`` on :func:`vision_modules` (returned): they get no
    gradient from text, so the optimizer keeps no state for them, a checkpoint
    resumes with the same (empty) optimizer state, and the export writes their
    weights as loaded."""
    modules = vision_modules(model)
    for module in modules:
        module.requires_grad_(False)
    return modules


# ---------------------------------------------------------------------------
# Sizes (what model.args is for our Llama)
# ---------------------------------------------------------------------------

# config keys of the routed-expert count, in the order families spell it
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# a parameter of the routed experts (not of a shared expert): "...mlp.experts.gate_up_proj"
_EXPERT_PARAM = re.compile(r"(^|\.)experts\.")


@dataclass(frozen=True)
class CausalLMShape:
    """The sizes of a transformers causal LM that the trainer and the planner read
    (the role ``LlamaArgs`` plays for our Llama). Built from its config by
    :func:`causal_lm_shape`."""

    architecture: str
    model_type: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # as the exchange places them (MLA: one k and v per head)
    head_dim: int  # q/k width
    v_head_dim: int
    vocab_size: int
    ffn_dim: int  # the dense MLP's width (MoE: one expert's)
    tie_embeddings: bool
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    # per layer: None (full causal attention), a window, or -1 (no token mixing by
    # attention: linear attention / state-space layers, counted without attention FLOPs)
    attention_windows: tuple = field(default_factory=tuple)


def causal_lm_shape(config, architecture: str | None = None) -> CausalLMShape:
    """:class:`CausalLMShape` of a transformers config (the text config of a multimodal one)."""
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    dim = int(text.hidden_size)
    head_dim = int(getattr(text, "head_dim", None) or dim // heads)
    qk_dim = int(getattr(text, "qk_head_dim", None) or head_dim)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if getattr(text, "kv_lora_rank", None):
        kv_heads = heads  # MLA expands its latent into one k and v per head
    n_layers = int(text.num_hidden_layers)
    num_experts = next((int(getattr(text, k)) for k in _EXPERT_COUNT_KEYS if getattr(text, k, None)), 0)
    ffn = getattr(text, "moe_intermediate_size", None) if num_experts else None
    ffn = ffn or getattr(text, "intermediate_size", None) or 4 * dim
    types_ = list(getattr(text, "layer_types", None) or ["full_attention"] * n_layers)
    window = getattr(text, "sliding_window", None)
    windows = []
    for kind in types_[:n_layers]:
        if kind == "full_attention":
            windows.append(None)
        elif kind in ("sliding_attention", "chunked_attention"):
            windows.append(int(window) if window else None)
        else:
            windows.append(-1)
    return CausalLMShape(
        architecture=architecture or (list(getattr(config, "architectures", None) or []) or ["?"])[0],
        model_type=str(getattr(config, "model_type", "")),
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=qk_dim,
        v_head_dim=int(getattr(text, "v_head_dim", None) or head_dim),
        vocab_size=int(text.vocab_size),
        ffn_dim=int(ffn),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
        num_experts=num_experts,
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0) if num_experts else 0,
        attention_windows=tuple(windows),
    )


_LABELS, _COUNT = "sp_labels", "sp_num_valid_tokens"  # forward keywords, unknown to transformers' pre-hooks
_TOKEN_VALUES = "sp_token_values"


class SPCausalLM:
    """Mixed into an adapted model's class (see :func:`adapt_causal_lm`)."""

    def __call__(self, input_ids: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
                 *, labels: Tensor | None = None, num_valid_tokens: Tensor | int | None = None,
                 seq_len: int | Tensor | None = None, token_values=None, router_aux: bool = False):
        """Logits ``(B, s_local, vocab)`` of this rank's tokens, or with ``labels``
        (shifted, this rank's slice) its share of the global token-mean loss, as
        :meth:`~ulysses_dtensor.models.llama.Llama.forward`. A module call (hooks:
        the integration's input checks, FSDP's root) of :meth:`forward`. ``seq_len``:
        the unpadded length of the whole sequence when ``shard_hf_batch`` padded it
        (its ``sp_seq_len``), or a (batch,) tensor of each row's length (right-padded
        rows), so that MoE routers do not count the padding. ``token_values``: instead
        ``(token_values(hidden, head), router share or None)`` (see the module doc)."""
        if labels is not None and num_valid_tokens is None and token_values is None:
            raise ValueError(
                "labels given without num_valid_tokens: pass the valid-label count of the whole global "
                "batch (count_valid_tokens(labels, pmesh.loss)) so every rank divides by the same number"
            )
        kwargs = {} if document_ids is None else {DOCUMENT_IDS_KWARG: document_ids}
        if seq_len is not None:  # read and removed by the integration's pre-hook
            kwargs[SEQ_LEN_KWARG] = int(seq_len.max()) if isinstance(seq_len, Tensor) else seq_len
        self._sp_seq_len = seq_len  # the router loss leaves the padding out too
        if document_ids is None and position_ids is not None and _is_fake(position_ids):
            # The memory planner's fake rows: the integration's check that positions do not
            # restart would read values; its default (this rank's global positions) is theirs.
            position_ids = None
        if token_values is not None:  # per-token values (policy-gradient losses): no loss, no count
            kwargs[_TOKEN_VALUES] = (token_values, router_aux)
        else:
            kwargs.update({_LABELS: labels, _COUNT: num_valid_tokens})
        return nn.Module.__call__(self, input_ids=input_ids, position_ids=position_ids, **kwargs)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, **kwargs) -> Tensor:
        """The trainer's forward (transformers' own stays ``transformers_class(model).forward``);
        other keywords (from the integration's pre-hook) go to the decoder."""
        if _TOKEN_VALUES in kwargs:
            return self._token_values(input_ids, position_ids, *kwargs.pop(_TOKEN_VALUES), **kwargs)
        labels, count = kwargs.pop(_LABELS, None), kwargs.pop(_COUNT, None)
        router = labels is not None and self._router_aux is not None
        if router:
            kwargs["output_router_logits"] = True
        h = self._sp_hidden(input_ids, position_ids, kwargs.pop(DOCUMENT_IDS_KWARG, None), **kwargs)
        if labels is None:
            return self.output(h)
        if router:
            h, router_logits = h
        loss = self.output.loss(h, labels, count)
        if router:
            coef, experts, top_k, mesh = self._router_aux
            share = router_aux_loss_share(tuple(router_logits), experts, top_k, mesh,
                                          self._real_tokens(input_ids)) * self.aux_loss_weight
            self._router_aux_sum = self._router_aux_sum + share.detach()
            loss = loss + coef * share
        return loss

    def _token_values(self, input_ids: Tensor, position_ids: Tensor | None, fn, router_aux: bool, **kwargs):
        """``(fn(hidden, head), router share or None)``: ``fn`` runs inside the head's module
        call (FSDP's gathered weight) with this rank's final hidden states and the head
        (logit transforms included); with ``router_aux`` the share of the router loss over
        the whole global batch, unweighted and with its gradient."""
        router = router_aux and self._router_aux is not None
        if router:
            kwargs["output_router_logits"] = True
        h = self._sp_hidden(input_ids, position_ids, kwargs.pop(DOCUMENT_IDS_KWARG, None), **kwargs)
        share = None
        if router:
            h, router_logits = h
            _, experts, top_k, mesh = self._router_aux
            share = router_aux_loss_share(tuple(router_logits), experts, top_k, mesh, self._real_tokens(input_ids))
        return self.output.token_values(h, fn), share

    def _real_tokens(self, input_ids: Tensor) -> Tensor | None:
        """(batch * s_local,) False for this rank's padding tokens (past ``seq_len``, each row's
        own when it is a tensor); None: all real."""
        if self._sp_seq_len is None:
            return None
        b, s = input_ids.shape
        sp, sp_rank, ring = self._sp_degree
        where = layout_position_ids(s, sp_rank, sp, ring, input_ids.device)  # in the whole sequence
        length = self._sp_seq_len
        if isinstance(length, Tensor):
            return (where[None, :] < length.to(input_ids.device)[:, None]).reshape(-1)
        return (where < length).expand(b, s).reshape(-1)

    def pop_router_aux_loss(self) -> Tensor | None:
        """This rank's share of the router loss of the calls since the last pop (None
        without one); ``global_loss`` over ranks gives the value."""
        if self._router_aux is None:
            return None
        value, self._router_aux_sum = self._router_aux_sum, 0.0
        return torch.as_tensor(value, dtype=torch.float32)

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor | None = None,
                      document_ids: Tensor | None = None) -> Tensor:
        """The decoder's final normed hidden states ``(B, s_local, dim)``."""
        return self._sp_hidden(input_ids, position_ids, document_ids)

    def _sp_hidden(self, input_ids, position_ids, document_ids, **kwargs) -> Tensor:
        b, s = input_ids.shape
        sp, sp_rank, ring = self._sp_degree
        if position_ids is None:  # this rank's GLOBAL positions
            position_ids = layout_position_ids(s, sp_rank, sp, ring, input_ids.device).expand(b, s)
        if position_ids.shape[-2:] != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)} (both this rank's slice)")
        if document_ids is not None:
            if tuple(document_ids.shape) != (b, s * sp):
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must cover the whole padded "
                                 f"sequence, (batch, local_seq * sp) = ({b}, {s * sp})")
            kwargs[DOCUMENT_IDS_KWARG] = document_ids
        if self._rope_driven and self.rope.length_dependent:
            self._install_rope(self._rope_length(position_ids))
        decoder = getattr(self, self.base_model_prefix)
        out = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return (h, out.router_logits) if kwargs.get("output_router_logits") else h

    # -- rope ----------------------------------------------------------------

    def set_rope(self, rope) -> None:
        """Use ``rope`` (a :class:`~ulysses_dtensor.models.rope.RopeConfig`) from the next
        forward on, weights untouched; ValueError naming the family for one whose rope
        cannot be changed (``rope_support``'s reason)."""
        from ulysses_dtensor.models.rope import RopeConfig

        if not isinstance(rope, RopeConfig):
            raise TypeError(f"set_rope takes a RopeConfig, got {type(rope).__name__}")
        support = self.rope_support
        if support.rope is None:
            raise ValueError(f"cannot change the rope: {support.reason}")
        rope.check_head_dim(support.rope_dim)
        self.rope, self._rope_driven = rope, True
        if not rope.length_dependent:
            self._install_rope(None)

    def _install_rope(self, seq_len: int | None) -> None:
        support = self.rope_support
        module = support.rotary[0]
        key = (self.rope, seq_len)
        if getattr(module, "_sp_rope_key", None) != key:  # the same rope and length: already there
            inv_freq, scaling = rope_inv_freq(module, self.config.get_text_config(), self.rope, support.extras, seq_len)
            set_rotary(module, inv_freq, scaling)
            module._sp_rope_key = key

    def _rope_length(self, position_ids: Tensor) -> int:
        """L of the length-dependent types: ``rope_seq_len``, else 1 + the largest
        position of this call over every sp rank."""
        if self.rope_seq_len is not None:
            return int(self.rope_seq_len)
        longest = position_ids.max().reshape(1).to(torch.int64)
        if self._sp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self._sp_group)
        return int(longest.item()) + 1

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (full, unsharded; tied weights once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.args.tie_embeddings:
            n -= self.get_input_embeddings().weight.numel()
        return n

    def flops_per_token(self, seq_len: int, causal: bool = True) -> int:
        """Model FLOPs per trained token (forward + backward), for MFU.

        ``6 x`` the parameters a token uses (the embedding lookup excluded; of the
        routed experts only ``experts_per_token / num_experts``), plus attention
        scores and values, ``6 * heads * (qk_dim + v_dim)`` per attended key and
        layer: ``seq/2`` keys on average when causal, fewer in a sliding window,
        none in layers without softmax attention.
        """
        a = self.args
        per_key = 6 * a.n_heads * (a.head_dim + a.v_head_dim)
        keys = 0.0
        for window in a.attention_windows:
            if window == -1:
                continue
            if not causal:
                keys += min(window or seq_len, seq_len)
            elif window is None or window >= seq_len:
                keys += seq_len / 2
            else:  # position i attends min(i + 1, window) keys
                keys += window - window * (window - 1) / (2 * seq_len)
        return int(6 * self._active_params + per_key * keys)


def _active_params(model: nn.Module, shape: CausalLMShape) -> int:
    """Non-embedding parameters one token uses: routed experts scaled by top-k / experts;
    a vision tower's none (text-only calls)."""
    embed = model.get_input_embeddings().weight
    total = 0.0
    seen = {id(p) for m in vision_modules(model) for p in m.parameters()}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embed and not shape.tie_embeddings:
            continue
        n = p.numel()
        if shape.num_experts and shape.experts_per_token and _EXPERT_PARAM.search(name.replace("_checkpoint_wrapped_module.", "")):
            n = n * shape.experts_per_token / shape.num_experts
        total += n
    return int(total)


_ADAPTED_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(cls: type, mixin: type) -> type:
    """``cls`` with ``mixin`` first (once per class; an adapted class stays)."""
    if issubclass(cls, mixin):
        return cls
    key = (cls, mixin)
    if key not in _ADAPTED_CLASSES:
        _ADAPTED_CLASSES[key] = type(f"SP{cls.__name__}", (mixin, cls), {})
    return _ADAPTED_CLASSES[key]


def transformers_class(model: nn.Module) -> type:
    """The model's own class (a transformers class, or a user's subclass of one), under
    the classes FSDP and this adapter put on top of it."""
    from torch.distributed.fsdp import FSDPModule

    wrappers = (FSDPModule, SPCausalLM, SPOutputHead)  # mixins, not modules themselves
    for cls in type(model).__mro__:
        if issubclass(cls, nn.Module) and not any(w in cls.__bases__ for w in wrappers):
            return cls
    return type(model)


_FROM_MEMORY = object()  # adapt_causal_lm's default: the loss tiling parallelize_hf_model was given


def adapt_causal_lm(model: nn.Module, pmesh=None, *, loss_chunks: int | None | object = _FROM_MEMORY) -> nn.Module:
    """Give ``model`` (a transformers causal LM, parallelized or not) the call
    interface of our Llama, in place; returns it.

    Args:
        pmesh: the :class:`~ulysses_dtensor.parallel.mesh.ParallelMesh` it was parallelized
            on (default position ids are then this rank's global ones); None for
            a model in one process.
        loss_chunks: with labels, compute logits + loss over this many sequence
            chunks (1: at once; None: from the shapes), like ``memory.tiled_loss``.
            Default: what ``model.memory_options`` (set by ``parallelize_hf_model``)
            says, else 1.

    Raises ValueError (naming the class) for a head :func:`check_output_head` cannot prove.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    if loss_chunks is _FROM_MEMORY:
        mem = getattr(model, "memory_options", None)
        loss_chunks = mem.loss_chunks if mem is not None and mem.tiled_loss else 1
    if loss_chunks is not None and (isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 1):
        raise ValueError(f"loss_chunks={loss_chunks!r} must be a positive integer, or None for automatic")
    router = None
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        router = (*router_aux_setup(model), pmesh.loss if pmesh is not None else None)
    spec = check_output_head(model, transformers_class(model))
    model.__class__ = _subclass(type(model), SPCausalLM)
    head = model.get_output_embeddings()
    head.__class__ = _subclass(type(head), SPOutputHead)
    head.sp_spec, head.sp_loss_chunks = spec, loss_chunks
    register_fsdp_forward_method(model, "hidden_states")  # the evaluator's entry point
    model.output = OutputHead(head)
    model.args = causal_lm_shape(model.config, transformers_class(model).__name__)
    model._sp_degree = (pmesh.dims.sp, pmesh.sp_rank, pmesh.dims.ring) if pmesh is not None else (1, 0, 1)
    model._active_params = _active_params(model, model.args)
    model._router_aux, model._router_aux_sum, model.aux_loss_weight = router, 0.0, 1.0
    model._sp_seq_len = None
    # The rope: the model's own until set_rope; a length-dependent one is driven from
    # the first call (transformers' own update would read one rank's slice).
    support = rope_support(model)
    model.rope_support, model.rope, model.rope_seq_len = support, support.rope, None
    model._rope_driven = support.rope is not None and support.rope.length_dependent
    model._sp_group = pmesh.sp.get_group() if pmesh is not None and pmesh.dims.sp > 1 else None
    return model


def router_aux_setup(model: nn.Module) -> tuple[float, int, int]:
    """(router_aux_loss_coef, experts, experts per token) of a model with
    ``output_router_logits=True``; ValueError naming the class where it has no router loss."""
    missing = [a for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok") if not hasattr(model, a)]
    if missing:
        raise ValueError(
            f"{transformers_class(model).__name__}: config.output_router_logits=True, but the model has no "
            f"{', '.join(missing)}: not a router load-balancing loss this trainer computes; set it to false")
    return float(model.router_aux_loss_coef), int(model.num_experts), int(model.num_experts_per_tok)
