"""A parallelized transformers causal LM with the interface of this package's Llama.

The trainer, its ``train_step``, the evaluator and the memory planner call a
model as they call :class:`~ulysses_dtensor.models.llama.Llama`::

    loss  = model(ids, position_ids=, document_ids=, labels=, num_valid_tokens=)
    logit = model(ids, position_ids=, document_ids=)
    h     = model.hidden_states(ids, position_ids=, document_ids=)   # final normed states
    logit = model.output(h)                 # the head; model.output.weight: (vocab, dim)
    model.flops_per_token(seq_len), model.args (sizes), model.num_params()

:func:`adapt_causal_lm` gives a transformers model (usually after
:func:`~.hf.parallelize_hf_model`) exactly that, in place: its class becomes a
subclass with these methods (FSDP does the same to install its own), so the
parameter names stay the checkpoint's and ``model.forward`` stays transformers'.

* The decoder is the model's own (``model.<base_model_prefix>``), called with
  this rank's slice, GLOBAL position ids and the whole sequence's document ids
  (:data:`~.hf_attention.DOCUMENT_IDS_KWARG`).
* The head is the model's ``lm_head`` followed by what its forward does to the
  logits: Gemma's final soft-cap, Cohere's ``logit_scale``, Granite's
  ``logits_scaling``. :func:`check_output_head` proves it on the class itself,
  by running the class's own forward with the decoder replaced by known hidden
  states and a small known head; anything else (an unknown transform) is
  refused, never approximated.
* With labels the model returns this rank's share of the global token mean
  (``sp_cross_entropy``: local sum / ``num_valid_tokens``), in one piece or
  (``loss_chunks != 1``) over sequence chunks, each recomputed in backward, so
  the ``(seq, vocab)`` logits never exist whole.

Under FSDP2 ``hidden_states`` and the trainer's forward are registered as forward
methods of the root (its hooks gather what they use), and the head's two entry
points as forward methods of the ``lm_head`` group, as our Llama's head is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..loss import IGNORE_INDEX
from ..tiling import auto_num_tiles
from .hf_attention import DOCUMENT_IDS_KWARG

__all__ = [
    "CausalLMShape",
    "OutputHeadSpec",
    "adapt_causal_lm",
    "causal_lm_shape",
    "check_output_head",
    "output_head_spec",
    "transformers_class",
]


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


# ---------------------------------------------------------------------------
# The output head
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputHeadSpec:
    """What the model's forward does to ``lm_head``'s logits, in order:
    ``("mul", s)``, ``("div", s)`` or ``("softcap", c)`` (``c * tanh(x / c)``)."""

    ops: tuple = ()

    def apply(self, logits: Tensor) -> Tensor:
        for op, value in self.ops:
            if op == "mul":
                logits = logits * value
            elif op == "div":
                logits = logits / value
            else:
                logits = torch.tanh(logits / value) * value
        return logits

    def __str__(self) -> str:
        return " then ".join(f"{op} {v:g}" for op, v in self.ops) or "none"


def output_head_spec(config) -> OutputHeadSpec:
    """The logit transforms this config asks for (which of them the class really
    applies is proven by :func:`check_output_head`)."""
    text = config.get_text_config()
    ops = []
    for cfg in (config, text):
        scale = getattr(cfg, "logit_scale", None)  # Cohere, Cohere2: multiply
        if scale not in (None, 1, 1.0) and ("mul", float(scale)) not in ops:
            ops.append(("mul", float(scale)))
        div = getattr(cfg, "logits_scaling", None)  # Granite: divide
        if div not in (None, 1, 1.0) and ("div", float(div)) not in ops:
            ops.append(("div", float(div)))
    cap = getattr(config, "final_logit_softcapping", None) or getattr(text, "final_logit_softcapping", None)
    if cap:
        ops.append(("softcap", float(cap)))
    return OutputHeadSpec(tuple(ops))


class _DecoderOutput:
    """What a decoder returns, holding only the final hidden states."""

    def __init__(self, hidden: Tensor):
        self.last_hidden_state = hidden

    def __getitem__(self, index):
        if index == 0:
            return self.last_hidden_state
        raise IndexError(index)

    def __getattr__(self, name):  # past_key_values, router_logits, ...: not computed
        return None


class _DecoderStub(nn.Module):
    def __init__(self, hidden: Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _DecoderOutput(self.hidden)


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((n for n, m in parent._modules.items() if m is child), None)


def check_output_head(model: nn.Module) -> OutputHeadSpec:
    """The :class:`OutputHeadSpec` of ``model``'s class, proven on the class's own forward.

    The forward runs with the decoder replaced by known hidden states and the
    head by a small known linear layer (CPU, float64-exact inputs, a few logits):
    its logits must equal ``spec.apply(head(hidden))``. Works on a model on
    ``meta`` (nothing of it is computed) and on a parallelized one (nothing
    collective runs). ValueError naming the class when the head does more.
    """
    name = transformers_class(model).__name__
    head = model.get_output_embeddings()
    base_name = getattr(model, "base_model_prefix", "model")
    base = getattr(model, base_name, None)
    head_name = _child_name(model, head) if head is not None else None
    if not isinstance(head, nn.Linear) or head_name is None or base is None or _child_name(model, base) is None:
        raise ValueError(
            f"{name}: expected a decoder at .{base_name} and a linear output head among its direct "
            "children (as transformers' *ForCausalLM classes have); this layout is not supported"
        )
    with _real_tensors():  # also under the memory planner's FakeTensorMode
        return _check_output_head(model, name, base_name, head_name, head)


def _is_fake(t: Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - other torch layouts
        return False
    return is_fake(t)


def _real_tensors():
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - other torch layouts
        import contextlib

        return contextlib.nullcontext()
    return unset_fake_temporarily()


def _check_output_head(model, name, base_name, head_name, head) -> OutputHeadSpec:
    spec = output_head_spec(model.config)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 3, head.in_features, generator=gen)
    probe = nn.Linear(head.in_features, 5, bias=head.bias is not None)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=gen))
        if probe.bias is not None:
            probe.bias.copy_(torch.randn(probe.bias.shape, generator=gen))
        want = spec.apply(probe(hidden))
    saved = model._modules[base_name], model._modules[head_name]
    model._modules[base_name], model._modules[head_name] = _DecoderStub(hidden), probe
    try:
        with torch.no_grad():
            out = transformers_class(model).forward(model, input_ids=torch.zeros(1, 3, dtype=torch.long),
                                                    use_cache=False)
        got = out.logits if hasattr(out, "logits") else out[0]
    except Exception as e:  # noqa: BLE001 - any failure means: not the layout we know
        raise ValueError(f"{name}: its forward does not run as lm_head(decoder(...)) ({type(e).__name__}: {e})") from None
    finally:
        model._modules[base_name], model._modules[head_name] = saved
    if tuple(got.shape) != tuple(want.shape) or not torch.allclose(got.float(), want, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"{name}: its forward does more to the logits than lm_head followed by the transforms its "
            f"config names ({spec}); this head is not supported by the trainer's model interface"
        )
    return spec


# ---------------------------------------------------------------------------
# The head: lm_head, and with labels this rank's loss share (a module call, as our Llama's)
# ---------------------------------------------------------------------------


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, spec: OutputHeadSpec) -> Tensor:
    logits = spec.apply(F.linear(hidden, weight, bias)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class SPOutputHead:
    """Mixed into the adapted model's ``lm_head`` class. Without labels it is the
    plain linear layer (transformers' own forward still works); with labels its
    forward returns this rank's share of the global token-mean cross entropy of
    the transformed logits (``sp_cross_entropy``), over ``sp_loss_chunks``
    sequence chunks each recomputed in backward (1: at once; None: from the
    shapes). Computed inside the module's forward, so that under FSDP2 it runs
    with the gathered weight (our Llama's ``OutputHead`` does the same)."""

    sp_spec: OutputHeadSpec = OutputHeadSpec()
    sp_loss_chunks: int | None = 1

    def forward(self, hidden: Tensor, labels: Tensor | None = None, num_valid_tokens=None) -> Tensor:
        if labels is None:
            return super().forward(hidden)
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
        seq = hidden.shape[1]
        n = self.sp_loss_chunks or auto_num_tiles(seq, self.weight.shape[0], hidden.shape[-1])
        n = max(1, min(n, seq))
        if n == 1:
            total = _chunk_loss_sum(hidden, self.weight, self.bias, labels, self.sp_spec)
        else:
            total = hidden.new_zeros((), dtype=torch.float32)
            step = math.ceil(seq / n)
            for start in range(0, seq, step):
                args = (hidden[:, start:start + step], self.weight, self.bias, labels[:, start:start + step],
                        self.sp_spec)
                total = total + (checkpoint(_chunk_loss_sum, *args, use_reentrant=False) if torch.is_grad_enabled()
                                 else _chunk_loss_sum(*args))
        return total / torch.as_tensor(num_valid_tokens, device=total.device).clamp(min=1)


class _OutputHead:
    """``model.output``: the head as the evaluator uses our Llama's (called on hidden
    states, ``.weight`` of shape (vocab, dim)). Not a module: the parameters stay
    where transformers put them, under their names."""

    def __init__(self, head: nn.Linear):
        self._head = head

    @property
    def weight(self) -> Tensor:
        return self._head.weight

    def __call__(self, hidden: Tensor) -> Tensor:
        return self._head.sp_spec.apply(self._head(hidden))

    def loss(self, hidden: Tensor, labels: Tensor, num_valid_tokens) -> Tensor:
        return self._head(hidden, labels, num_valid_tokens)


# ---------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------

_LABELS, _COUNT = "sp_labels", "sp_num_valid_tokens"  # forward keywords, unknown to transformers' pre-hooks


class SPCausalLM:
    """Mixed into an adapted model's class (see :func:`adapt_causal_lm`)."""

    def __call__(self, input_ids: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
                 *, labels: Tensor | None = None, num_valid_tokens: Tensor | int | None = None) -> Tensor:
        """Logits ``(B, s_local, vocab)`` of this rank's tokens, or with ``labels``
        (shifted, this rank's slice) its share of the global token-mean loss, as
        :meth:`~ulysses_dtensor.models.llama.Llama.forward`. A module call (hooks:
        the integration's input checks, FSDP's root) of :meth:`forward`."""
        if labels is not None and num_valid_tokens is None:
            raise ValueError(
                "labels given without num_valid_tokens: pass the valid-label count of the whole global "
                "batch (count_valid_tokens(labels, pmesh.loss)) so every rank divides by the same number"
            )
        kwargs = {} if document_ids is None else {DOCUMENT_IDS_KWARG: document_ids}
        if document_ids is None and position_ids is not None and _is_fake(position_ids):
            # The memory planner's fake rows: the integration's check that positions do not
            # restart would read values; its default (this rank's global positions) is theirs.
            position_ids = None
        return nn.Module.__call__(self, input_ids=input_ids, position_ids=position_ids, **kwargs,
                                  **{_LABELS: labels, _COUNT: num_valid_tokens})

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, **kwargs) -> Tensor:
        """The trainer's forward (transformers' own stays ``transformers_class(model).forward``)."""
        labels, count = kwargs.pop(_LABELS, None), kwargs.pop(_COUNT, None)
        h = self._sp_hidden(input_ids, position_ids, kwargs.pop(DOCUMENT_IDS_KWARG, None))
        if kwargs:
            raise TypeError(f"{type(self).__name__} (trainer interface): unexpected arguments {sorted(kwargs)}")
        if labels is None:
            return self.output(h)
        return self.output.loss(h, labels, count)

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor | None = None,
                      document_ids: Tensor | None = None) -> Tensor:
        """The decoder's final normed hidden states ``(B, s_local, dim)``."""
        return self._sp_hidden(input_ids, position_ids, document_ids)

    def _sp_hidden(self, input_ids, position_ids, document_ids) -> Tensor:
        b, s = input_ids.shape
        sp, sp_rank = self._sp_degree
        if position_ids is None:  # this rank's GLOBAL positions
            position_ids = (torch.arange(s, device=input_ids.device) + sp_rank * s).expand(b, s)
        if position_ids.shape[-2:] != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids "
                             f"{tuple(input_ids.shape)} (both this rank's slice)")
        kwargs = {}
        if document_ids is not None:
            if tuple(document_ids.shape) != (b, s * sp):
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must cover the whole padded "
                                 f"sequence, (batch, local_seq * sp) = ({b}, {s * sp})")
            kwargs[DOCUMENT_IDS_KWARG] = document_ids
        decoder = getattr(self, self.base_model_prefix)
        out = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

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
    """Non-embedding parameters one token uses: routed experts scaled by top-k / experts."""
    embed = model.get_input_embeddings().weight
    total = 0.0
    seen = set()
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


def adapt_causal_lm(model: nn.Module, pmesh=None, *, loss_chunks: int | None = 1) -> nn.Module:
    """Give ``model`` (a transformers causal LM, parallelized or not) the call
    interface of our Llama, in place; returns it.

    Args:
        pmesh: the :class:`~ulysses_dtensor.mesh.ParallelMesh` it was parallelized
            on (default position ids are then this rank's global ones); None for
            a model in one process.
        loss_chunks: with labels, compute logits + loss over this many sequence
            chunks (1: at once; None: from the shapes), like ``memory.tiled_loss``.

    Raises ValueError (naming the class) for a head :func:`check_output_head` cannot prove.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    if loss_chunks is not None and (isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or loss_chunks < 1):
        raise ValueError(f"loss_chunks={loss_chunks!r} must be a positive integer, or None for automatic")
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        raise ValueError(
            f"{transformers_class(model).__name__}: config.output_router_logits=True adds the router load-balancing "
            "loss, which this interface does not compute; set it to false in config.json"
        )
    spec = check_output_head(model)
    model.__class__ = _subclass(type(model), SPCausalLM)
    head = model.get_output_embeddings()
    head.__class__ = _subclass(type(head), SPOutputHead)
    head.sp_spec, head.sp_loss_chunks = spec, loss_chunks
    register_fsdp_forward_method(model, "hidden_states")  # the evaluator's entry point
    model.output = _OutputHead(head)
    model.args = causal_lm_shape(model.config, transformers_class(model).__name__)
    model._sp_degree = (pmesh.dims.sp, pmesh.sp_rank) if pmesh is not None else (1, 0)
    model._active_params = _active_params(model, model.args)
    return model
