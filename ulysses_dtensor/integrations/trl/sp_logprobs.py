"""TRL's per-token log-probability call, run under Ulysses SP: what TRL's GRPO and DPO
trainers read of a model, computed on whole sequences split over the sp ranks.

TRL patches its models with a fused head: ``model(input_ids=, attention_mask=,
labels=, fused_lm_head=True)`` returns, per token, the log-probability of the next
label, the entropy, and a few metrics, for padded rows (GRPO: left-padded prompts,
right-padded completions; DPO: right padding), without ever holding the logits.
:class:`SPLogProbs` is a callable TRL is handed in the model's place that returns the
same fields, computed here:

1. the rows' real tokens are packed into one row of documents (position ids restart at
   each row), so no rank computes padding and documents never attend to each other;
2. the packed row is padded to a multiple of sp and sliced (``shard_hf_batch``), the
   model runs on this rank's slice (Ulysses attention, hybrid mixers, MoE routers,
   memory switches), and the head computes the per-token values chunk by chunk
   (:func:`~ulysses_dtensor.memory.token_logprobs.chunked_token_stats`);
3. the values are gathered back to whole sequences on every sp rank
   (:func:`~ulysses_dtensor.parallel.sequence_values.sp_gather_tokens`: own gradients)
   and laid out as TRL's ``(batch, seq - 1)`` tensors, 0 where no label.

So every sp rank of a group holds the same whole-sequence tensors, and TRL's own code
computes the loss, every normalisation and every metric on them, as in one process.
The MoE router loss is that of the whole global batch (as one process computes it),
its value on every rank, its gradient this rank's share times ``aux_grad_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ulysses_dtensor.parallel.fsdp_reset import reset_fsdp
from ulysses_dtensor.parallel.loss import IGNORE_INDEX
from ulysses_dtensor.parallel.sequence_values import own_gradient, sp_gather_tokens
from ulysses_dtensor.memory.token_logprobs import chunked_token_stats

from ..hf.attention_function import DOCUMENT_IDS_KWARG
from ..hf.ulysses_trainer.refusals import UlyssesTrainerError
from ..hf.model_inputs import SEQ_LEN_KWARG, shard_hf_batch

__all__ = ["PackedRows", "SPLogProbs", "TokenOutputs"]

# TRL's model inputs that carry nothing here (use_cache: there is no cache in training).
_IGNORED = ("use_cache", "return_dict")


@dataclass
class TokenOutputs:
    """The fields TRL's fused head returns, ``(batch, seq - 1)`` each (None when not asked)."""

    log_probs: Tensor | None = None
    entropy: Tensor | None = None
    log_sum_sq_probs: Tensor | None = None
    mean_logits: Tensor | None = None
    is_top1: Tensor | None = None
    aux_loss: Tensor | None = None
    logits: Tensor | None = None
    loss: Tensor | None = None
    label_mask: Tensor | None = field(default=None, repr=False)


class PackedRows:
    """The real tokens of padded rows ``(B, S)`` (``attention_mask``: one run of ones per
    row, padding on the left, the right or both) as one packed row of ``N`` tokens."""

    def __init__(self, attention_mask: Tensor):
        real = attention_mask.bool()
        b, s = real.shape
        lengths = real.sum(dim=1)
        starts = torch.where(lengths > 0, real.int().argmax(dim=1), torch.zeros_like(lengths))
        span = torch.arange(s, device=real.device)[None, :]
        run = (span >= starts[:, None]) & (span < (starts + lengths)[:, None])
        if not bool((run == real).all()):
            row = int((run != real).any(dim=1).nonzero()[0])
            raise UlyssesTrainerError(f"attention_mask row {row} has holes (padding inside the row): only left and right "
                             "padding can be packed into documents")
        self.batch, self.seq, self.real = b, s, real
        self.lengths, self.starts = lengths.tolist(), starts.tolist()
        self.offsets = [0]
        for n in self.lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]

    def pack(self, x: Tensor) -> Tensor:
        """``(B, S, ...)`` -> ``(1, N, ...)``: the real tokens, row after row."""
        return x[self.real].unsqueeze(0)

    def position_ids(self, device) -> Tensor:
        """``(1, N)``: 0, 1, ... in each row (packed documents)."""
        return torch.cat([torch.arange(n, device=device) for n in self.lengths]).unsqueeze(0)

    def shifted_places(self, device) -> tuple[Tensor, Tensor]:
        """(flat indices into ``(B, S - 1)``, indices into the packed row): the positions
        ``t`` whose next token ``t + 1`` is real, and where ``t`` sits in the packed row."""
        out, packed = [], []
        for row, (start, n, off) in enumerate(zip(self.starts, self.lengths, self.offsets)):
            if n > 1:
                t = torch.arange(start, start + n - 1, device=device)
                out.append(row * (self.seq - 1) + t)
                packed.append(off + (t - start))
        if not out:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return empty, empty
        return torch.cat(out), torch.cat(packed)

    def unpack(self, packed: Tensor, places: tuple[Tensor, Tensor]) -> Tensor:
        """``(1, N, k)`` values at the packed positions -> ``(B, S - 1, k)``, 0 elsewhere."""
        flat, index = places
        out = packed.new_zeros(self.batch * (self.seq - 1), packed.shape[-1])
        out = out.index_copy(0, flat, packed[0].index_select(0, index))
        return out.view(self.batch, self.seq - 1, packed.shape[-1])


class SPLogProbs:
    """Called by TRL as its fused-head model: ``(input_ids, attention_mask, labels,
    fused_lm_head=True[, output_router_logits])`` -> :class:`TokenOutputs`. ``lm``: the
    model under SP with :func:`~ulysses_dtensor.integrations.hf.adapt_causal_lm`'s
    interface; ``fields``: which of :data:`~ulysses_dtensor.memory.token_logprobs.TOKEN_FIELDS`
    to compute (``log_probs`` always); ``temperature`` divides the logits (GRPO's
    sampling temperature); ``chunks``: the head's sequence chunks (None: from the shapes)."""

    def __init__(self, lm, pmesh, *, fields=("log_probs",), temperature: float = 1.0, chunks: int | None = None,
                 aux_grad_scale: float = 1.0, name: str = "model"):
        self.lm, self.pmesh, self.name = lm, pmesh, name
        self.fields = tuple(dict.fromkeys(("log_probs", *fields)))
        self.temperature, self.chunks, self.aux_grad_scale = float(temperature), chunks, float(aux_grad_scale)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                 fused_lm_head: bool = False, output_router_logits: bool = False, **kwargs) -> TokenOutputs:
        extra = [k for k, v in kwargs.items() if v is not None and k not in _IGNORED]
        if extra:
            raise UlyssesTrainerError(f"{self.name} under Ulysses SP runs its text path on packed rows; got {extra[0]}=...: "
                             "images and other model inputs are not supported")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows = PackedRows(attention_mask)
        batch = {"input_ids": rows.pack(input_ids), "position_ids": rows.position_ids(input_ids.device)}
        if not fused_lm_head:
            return TokenOutputs(logits=self._logits(rows, batch, input_ids))
        if labels is None:
            raise UlyssesTrainerError("the fused head needs labels (the tokens to score, -100 elsewhere)")
        batch["labels"] = rows.pack(labels.masked_fill(~rows.real, IGNORE_INDEX))
        local, targets = shard_hf_batch(batch, self.pmesh.sp)
        fields, temperature, chunks = self.fields, self.temperature, self.chunks
        vocab = self.lm.output.weight.shape[0]

        def values(hidden, head):
            return chunked_token_stats(hidden, head, targets, fields, temperature=temperature, chunks=chunks,
                                       vocab=vocab)

        local_values, share = self.lm(local["input_ids"], local["position_ids"], local.get(DOCUMENT_IDS_KWARG),
                                      seq_len=local[SEQ_LEN_KWARG], token_values=values,
                                      router_aux=bool(output_router_logits))
        if not torch.is_grad_enabled():
            reset_fsdp(self.lm)
        stacked = torch.stack([local_values[f].float() for f in fields], dim=-1)
        whole = sp_gather_tokens(stacked, self.pmesh.sp, rows.total)
        per_token = rows.unpack(whole, rows.shifted_places(input_ids.device)).unbind(-1)
        out = TokenOutputs(**dict(zip(fields, per_token)))
        if out.is_top1 is not None:
            out.is_top1 = out.is_top1 > 0.5
        out.label_mask = labels[:, 1:] != IGNORE_INDEX
        if share is not None:
            out.aux_loss = self._router_loss(share)
        return out

    def _router_loss(self, share: Tensor) -> Tensor:
        """The router loss of the whole global batch (every rank's share summed), with the
        gradient of ``aux_grad_scale`` times this rank's share."""
        total = share.detach().reshape(1)
        group = self.pmesh.loss
        if group.size() > 1:  # summed in rank order: the same bits on every rank (a logged metric)
            total = funcol.wait_tensor(funcol.all_gather_tensor(total, 0, group.get_group())).sum()
        return own_gradient(self.aux_grad_scale * share, total.reshape(()))

    def _logits(self, rows: PackedRows, batch: dict, input_ids: Tensor) -> Tensor:
        """Whole-sequence logits ``(B, S, vocab)`` (0 at padding): evaluation's predictions."""
        local, _ = shard_hf_batch(batch, self.pmesh.sp)
        logits = self.lm(local["input_ids"], local["position_ids"], local.get(DOCUMENT_IDS_KWARG),
                         seq_len=local[SEQ_LEN_KWARG])
        if not torch.is_grad_enabled():
            reset_fsdp(self.lm)
        whole = sp_gather_tokens(logits, self.pmesh.sp, rows.total)[0]
        out = whole.new_zeros(rows.batch * rows.seq, whole.shape[-1])
        flat = rows.real.reshape(-1).nonzero().squeeze(1)
        return out.index_copy(0, flat, whole).view(rows.batch, rows.seq, -1)
