"""The output head of a transformers causal LM, as the trainer computes it.

transformers' ``*ForCausalLM.forward`` runs ``lm_head`` on the decoder's final
hidden states and then, in some families, transforms the logits: Gemma's final
soft-cap (``c * tanh(x / c)``), Cohere's ``logit_scale`` and Falcon-H1's
``lm_head_multiplier`` (multiply), Granite's ``logits_scaling`` (divide). The trainer needs the head apart from the decoder
(the evaluator reads logits a chunk at a time, the tiled loss computes them a
chunk at a time inside the head's FSDP group), so it computes ``lm_head`` and
the transforms itself:

* :func:`output_head_spec` reads the transforms a config names;
* :func:`check_output_head` proves them on the model's own class: its forward
  runs with the decoder replaced by known hidden states and ``lm_head`` by a
  small known layer, and must give ``spec.apply(head(hidden))``; any other head
  (an unknown transform, a scaled hidden state, a cropped vocabulary) is refused
  with the class named, never approximated;
* :class:`SPOutputHead`, mixed into the ``lm_head`` module's class: with labels its
  forward returns this rank's loss share, whole or over sequence chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ulysses_dtensor.memory.tiling import auto_loss_chunks, checkpointed_pieces
from ulysses_dtensor.parallel.loss import IGNORE_INDEX

__all__ = ["OutputHead", "OutputHeadSpec", "SPOutputHead", "check_output_head", "output_head_spec"]


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
        lm_mul = getattr(cfg, "lm_head_multiplier", None)  # Falcon-H1 (muP): multiply
        if lm_mul not in (None, 1, 1.0) and ("mul", float(lm_mul)) not in ops:
            ops.append(("mul", float(lm_mul)))
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
    """The decoder, replaced by known hidden states; keeps the decoder's plain number
    attributes, which some heads read (Falcon-H1's ``model.lm_head_multiplier``)."""

    def __init__(self, hidden: Tensor, decoder: nn.Module):
        super().__init__()
        for key, value in vars(decoder).items():
            if not key.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(self, key, value)
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _DecoderOutput(self.hidden)


def _child_name(parent: nn.Module, child: nn.Module) -> str | None:
    return next((n for n, m in parent._modules.items() if m is child), None)


def check_output_head(model: nn.Module, cls: type | None = None) -> OutputHeadSpec:
    """The :class:`OutputHeadSpec` of ``model``'s class, proven on the class's own forward.

    The forward runs with the decoder replaced by known hidden states and the
    head by a small known linear layer (CPU, random float32 values, a few
    logits): its logits must equal ``spec.apply(head(hidden))``. Works on a
    model on ``meta`` (nothing of it is computed) and on a parallelized one
    (nothing collective runs). ``cls``: the model's own class, whose forward runs
    (default ``type(model)``; under FSDP's class, the class below it).
    ValueError naming the class when the head does more.
    """
    cls = cls or type(model)
    name = cls.__name__
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
        return _check_output_head(model, name, base_name, head_name, head, cls.forward)


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


def _check_output_head(model, name, base_name, head_name, head, forward) -> OutputHeadSpec:
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
    model._modules[base_name], model._modules[head_name] = _DecoderStub(hidden, saved[0]), probe
    try:
        with torch.no_grad():
            out = forward(model, input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)
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

    def forward(self, hidden: Tensor, labels: Tensor | None = None, num_valid_tokens=None, token_values=None):
        if token_values is not None:  # fn(hidden, head): per-token values, with the gathered weight
            return token_values(hidden, lambda h: self.sp_spec.apply(F.linear(h, self.weight, self.bias)))
        if labels is None:
            return super().forward(hidden)
        if hidden.shape[:-1] != labels.shape:
            raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree")
        seq = hidden.shape[1]
        n = self.sp_loss_chunks or auto_loss_chunks(hidden.shape[0] * seq, self.weight.shape[0])
        n = max(1, min(n, seq))
        if n == 1:
            total = _chunk_loss_sum(hidden, self.weight, self.bias, labels, self.sp_spec)
        else:
            total = hidden.new_zeros((), dtype=torch.float32)
            step = math.ceil(seq / n)
            starts = range(0, seq, step)

            def piece(i):
                a = starts[i]
                return hidden[:, a:a + step], self.weight, self.bias, labels[:, a:a + step], self.sp_spec

            parts = (checkpointed_pieces(_chunk_loss_sum, len(starts), piece) if torch.is_grad_enabled()
                     else (_chunk_loss_sum(*piece(i)) for i in range(len(starts))))
            for part in parts:
                total = total + part
        return total / torch.as_tensor(num_valid_tokens, device=total.device).clamp(min=1)


class OutputHead:
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

    def token_values(self, hidden: Tensor, fn):
        """``fn(hidden, head)`` inside the head's module call (``head``: hidden -> transformed logits)."""
        return self._head(hidden, token_values=fn)
