"""``UlyssesArguments``: what a Trainer script adds to its ``TrainingArguments``, and the
TrainingArguments this package cannot honour, refused before anything runs.

The mesh and the memory switches are :class:`UlyssesArguments` (a dataclass, so
``HfArgumentParser((..., TrainingArguments, UlyssesArguments))`` reads them from the
command line like the rest). What ``TrainingArguments`` already says is taken from
there, translated once (:func:`parallelize_options`):

* ``activation_checkpointing`` -> our per-decoder-layer checkpointing (``ac_mode="full"``;
  ``activation_checkpointing_kwargs={"every_n_layers": k}`` -> every k-th layer,
  ``{"offload": True}`` -> inputs kept in host memory);
* TRL's ``activation_offloading`` -> the same host offload (it needs full AC);
* ``torch_compile`` / ``torch_compile_backend`` -> each decoder layer compiled in place;
* ``bf16`` -> FSDP2 mixed precision (bf16 compute, float32 master weights and gradient
  reduction).

Everything else in :func:`check_training_arguments` is refused with one message naming
the argument: it would need the whole sequence on one rank (NEFTune noise scaled by the
local length, label smoothing over local logits), another sharding engine (DeepSpeed,
accelerate's FSDP, ``parallelism_config``), or a loss normalisation the global token
mean cannot give (``average_tokens_across_devices=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ulysses_dtensor.attention.select import BACKENDS
from ulysses_dtensor.memory.options import MemoryOptions
from ulysses_dtensor.precision.float8 import Float8Options

from .refusals import UlyssesTrainerError

__all__ = ["UlyssesArguments", "check_training_arguments", "parallelize_options", "OPTIMIZERS"]

# TrainingArguments.optim values whose update is elementwise per parameter: they run on
# FSDP2's shards exactly as on the whole tensor. Factored or quantized optimizers would
# see a shard's shape (Adafactor's row/column statistics) or need their own kernels.
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_npu_fused", "sgd", "adagrad", "rmsprop")


@dataclass
class UlyssesArguments:
    """The mesh and memory switches of :class:`~.mixin.UlyssesHFTrainer` (defaults: plain FSDP2)."""

    sp_size: int = field(default=1, metadata={
        "help": "Sequence-parallel degree: the ranks that split one sequence (Ulysses, and the ring past the head "
                "count with ring_size). Every sp rank of a group reads the same samples."})
    ring_size: int = field(default=1, metadata={
        "help": "Ring-attention degree inside sp (USP: sp = ring x ulysses), for an sp larger than the kv-head count "
                "allows; causal attention without windows, soft-caps or sinks."})
    dp_replicate_size: int = field(default=1, metadata={
        "help": "HSDP replicas: parameters are replicated over these and sharded over dp_shard x sp."})
    dp_shard_size: int = field(default=-1, metadata={
        "help": "FSDP2 data-parallel shards; -1 takes what the world size leaves."})
    attn_backend: str = field(default="auto", metadata={
        "help": f"Local attention kernel after the exchange: one of {', '.join(BACKENDS)}."})
    pack_qkv: bool = field(default=False, metadata={"help": "One all-to-all for q, k and v together."})
    tiled_mlp: bool = field(default=False, metadata={
        "help": "Run each decoder layer's MLP (or MoE block) over tiles of the tokens, recomputed in backward."})
    mlp_tiles: int | None = field(default=None, metadata={"help": "Tiles for tiled_mlp (default: from the shapes)."})
    loss_chunks: int | None = field(default=1, metadata={
        "help": "Compute the head and the loss over this many sequence chunks, each recomputed in backward (tiled "
                "loss); 1: at once. Set 0 for a count from the shapes."})
    head_chunks: int | None = field(default=None, metadata={
        "help": "Run the Ulysses exchange and attention over this many chunks of a rank's heads, forward and "
                "backward (None or 0: one query head per chunk at long context, else none; 1: none)."})
    offload_activations: bool = field(default=False, metadata={
        "help": "Keep each checkpointed decoder layer's input in pinned host memory until backward (implies full "
                "activation checkpointing)."})
    offload_dir: str | None = field(default=None, metadata={
        "help": "With offload_activations: a directory on a local disk (NVMe) the offloaded layer inputs go to, "
                "through a bounded pinned staging area (None: host memory only)."})
    offload_params: bool = field(default=False, metadata={
        "help": "FSDP2 CPU offload: parameter shards, gradients and optimizer state in host memory."})
    save_attention: bool = field(default=False, metadata={
        "help": "With full activation checkpointing, keep each layer's attention kernel outputs from forward "
                "instead of recomputing the attention (offloaded with the layer input under offload_activations)."})
    float8: bool = field(default=False, metadata={
        "help": "FP8 linear layers (torchao's float8 training; pip install 'ulysses-dtensor[float8]'): the decoder "
                "layers' matmuls in float8 with dynamic scales; needs a GPU of compute capability 8.9+ or "
                "float8_emulate."})
    float8_recipe: str = field(default="rowwise", metadata={
        "help": "rowwise (a scale per token), rowwise_with_gw_hp (weight gradient in high precision), or tensorwise "
                "(one scale per tensor, its amax reduced over the sp ranks)."})
    float8_filter_fqns: str = field(default="output,lm_head,gate,router", metadata={
        "help": "Comma-separated module names left in high precision (a dotted part of the name, or a prefix)."})
    float8_emulate: bool = field(default=False, metadata={"help": "Emulate FP8 matmuls on any device: tests only."})
    float8_fsdp_all_gather: bool = field(default=False, metadata={
        "help": "FSDP2 all-gathers the weights in FP8 (tensorwise only)."})
    check_batches: bool = field(default=True, metadata={
        "help": "Check, at every batch, that the sp ranks of a group received the same batch (a few integers "
                "exchanged): a dataset or collator that differs per rank would otherwise train on a mix."})
    allow_untested: bool = field(default=False, metadata={
        "help": "Run a model family the family matrix has not measured without the check at start."})
    max_nonfinite_steps: int = field(default=3, metadata={
        "help": "Steps in a row whose loss or gradient norm is NaN or inf that are skipped (no update on any rank, "
                "no checkpoint); the next one stops train() with one message naming the step, the ranks and the "
                "last checkpoint (0: stop at the first)."})

    def __post_init__(self) -> None:
        for name in ("sp_size", "ring_size", "dp_replicate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UlyssesTrainerError(f"UlyssesArguments.{name}={value!r} must be an integer >= 1")
        value = self.max_nonfinite_steps
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UlyssesTrainerError(f"UlyssesArguments.max_nonfinite_steps={value!r} must be an integer >= 0 "
                                      "(0: stop at the first non-finite step)")
        if isinstance(self.dp_shard_size, bool) or not isinstance(self.dp_shard_size, int) or (
                self.dp_shard_size < 1 and self.dp_shard_size != -1):
            raise UlyssesTrainerError(
                f"UlyssesArguments.dp_shard_size={self.dp_shard_size!r} must be an integer >= 1, or -1 "
                "for what the world size leaves")
        if self.sp_size % self.ring_size:
            raise UlyssesTrainerError(f"UlyssesArguments.ring_size={self.ring_size} must divide sp_size={self.sp_size} "
                                      "(sp = ring x ulysses)")
        if self.attn_backend not in BACKENDS:
            raise UlyssesTrainerError(
                f"UlyssesArguments.attn_backend={self.attn_backend!r}; valid: {', '.join(BACKENDS)}")
        if self.head_chunks is not None and (isinstance(self.head_chunks, bool) or not isinstance(self.head_chunks, int)
                                             or self.head_chunks < 0):
            raise UlyssesTrainerError(f"UlyssesArguments.head_chunks={self.head_chunks!r} must be >= 1, or 0 / None "
                                      "for a count from the shapes")
        float8_options(self)  # the FP8 switches' own rules, at construction
        if self.loss_chunks is not None and (isinstance(self.loss_chunks, bool) or self.loss_chunks < 0):
            raise UlyssesTrainerError(
                f"UlyssesArguments.loss_chunks={self.loss_chunks!r} must be >= 1, or 0 / None for a "
                "count from the shapes")


def float8_options(ulysses: UlyssesArguments) -> Float8Options | None:
    """The FP8 switches of ``ulysses`` (None: off); a bad combination is a UlyssesTrainerError."""
    if not ulysses.float8:
        return None
    try:
        return Float8Options(enable=True, recipe_name=ulysses.float8_recipe,
                             filter_fqns=tuple(f.strip() for f in ulysses.float8_filter_fqns.split(",") if f.strip()),
                             emulate=ulysses.float8_emulate,
                             enable_fsdp_float8_all_gather=ulysses.float8_fsdp_all_gather)
    except ValueError as e:
        raise UlyssesTrainerError(f"UlyssesArguments: {e}") from None


def _refusal(args, name: str, value: Any, why: str) -> str:
    return f"{type(args).__name__}.{name}={value!r} is not supported by UlyssesHFTrainer: {why}"


def check_training_arguments(args) -> None:
    """ValueError naming the first TrainingArguments (or TRL config) value this trainer
    cannot honour, and what to use instead; None when every value runs as asked."""
    fsdp = getattr(args, "fsdp", None)
    problems = [
        ("deepspeed", args.deepspeed, bool(args.deepspeed),
         "the model is sharded with FSDP2 over dp_shard x sp here (ZeRO-3's counterpart); remove deepspeed="),
        ("fsdp", fsdp, bool(fsdp),
         "UlyssesHFTrainer applies FSDP2 / HSDP itself (UlyssesArguments.dp_replicate_size / dp_shard_size, "
         "offload_params for CPU offload); remove fsdp= and fsdp_config="),
        ("parallelism_config", args.parallelism_config, args.parallelism_config is not None,
         "the mesh is UlyssesArguments' (ParallelismConfig(sp_size=N, dp_shard_size=M, dp_replicate_size=R) is "
         "UlyssesArguments(sp_size=N, dp_shard_size=M, dp_replicate_size=R)); remove parallelism_config="),
        ("fp16", args.fp16, bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
         "fp16 needs loss scaling over sharded gradients, which this trainer does not do; use bf16=True (FSDP2 "
         "mixed precision with float32 master weights)"),
        ("bf16_full_eval", args.bf16_full_eval, bool(args.bf16_full_eval),
         "evaluation casts the whole model, which FSDP2 shards hold in their own dtype; use bf16=True"),
        ("use_liger_kernel", args.use_liger_kernel, bool(args.use_liger_kernel),
         "Liger replaces the model's forward and loss; the loss here is the sp-sharded token mean (tiled with "
         "UlyssesArguments.loss_chunks)"),
        ("neftune_noise_alpha", args.neftune_noise_alpha, args.neftune_noise_alpha is not None,
         "NEFTune scales its noise by the sequence length, which a rank holding a slice of the sequence does "
         "not see (it needs the whole sequence on a rank)"),
        ("label_smoothing_factor", args.label_smoothing_factor, bool(args.label_smoothing_factor),
         "the loss here is the sp-sharded cross entropy without smoothing"),
        ("average_tokens_across_devices", args.average_tokens_across_devices,
         not args.average_tokens_across_devices,
         "the loss is always the token mean over the whole global batch (every rank and micro-batch), so the "
         "gradient does not depend on how the sequence is split; leave it True"),
        ("optim", args.optim, str(getattr(args.optim, "value", args.optim)) not in OPTIMIZERS,
         f"only optimizers whose update is elementwise run on FSDP2 shards as on whole tensors: "
         f"{', '.join(OPTIMIZERS)} (or optimizer_cls_and_kwargs= with such a torch optimizer)"),
        ("torch_compile_mode", args.torch_compile_mode, args.torch_compile_mode is not None,
         "each decoder layer is compiled in place with torch_compile_backend; a mode is not passed on"),
        ("push_to_hub", args.push_to_hub, bool(args.push_to_hub),
         "saving is collective here; push the saved directory with huggingface_hub afterwards"),
        ("eval_use_gather_object", args.eval_use_gather_object, bool(args.eval_use_gather_object),
         "evaluation outputs are gathered as tensors over the data-parallel ranks"),
        ("train_sampling_strategy", args.train_sampling_strategy, args.train_sampling_strategy == "batch_rebalance",
         "batch_rebalance shards batches over every process, not over the data-parallel ranks; use 'random', "
         "'sequential' or 'group_by_length'"),
        ("auto_find_batch_size", args.auto_find_batch_size, bool(args.auto_find_batch_size),
         "it rebuilds the model wrapping after an out-of-memory error; set per_device_train_batch_size"),
        ("label_names", args.label_names, args.label_names not in (None, ["labels"]),
         "the batch's targets are read from 'labels' (or a collator's 'shift_labels')"),
    ]
    dispatch = getattr(args.accelerator_config, "dispatch_batches", None)
    problems.append(("accelerator_config.dispatch_batches", dispatch, dispatch is True,
                     "one process would read and split every batch over all processes; here each data-parallel "
                     "rank reads its own and its sp ranks read the same"))
    ac_kwargs = dict(args.activation_checkpointing_kwargs or {})
    unknown = sorted(set(ac_kwargs) - {"every_n_layers", "offload", "use_reentrant"})
    problems.append(("activation_checkpointing_kwargs", ac_kwargs, bool(unknown) or ac_kwargs.get("use_reentrant"),
                     "each decoder layer is checkpointed non-reentrantly here; the keys understood are "
                     "every_n_layers, offload and use_reentrant=False"))
    if getattr(args, "n_gpu", 1) > 1:
        problems.append(("n_gpu", args.n_gpu, True, "several GPUs in one process means nn.DataParallel; launch one "
                         "process per GPU with torchrun or accelerate launch"))
    for name, value, bad, why in problems:
        if bad:
            raise UlyssesTrainerError(_refusal(args, name, value, why))


def parallelize_options(args, ulysses: UlyssesArguments, *, mixed_precision: str | None = None,
                        dynamo_backend: str | None = None) -> dict:
    """Keyword arguments of :func:`~ulysses_dtensor.integrations.hf.parallelize_hf_model` for
    these TrainingArguments (the memory switches as one ``memory=MemoryOptions``) (see the module doc for the translation). ``mixed_precision``
    and ``dynamo_backend``: what the accelerator settled on (an ``accelerate launch``
    configuration can set them; ``"no"`` / None: nothing)."""
    ac_kwargs = dict(args.activation_checkpointing_kwargs or {})
    every = ac_kwargs.get("every_n_layers", 1)
    offload = bool(ulysses.offload_activations or ac_kwargs.get("offload") or getattr(args, "activation_offloading",
                                                                                        False))
    if offload:
        ac_mode, selective = "full", "op"  # host offload is of full-AC layers' inputs
    elif args.activation_checkpointing:
        ac_mode, selective = ("full", "op") if every == 1 else ("selective", int(every))
    else:
        ac_mode, selective = "none", "op"
    memory = MemoryOptions(
        ac_mode=ac_mode,
        selective_ac=selective,
        save_attention=ulysses.save_attention,
        tiled_mlp=ulysses.tiled_mlp,
        mlp_tiles=ulysses.mlp_tiles,
        tiled_loss=ulysses.loss_chunks != 1,  # 1: at once; 0 / None: from the shapes; n: n chunks
        loss_chunks=(ulysses.loss_chunks or None) if ulysses.loss_chunks != 1 else None,
        offload_activations=offload,
        offload_dir=ulysses.offload_dir or None,
        offload_params=ulysses.offload_params,
        head_chunks=ulysses.head_chunks or None,
    )
    return dict(
        memory=memory,
        compile=bool(args.torch_compile) or dynamo_backend not in (None, "no"),
        compile_backend=args.torch_compile_backend or (dynamo_backend if dynamo_backend not in (None, "no")
                                                       else "inductor"),
        param_dtype=torch.bfloat16 if args.bf16 or mixed_precision == "bf16" else torch.float32,
        reduce_dtype=torch.float32,
        attn_backend=ulysses.attn_backend,
        pack_qkv=ulysses.pack_qkv,
        allow_untested=ulysses.allow_untested,
        float8=float8_options(ulysses),
    )
