"""torchtitan's Trainer with Ulysses: its Config gains ``ulysses``, its batch step shards over sp.

Where Ulysses lives in torchtitan's mesh: on the ``cp`` axis of its
``ParallelDims``, built with ``cp = ulysses.degree``. torchtitan's meshes then
treat the sp ranks exactly as our design wants: the data-loading mesh
(``batch``) leaves them out, so the sp ranks of a group read the same sample;
the loss mesh and the FSDP mesh (``fsdp = dp_shard x cp``) include them, so the
loss is reduced over every rank and parameters are sharded over
``dp_shard x sp``; its throughput figures divide by the cp degree. None of
torchtitan's own context parallelism runs: the parallelize function is ours
(:mod:`.parallelize`), and so is the batch step (:mod:`.sp_batch`), here and in
the validator. ``parallelism.context_parallel_degree`` therefore stays 1.

Metrics: torchtitan's, except its max loss, which the plug-in takes over whole
samples (the sp ranks of a group add their loss sums first; see :mod:`.metrics_processor`).

Extension points used (nothing inside torchtitan is patched): a ``Trainer``
subclass with its nested ``Config``, ``ModelSpec.parallelize_fn`` replaced with
``dataclasses.replace``, a ``Validator`` subclass, and the override registry
for the inner attention.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ulysses_dtensor.attention import BACKENDS
from ulysses_dtensor.parallel.mesh import divisors
from ulysses_dtensor.runtime.suggest import unknown_name

from ._torch_compat import ensure_microbatch_step, ensure_set_timeout
from .attention import OVERRIDE_TARGET
from .metrics_processor import UlyssesMetricsProcessor, max_loss_config
from .parallelize import check_parallelism, ulysses_model_spec
from .sp_batch import shard_for_sp

__all__ = [
    "ATTENTION_BACKENDS",
    "UlyssesConfig",
    "UlyssesTorchtitanTrainer",
    "UlyssesValidator",
    "prepare_config",
    "validate_ulysses",
]

# "model" keeps the model's own inner attention (torchtitan's flex / varlen / sdpa).
ATTENTION_BACKENDS = ("model", *BACKENDS)


@dataclass(kw_only=True, slots=True)
class UlyssesConfig:
    degree: int = 1
    """Ulysses sequence-parallel degree: ranks that share one sample (1 = off). Must divide the heads
    (the heads / tp of a tp rank under tensor parallelism)."""

    attention_backend: str = "auto"
    """Inner attention run on the full sequence: auto, sdpa, flex, varlen, flash_attn (ours, packed
    documents as global document ids), or 'model' to keep the model's own (torchtitan's)."""

    pack_qkv: bool = False
    """Send q, k and v in one all-to-all instead of three."""

    def __post_init__(self):
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"ulysses.degree={self.degree!r} must be an integer >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(unknown_name("ulysses.attention_backend", self.attention_backend, ATTENTION_BACKENDS))


def _parallelism_defaults() -> ParallelismConfig:
    # The path our parallelize function runs, and no load balancer: Ulysses
    # slices the sequence contiguously and needs none.
    return ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None)


def _training_defaults() -> TrainingConfig:
    return TrainingConfig(disable_cuda_graphs=True)


def validate_ulysses(config: "UlyssesTorchtitanTrainer.Config") -> None:
    """Reject torchtitan settings that conflict with Ulysses, each with one clear message."""
    sp = config.ulysses.degree
    p = config.parallelism
    if p.context_parallel_degree > 1:
        raise ValueError(
            f"parallelism.context_parallel_degree={p.context_parallel_degree} cannot be combined "
            f"with Ulysses (ulysses.degree={sp}): torchtitan's context parallelism and ours "
            "split the same sequence; set parallelism.context_parallel_degree=1 and use "
            "ulysses.degree for the sequence split"
        )
    if p.context_parallel_load_balancer is not None:
        raise ValueError(
            f"parallelism.context_parallel_load_balancer={p.context_parallel_load_balancer!r}: "
            "Ulysses keeps contiguous sequence slices (every rank attends over the whole "
            "sequence, so there is nothing to balance); set it to None"
        )
    if p.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend={p.spmd_backend!r}: the Ulysses plug-in runs torchtitan's "
            "'partial_dtensor' path; set parallelism.spmd_backend='partial_dtensor'"
        )
    if not config.training.disable_cuda_graphs:
        raise ValueError(
            "training.disable_cuda_graphs=False: CUDA graphs capture the whole forward and "
            "backward once, but the Ulysses inner attention reads each batch's packed-document "
            "lengths (flash_attn, varlen) and is not validated under capture yet; set "
            "training.disable_cuda_graphs=True"
        )
    targets = [e if isinstance(e, str) else e[0] for e in config.override.imports]
    if OVERRIDE_TARGET in targets:
        raise ValueError(
            f"override.imports lists {OVERRIDE_TARGET}, which UlyssesTorchtitanTrainer activates itself; "
            "remove it and choose the backend with ulysses.attention_backend"
        )
    tp = p.tensor_parallel_degree
    if config.model_spec is not None:
        check_parallelism(config.model_spec.model, sp=sp, tp=tp, ep=p.expert_parallel_degree)
    seq_len = config.training.seq_len
    # torchtitan's own check, on its cp axis (which carries the Ulysses split) and, with its
    # sequence parallelism, on tp; made here, named in our terms, before anything starts
    factors = [f"2 * ulysses.degree = {2 * sp}"] if sp > 1 else []
    if tp > 1 and p.enable_sequence_parallel:
        factors.append(f"parallelism.tensor_parallel_degree = {tp} (sequence parallelism)")
    divisor = (2 * sp if sp > 1 else 1) * (tp if p.enable_sequence_parallel else 1)
    if seq_len % divisor:
        product = factors[0] if len(factors) == 1 else f"({') x ('.join(factors)}) = {divisor}"
        below, above = seq_len // divisor * divisor, -(-seq_len // divisor) * divisor
        raise ValueError(
            f"training.seq_len={seq_len} must be divisible by {product}: e.g. "
            f"{f'{below} or ' if below else ''}{above}"
        )
    if isinstance(config.loss, ChunkedLossWrapper.Config) and (seq_len // sp) % config.loss.num_chunks:
        raise ValueError(
            f"loss.num_chunks={config.loss.num_chunks} must divide the per-rank sequence length "
            f"training.seq_len / ulysses.degree = {seq_len // sp}; valid: {divisors(seq_len // sp)}"
        )


def prepare_config(config: "UlyssesTorchtitanTrainer.Config") -> None:
    """What UlyssesTorchtitanTrainer changes before torchtitan's Trainer builds anything.

    Our parallelize function goes into the model spec; our inner attention is
    requested through torchtitan's override registry, which ``Trainer.__init__``
    applies to the config tree before the model is built.
    """
    config.model_spec = ulysses_model_spec(config.model_spec, pack_qkv=config.ulysses.pack_qkv)
    config.metrics = max_loss_config(config.metrics)
    imports = [e if isinstance(e, str) else e[0] for e in config.override.imports]
    if config.ulysses.attention_backend != "model" and OVERRIDE_TARGET not in imports:
        config.override.imports = [
            *config.override.imports,
            (OVERRIDE_TARGET, {"backend": config.ulysses.attention_backend}),
        ]


class UlyssesValidator(Validator):
    """torchtitan's Validator with the Ulysses batch step (no context-parallel sharding)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, model_parts: list
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        inputs, labels, extra, _ = shard_for_sp(
            input_dict["input"], labels, extra,
            model=model_parts[0], sp_mesh=self.parallel_dims.get_optional_mesh("cp"),
            tp_size=self.parallel_dims.tp,
        )
        return inputs, labels, extra


class UlyssesTorchtitanTrainer(Trainer):
    """torchtitan's Trainer with Ulysses sequence parallelism on its ``cp`` mesh axis."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        ulysses: UlyssesConfig = field(default_factory=UlyssesConfig)
        parallelism: ParallelismConfig = field(default_factory=_parallelism_defaults)
        training: TrainingConfig = field(default_factory=_training_defaults)
        validator: UlyssesValidator.Config = field(default_factory=UlyssesValidator.Config)
        metrics: UlyssesMetricsProcessor.Config = field(default_factory=UlyssesMetricsProcessor.Config)

        def __post_init__(self):
            Trainer.Config.__post_init__(self)  # slots dataclasses: no zero-arg super()
            validate_ulysses(self)

    def __init__(self, config: Config):
        prepare_config(config)
        if ensure_set_timeout():
            logger.info("torch.distributed.set_timeout (torch > 2.13) provided from torch's _set_pg_timeout")
        super().__init__(config)
        if self.parallel_dims.pp_enabled and ensure_microbatch_step(self.pp_schedule):
            logger.info("pipeline schedule: step(arg_mbs=...) (torch > 2.13) provided from its _step_microbatches")

    def init_distributed(self) -> ParallelDims:
        config = self.config
        world_size = dist_utils.init_distributed(
            config.comm,
            enable_cpu_backend=config.training.enable_cpu_offload,
            base_folder=config.dump_folder,
        )
        p, sp = config.parallelism, config.ulysses.degree
        dp_replicate, dp_shard = p.data_parallel_replicate_degree, p.data_parallel_shard_degree
        tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
        fixed = dp_replicate * sp * tp * pp * (dp_shard if dp_shard > 0 else 1)
        if world_size % fixed or (dp_shard > 0 and fixed != world_size):
            others = "".join(f" x {name}={d}" for name, d in (
                ("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp)) if d > 1)
            raise ValueError(
                f"world size {world_size} does not fit data_parallel_replicate_degree={dp_replicate} "
                f"x data_parallel_shard_degree={dp_shard} x ulysses.degree={sp}{others}; with "
                f"data_parallel_shard_degree=-1, their product without it must divide {world_size}: "
                f"{divisors(world_size)}"
            )
        logger.info(f"Ulysses sequence parallel degree {sp} (on torchtitan's cp mesh axis)")
        return ParallelDims(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            cp=sp,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            world_size=world_size,
            spmd_backend=p.spmd_backend,
        )

    def train_step(self, data_iterator) -> None:
        self.metrics_processor.sample_losses.reset()
        super().train_step(data_iterator)

    def forward_backward_step(
        self, *, input_dict: dict[str, torch.Tensor], labels: torch.Tensor, global_valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        # labels: this data rank's rows before the sp split (the max loss counts them); under
        # pipeline parallelism its micro-batches, and only the last stage holds the loss.
        if not self.parallel_dims.pp_enabled or self.pp_has_last_stage:
            self.metrics_processor.sample_losses.add(loss, labels, global_valid_tokens)
        return loss

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        inputs, labels, extra, real_tokens = shard_for_sp(
            input_dict["input"], labels, extra,
            model=self.model_parts[0], sp_mesh=self.parallel_dims.get_optional_mesh("cp"),
            tp_size=self.parallel_dims.tp,
        )
        # This rank's own tokens, as torchtitan counts after its CP split.
        self.ntokens_seen += real_tokens
        return inputs, labels, extra


def __getattr__(name: str):
    if name == "UlyssesTrainer":  # the old name (issue 53), for one release
        warnings.warn(f"{__name__}.UlyssesTrainer is deprecated: use UlyssesTorchtitanTrainer (the same class)",
                      DeprecationWarning, stacklevel=2)
        return UlyssesTorchtitanTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
