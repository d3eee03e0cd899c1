"""``UlyssesHFTrainer``: transformers' ``Trainer`` with this package's Ulysses SP (and the ring
past the head count), FSDP2 / HSDP and memory switches, the change in one place::

    trainer = UlyssesHFTrainer(model=model, args=training_args, train_dataset=ds, data_collator=collator,
                               ulysses_args=UlyssesArguments(sp_size=4))   # was: Trainer(...)

:class:`UlyssesTrainerMixin` is the whole change, for any Trainer subclass
(``class MyTrainer(UlyssesTrainerMixin, MyBaseTrainer)``; TRL's SFTTrainer:
:mod:`ulysses_dtensor.integrations.trl`). What it does at each of the Trainer's seams:

* ``__init__``, first: the installed transformers and accelerate (TRL for TRL's trainers,
  peft for a peft model) against the versions the parity tests ran
  (:mod:`ulysses_dtensor.integrations.versions`: a warning, or a refusal naming a private
  member this trainer relies on that the installed version lacks);
* ``create_accelerator_and_postprocess`` (inside ``Trainer.__init__``, once the process
  group exists): refuses the TrainingArguments it cannot honour
  (:mod:`.arguments`), builds the mesh, parallelizes the model in place
  (``parallelize_hf_model``: a peft model's base, adapters inside), and gives the
  accelerator data-parallel sharding and gathering (:mod:`.accelerator`);
* ``compute_loss``: the batch is checked, padded to a multiple of sp, its labels
  shifted on the whole sequence, sliced (``shard_hf_batch``), and the model returns this
  rank's share of the token mean over the whole step -- every rank, every micro-batch:
  ``_get_num_items_in_batch`` counts the step's targets over the data-parallel ranks
  only (transformers #46775 divided them by sp); the logged loss is that mean on every
  rank;
* ``prediction_step`` (``evaluate`` / ``predict``): the loss of this data-parallel rank's
  batch, and its logits gathered back to whole sequences (transformers #48663 leaves them
  split);
* ``save_model`` / ``_save_checkpoint`` / ``resume_from_checkpoint``: :mod:`.checkpoints`;
* between the gradient norm and the optimizer step: a step whose loss or gradient norm is
  not finite is skipped on every rank, too many in a row stop the run
  (:mod:`.nonfinite_steps`).

The CUDA allocator is set for long context (expandable segments) unless the user set
``PYTORCH_CUDA_ALLOC_CONF`` (:mod:`ulysses_dtensor.runtime.allocator`).

The model is called through :func:`~ulysses_dtensor.integrations.hf.adapt_causal_lm`
(tiled loss, the MoE router loss over the global batch), adapted at its first call:
until then the dataloaders read the model's own forward signature.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME, Trainer

from ulysses_dtensor.parallel.fsdp_reset import reset_fsdp
from ulysses_dtensor.parallel.loss import count_valid_tokens, global_loss
from ulysses_dtensor.parallel.mesh import ParallelDims
from ulysses_dtensor.runtime.allocator import allocator_banner, apply_allocator_default
from ulysses_dtensor.runtime.nonfinite import check_finite_state, inject_nonfinite_loss

from ...versions import UntestedVersionError, check_library
from ..attention_function import DOCUMENT_IDS_KWARG
from ..causal_lm import adapt_causal_lm
from ..model_inputs import SEQ_LEN_KWARG, shard_hf_batch
from ..parallelize_model import parallelize_hf_model
from .accelerator import make_sp_accelerator
from .arguments import UlyssesArguments, check_training_arguments, parallelize_options
from .batches import ROW_LENGTHS, check_same_batch, count_targets, gather_sequence, sp_batch
from .checkpoints import (
    STATE_DIR,
    has_training_state,
    load_model,
    load_optimizer,
    save_full_model,
    save_peft_adapter,
    save_training_state,
)
from .nonfinite_steps import NonFiniteSteps
from .refusals import UlyssesTrainerError, install_report_hook

__all__ = ["UlyssesHFTrainer", "UlyssesTrainerMixin"]

logger = logging.getLogger(__name__)


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _ensure_process_group(device: torch.device) -> None:
    """A world of one when the script runs without a launcher: the mesh needs a group."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_same_weights(model: nn.Module, device: torch.device) -> None:
    """ValueError naming the first parameter whose values differ between ranks: each rank
    shards its OWN copy, so differing copies would train a chimera. Compared by the sum of
    each parameter's bits as integers (exact whatever the summation order)."""
    params = list(model.named_parameters())
    meta = [n for n, p in params if p.is_meta]
    if meta:
        raise UlyssesTrainerError(
            f"the model's parameters are on the meta device ({meta[0]}, ...): UlyssesHFTrainer trains "
            "the weights the model holds; load them (from_pretrained) before building the trainer")
    if dist.get_world_size() == 1:
        return
    sums = torch.stack([p.detach().view(_BITS[p.element_size()]).sum(dtype=torch.int64) for _, p in params])
    low, high = sums.to(device), sums.to(device).clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = (low != high).nonzero()
    if differ.numel():
        raise UlyssesTrainerError(
            f"the model's weights differ between ranks (first: {params[int(differ[0])][0]}): every rank must build "
            "the same model -- from_pretrained, or set_seed(...) before from_config and get_peft_model")


def _accelerator_settings(trainer) -> tuple[str, str | None]:
    """(mixed precision, dynamo backend) the Trainer's accelerator settled on (an ``accelerate
    launch`` configuration can set them), or ValueError for one this trainer cannot honour."""
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        engine = "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP"
        raise UlyssesTrainerError(
            f"the accelerate configuration enables {engine} (accelerate launch --config_file / "
            "ACCELERATE_USE_* variables): UlyssesHFTrainer shards the model with FSDP2 itself; launch "
            "with a plain multi-process configuration")
    precision = str(getattr(trainer.accelerator, "mixed_precision", "no"))
    if precision not in ("no", "bf16"):
        raise UlyssesTrainerError(
            f"the accelerate configuration sets mixed_precision={precision!r}: UlyssesHFTrainer runs "
            "float32 or bf16 (FSDP2 mixed precision with float32 master weights); use bf16")
    dynamo = trainer.accelerator.state.dynamo_plugin
    return precision, None if dynamo is None else str(getattr(dynamo.backend, "value", dynamo.backend)).lower()


def _build_mesh(ua: UlyssesArguments, device: torch.device):
    _ensure_process_group(device)
    world = dist.get_world_size()
    try:
        dims = ParallelDims(dp_replicate=ua.dp_replicate_size, dp_shard=ua.dp_shard_size, sp=ua.sp_size,
                            ring=ua.ring_size, world_size=world)
    except ValueError as e:
        raise UlyssesTrainerError(
            f"UlyssesArguments(dp_replicate_size={ua.dp_replicate_size}, dp_shard_size="
            f"{ua.dp_shard_size}, sp_size={ua.sp_size}, ring_size={ua.ring_size}) on {world} processes: "
            f"{e}") from None
    return dims.build_mesh(device.type)


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model to parallelize (a peft model's base), or the reason it cannot be."""
    inner = model.get_base_model() if _is_peft(model) else model
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(f"UlyssesHFTrainer trains a transformers PreTrainedModel (or a peft model of one), got "
                        f"{type(inner).__name__}")
    if getattr(inner, "hf_device_map", None) is not None:
        raise UlyssesTrainerError("the model was loaded with a device_map (split across devices): load it with "
                                  "device_map=None; FSDP2 places each rank's shards on its device")
    if getattr(inner, "quantization_method", None) is not None:
        raise UlyssesTrainerError(
            f"a quantized model ({inner.quantization_method}) is not supported by UlyssesHFTrainer: "
            "FSDP2 shards floating-point parameters")
    return inner


class UlyssesTrainerMixin(NonFiniteSteps):
    """Ulysses SP + FSDP2 for a transformers ``Trainer`` (subclass), configured by
    ``ulysses_args=UlyssesArguments(...)`` (see the module doc)."""

    # compute_loss returns this rank's share of the token mean over the whole step
    # (micro-batches included): nothing for the Trainer to divide.
    loss_is_scaled_for_ga = True

    # (library, part) whose private members this trainer relies on (integrations/versions.py),
    # checked first in __init__; TRL's trainers add their own.
    version_checks: tuple[tuple[str, str], ...] = (("transformers", "Trainer"), ("accelerate", "Accelerator"))

    @classmethod
    def check_versions(cls) -> None:
        """Warn about a library version the parity tests did not run; UntestedVersionError
        (one line per node when the script does not catch it) when a private member this
        trainer relies on is gone from it."""
        try:
            for library, part in cls.version_checks:
                check_library(library, part, user=cls.__name__)
        except UntestedVersionError:
            install_report_hook()
            raise

    def __init__(self, *args, ulysses_args: UlyssesArguments | None = None, **kwargs):
        self.check_versions()
        if ulysses_args is None:
            ulysses_args = UlyssesArguments()
        if not isinstance(ulysses_args, UlyssesArguments):
            raise TypeError(f"ulysses_args must be a UlyssesArguments, got {type(ulysses_args).__name__}")
        self.ulysses_args = ulysses_args
        apply_allocator_default()  # CUDA may be initialised already: set in the running allocator too
        self.pmesh = None
        self._sp_model = None  # the transformers model under SP (a peft model's base model)
        self._sp_lm = None  # the same, adapted to the call interface, at its first call
        super().__init__(*args, **kwargs)
        self._check_trainer_objects()

    # -- setup -------------------------------------------------------------------------

    def check_arguments(self) -> None:
        """The TrainingArguments this trainer refuses (subclasses add their own)."""
        check_training_arguments(self.args)

    def create_accelerator_and_postprocess(self) -> None:
        self.check_arguments()
        if self.model is None:
            raise UlyssesTrainerError("UlyssesHFTrainer needs model=: model_init= would build the model inside "
                                      "train(), after the model must already be sharded")
        super().create_accelerator_and_postprocess()
        precision, backend = _accelerator_settings(self)
        options = parallelize_options(self.args, self.ulysses_args, mixed_precision=precision,
                                      dynamo_backend=backend)
        # Checkpointing is ours from here (per decoder layer, inside the FSDP2 groups); the
        # Trainer would put transformers' own on top in train().
        self.args.activation_checkpointing = False
        self.pmesh = _build_mesh(self.ulysses_args, self.args.device)
        make_sp_accelerator(self.accelerator, self.pmesh)
        self.gather_function = self.accelerator.gather_for_metrics
        self._sp_model = _transformers_model(self.model)
        if _is_peft(self.model):
            check_library("peft", user=type(self).__name__)
        _check_same_weights(self._sp_model, self.args.device)
        parallelize_hf_model(self._sp_model, self.pmesh, **options)
        if self.is_world_process_zero():
            logger.info("UlyssesHFTrainer %s", allocator_banner(self.args.device.type))

    def _check_trainer_objects(self) -> None:
        if self.compute_loss_func is not None:
            raise UlyssesTrainerError(
                "compute_loss_func= is not supported by UlyssesHFTrainer: it would see one rank's slice of "
                "the logits; the loss is the sp-sharded token mean")
        if self.optimizer is not None or self.lr_scheduler is not None:
            raise UlyssesTrainerError(
                "optimizers=(optimizer, scheduler) is not supported by UlyssesHFTrainer: the optimizer "
                "must hold the sharded parameters, which exist only once the trainer parallelized the "
                "model; pass optimizer_cls_and_kwargs=(cls, kwargs) instead")

    def _move_model_to_device(self, model, device):
        """FSDP2 put the shards on the mesh's device (or in host memory with offload_params)."""

    def causal_lm(self) -> nn.Module:
        """The model under SP with the call interface of :func:`adapt_causal_lm` (adapted at
        the first call; the Trainer reads the model's own forward signature before)."""
        if self._sp_lm is None:
            self._set_signature_columns_if_needed()
            # A forward set on the instance (TRL's fused head) would shadow the adapted class's.
            self._sp_model.__dict__.pop("forward", None)
            chunks = self.ulysses_args.loss_chunks or None
            self._sp_lm = adapt_causal_lm(self._sp_model, self.pmesh, loss_chunks=chunks)
        return self._sp_lm

    # -- data ------------------------------------------------------------------------------

    def get_total_train_batch_size(self, args) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.pmesh.dims.dp

    def _sp_inputs(self, inputs, *, need_labels: bool) -> dict:
        batch = sp_batch(inputs, need_labels=need_labels)
        if self.ulysses_args.check_batches:
            check_same_batch(batch, self.pmesh.sp.get_group(), self.pmesh.dims.sp)
        return batch

    def _get_num_items_in_batch(self, batch_samples, device):
        """The targets of the whole step: every micro-batch, every data-parallel rank (the sp
        ranks of a group hold the same batch: counted once)."""
        if not batch_samples:
            return None
        total = sum(count_targets(sp_batch(b, need_labels=True)) for b in batch_samples).to(device)
        if self.pmesh.dims.dp > 1:
            dist.all_reduce(total, group=self.pmesh.dp.get_group())
        return total

    def floating_point_ops(self, inputs) -> int:
        # Every sp rank holds the whole batch; the FLOPs are split among them.
        return super().floating_point_ops(inputs) / self.pmesh.dims.sp

    # -- loss ------------------------------------------------------------------------------

    def _forward(self, batch: dict, local: dict, labels=None, count=None):
        """The adapted model on this rank's slice (``shard_hf_batch``'s inputs): logits, or
        with ``labels`` this rank's share of the loss over ``count`` targets."""
        lengths = batch.get(ROW_LENGTHS, local[SEQ_LEN_KWARG])  # what MoE routers count
        return self.causal_lm()(local["input_ids"], local["position_ids"], local.get(DOCUMENT_IDS_KWARG),
                                labels=labels, num_valid_tokens=count, seq_len=lengths)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the token mean over the step (``num_items_in_batch``: the
        step's targets over every rank), or over this micro-batch when it is not given.
        With ``return_outputs`` the outputs are None: no rank holds a whole sequence's logits
        (``prediction_step`` gathers them)."""
        lm = self.causal_lm()
        batch = self._sp_inputs(inputs, need_labels=True)
        local, labels = shard_hf_batch(batch, self.pmesh.sp)
        if num_items_in_batch is None:
            num_items_in_batch = count_valid_tokens(labels, self.pmesh.loss)
        steps = getattr(self, "current_gradient_accumulation_steps", 1) if lm.training else 1
        lm.aux_loss_weight = 1.0 / max(1, steps)  # the router loss: the mean over the step's micro-batches
        loss = self._forward(batch, local, labels, num_items_in_batch)
        if lm.training:
            loss = inject_nonfinite_loss(self.state.global_step + 1, loss)  # a test hook (runtime/nonfinite.py)
        self.record_batch(batch, inputs, lm)
        return (loss, None) if return_outputs else loss

    def record_batch(self, batch: dict, inputs, lm) -> None:
        """Called after each loss (a hook for a subclass's own metrics)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        # The Trainer logs the mean over processes of what this returns; each returns its
        # share times their number, so the logged value is the global token mean, on every rank.
        return loss * self.pmesh.loss.size()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss of this data-parallel rank's batch (its token mean, as the Trainer reports
        one per batch) and its logits over the whole sequences, on every sp rank."""
        inputs = self._prepare_inputs(inputs)
        lm = self.causal_lm()
        batch = self._sp_inputs(inputs, need_labels=False)
        loss = logits = None
        local, labels = shard_hf_batch(batch, self.pmesh.sp)
        with torch.no_grad():
            lm.aux_loss_weight = 0.0  # the router loss regularises training; eval reports cross entropy
            if "labels" in batch:
                share = self._forward(batch, local, labels, count_valid_tokens(labels, self.pmesh.sp))
                loss = global_loss(share, self.pmesh.sp)
            if not prediction_loss_only:
                logits = gather_sequence(self._forward(batch, local), self.pmesh.sp.get_group(), self.pmesh.dims.sp,
                                         self.pmesh.dims.ring, batch["input_ids"].shape[1])
        # No backward follows: reshard, or an optimizer built next (evaluate() before
        # train()) would hold the gathered head instead of its shards, and never train it.
        reset_fsdp(self.model)
        return loss, logits, (inputs.get("labels") if "labels" in batch else None)

    # -- saving and resuming -----------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained`` directory (a peft adapter for a peft model); every rank calls it."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        check_finite_state(self.model, None, what=f"the model in {output_dir}")  # never NaN / inf weights
        if _is_peft(self.model):
            save_peft_adapter(self.model, output_dir)
        else:
            save_full_model(self._sp_model, output_dir)
        if self.args.should_save:  # what the Trainer's own save writes beside the model
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        dist.barrier()  # the directory is complete for every rank

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_training_state(self.model, self.optimizer, output_dir, with_params=_is_peft(self.model))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_model(self.model, self._sp_model, resume_from_checkpoint, peft=_is_peft(self.model))

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if not has_training_state(checkpoint):
            logger.warning("%s has no %s/ (save_only_model?): the optimizer and scheduler start afresh", checkpoint,
                           STATE_DIR)
            return
        load_optimizer(self.model, self.optimizer, checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


class UlyssesHFTrainer(UlyssesTrainerMixin, Trainer):
    """transformers' ``Trainer`` with Ulysses SP, FSDP2 / HSDP and the memory switches
    (``ulysses_args=UlyssesArguments(...)``); everything else is the Trainer's."""


def __getattr__(name: str):
    if name == "UlyssesTrainer":  # the old name (issue 53), for one release
        warnings.warn(f"{__name__}.UlyssesTrainer is deprecated: use UlyssesHFTrainer (the same class)",
                      DeprecationWarning, stacklevel=2)
        return UlyssesHFTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
