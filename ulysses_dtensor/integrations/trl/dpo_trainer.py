"""``UlyssesDPOTrainer``: TRL's ``DPOTrainer`` under Ulysses SP and FSDP2, the change in one place::

    trainer = UlyssesDPOTrainer(model=model, args=DPOConfig(...), train_dataset=pairs, processing_class=tok,
                                peft_config=LoraConfig(...), ulysses_args=UlyssesArguments(sp_size=4))

TRL tokenizes the pairs, collates chosen and rejected rows and computes every
``loss_type`` (``ipo``'s division by each completion's token count, ``sft``'s token
mean, ``aot``'s sorting over the batch, WPO's weights, LD-DPO's ``ld_alpha``,
f-divergences) and every metric itself, from per-token log-probabilities of whole
sequences that every sp rank holds (:mod:`.sp_logprobs`): the rows' real tokens
packed into documents (padding-free under SP, whatever TRL's collator padded),
sliced over the sp ranks, gathered back whole. The reference is computed on the fly
(a sharded copy, or the policy with its LoRA adapter off) or once before training
(``precompute_ref_log_probs``: the policy under SP before its first step). No loss
type is refused: each one sees whole sequences. A batch-level loss (``aot``) and
the per-batch means are per data-parallel rank, as TRL's are per process.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ulysses_dtensor.integrations.hf.ulysses_trainer.arguments import UlyssesArguments

from .rl_mixin import UlyssesRLMixin

try:
    import trl.trainer.dpo_trainer as _dpo_module
    from trl import DPOTrainer
except ImportError as e:  # pragma: no cover - the trl extra is absent
    raise ImportError("UlyssesDPOTrainer needs TRL: pip install 'ulysses-dtensor[trl]'") from e

__all__ = ["UlyssesDPOTrainer", "sharded_module_hash"]


def sharded_module_hash(module) -> str:
    """A fingerprint of ``module``'s weights when they are FSDP2 shards (TRL's precompute
    cache key hashes whole tensors): every rank hashes its shards, the ranks' digests are
    hashed in rank order. Collective."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        h.update(name.encode())
        h.update(local.detach().float().cpu().numpy().tobytes())
    digests = [h.hexdigest()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, h.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()


@contextlib.contextmanager
def _sharded_hashing():
    saved = _dpo_module.hash_module
    _dpo_module.hash_module = sharded_module_hash
    try:
        yield
    finally:
        _dpo_module.hash_module = saved


class UlyssesDPOTrainer(UlyssesRLMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` with Ulysses SP, FSDP2 / HSDP and the memory switches
    (``ulysses_args=UlyssesArguments(...)``); see the module doc for what differs."""

    trl_class = DPOTrainer
    loss_is_scaled_for_ga = False  # TRL's DPO loss is a per-batch mean: the Trainer divides it by the steps
    version_checks = UlyssesRLMixin.version_checks + (("trl", "DPOTrainer"),)

    def __init__(self, *args, ulysses_args: UlyssesArguments | None = None, **kwargs):
        self.check_versions()  # before TRL's __init__ (its hash_module is patched around it)
        self._router_logits_as_trl_asks(kwargs.get("model", args[0] if args else None),
                                        kwargs.get("args", args[2] if len(args) > 2 else None))
        with _sharded_hashing():  # the precompute's cache key, over the already sharded policy
            super().__init__(*args, ulysses_args=ulysses_args, **kwargs)
        self._finish_setup()
        if self.ref_model is None and self._peft:
            # TRL calls the peft model itself for the reference (adapter off): the same call here.
            self.model.forward = lambda **kw: self.sp_call(self._sp_model)(**kw)

    @property
    def _peft(self) -> bool:
        from ..hf.ulysses_trainer.mixin import _is_peft

        return _is_peft(self.model)

    def _policy_fields(self) -> tuple[str, ...]:
        fields = ("log_probs", "entropy", "mean_logits", "is_top1")
        return fields + ("log_sum_sq_probs",) if self.use_weighting else fields

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(self.sp_call(model, self._policy_fields()), inputs, return_outputs,
                                    num_items_in_batch)

    def compute_ref_log_probs(self, model, inputs):
        return super().compute_ref_log_probs(self.sp_call(model), inputs)
