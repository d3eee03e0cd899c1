"""Checks of a trainer configuration, all before any process group, folder or model.

* :func:`check_values`: ranges, and settings that cannot take effect
  (:mod:`.config_effects`);
* :func:`validate_config`: the config against the world size, the model and the
  data files;
* :func:`check_offload_dir`: ``memory.offload_dir`` usable and roomy enough (the trainer
  calls it before step 1; not the planner, which touches no disk).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..data import (
    DATA_SUFFIXES,
    TOKENIZERS_EXTRA_MSG,
    data_files,
    data_suffix,
    is_store,
)
from ..runtime.suggest import did_you_mean
from .config_effects import EFFECT_RULES, EffectRule, check_effect
from .config_schema import AUTO, ConfigError, JobConfig
from .data_config import check_data_values, data_path_problem
from .hf_start import check_hf_weights, tokenizer_spec
from .mesh_fit import check_local_batch, fit_to_world
from .model_shape import model_args

__all__ = ["check_values", "validate_config", "model_args", "check_eval_data", "check_offload_dir",
           "WANDB_MISSING_MSG"]

WANDB_MISSING_MSG = ("metrics.enable_wandb=true needs the 'wandb' package, which is not installed: "
                     "pip install 'ulysses-dtensor[wandb]' (or pip install wandb), or set metrics.enable_wandb=false")


# --------------------------------------------------------------------------- #
# Values
# --------------------------------------------------------------------------- #


def check_values(cfg: JobConfig) -> None:
    """Range checks and settings without effect; needs no world size, model or file."""
    tr = cfg.training

    def positive(key: str, value, minimum=1):
        if value < minimum:
            raise ConfigError(f"{key}={value} must be >= {minimum}")

    positive("training.steps", tr.steps)
    positive("training.seq_len", tr.seq_len)
    positive("training.global_batch_size", tr.global_batch_size)
    positive("training.tokens_per_step", tr.tokens_per_step, 0)
    positive("training.micro_batch_size", tr.micro_batch_size, 0)
    positive("training.max_norm", tr.max_norm, 0)
    positive("training.max_nonfinite_steps", tr.max_nonfinite_steps, 0)
    positive("checkpoint.interval", cfg.checkpoint.interval)
    positive("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, 0)
    positive("metrics.log_freq", cfg.metrics.log_freq)
    positive("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
    positive("comm.train_timeout_seconds", cfg.comm.train_timeout_seconds)
    positive("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, 0)
    positive("model.vocab_multiple_of", cfg.model.vocab_multiple_of)
    positive("parallelism.ring", cfg.parallelism.ring)
    positive("parallelism.tp", cfg.parallelism.tp)
    if cfg.parallelism.sp != AUTO:
        positive("parallelism.sp", cfg.parallelism.sp)
    check_local_batch(cfg)
    if not 0.0 <= cfg.lr_scheduler.min_lr_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_ratio={cfg.lr_scheduler.min_lr_ratio} must be in [0, 1]")
    if len(cfg.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optimizer.betas):
        raise ConfigError(f"optimizer.betas={cfg.optimizer.betas} must be two numbers in [0, 1)")
    if cfg.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr} must be > 0")
    sel = cfg.activation_checkpoint.selective
    if sel != "op" and not (sel.isdigit() and int(sel) >= 1):
        raise ConfigError(
            f"activation_checkpoint.selective={sel!r}; valid: 'op' or a layer interval "
            f"like '2'"
        )
    positive("memory.mlp_tiles", cfg.memory.mlp_tiles, 0)
    positive("memory.loss_chunks", cfg.memory.loss_chunks, 0)
    positive("memory.head_chunks", cfg.memory.head_chunks, 0)
    if cfg.memory.offload_activations and cfg.activation_checkpoint.mode != "full":
        raise ConfigError(
            f"memory.offload_activations=true needs activation_checkpoint.mode='full' "
            f"(got {cfg.activation_checkpoint.mode!r}): it offloads the block inputs that "
            f"full checkpointing keeps"
        )
    if cfg.activation_checkpoint.save_attention and cfg.activation_checkpoint.mode != "full":
        raise ConfigError(
            f"activation_checkpoint.save_attention=true needs activation_checkpoint.mode='full' "
            f"(got {cfg.activation_checkpoint.mode!r}): it keeps the attention outputs that full checkpointing "
            f"would recompute. Set mode='full', or save_attention=false (mode='selective' with selective='op' "
            f"keeps them already)"
        )
    if not cfg.job.dump_folder:
        raise ConfigError("job.dump_folder must not be empty")
    if Path(cfg.checkpoint.folder).is_absolute() or ".." in Path(cfg.checkpoint.folder).parts:
        raise ConfigError(
            f"checkpoint.folder={cfg.checkpoint.folder!r} must be a relative path inside "
            f"job.dump_folder"
        )
    _check_lora_values(cfg)
    if cfg.data.max_corpus_mb <= 0:
        raise ConfigError(f"data.max_corpus_mb={cfg.data.max_corpus_mb} must be > 0")
    check_data_values(cfg)
    _check_eval_values(cfg)
    check_effect(cfg, EFFECT_RULES)
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING_MSG)
    cfg.context_schedule()  # stage order and tokens_per_step divisibility


def _check_lora_values(cfg: JobConfig) -> None:
    lo = cfg.lora
    if lo.rank < 0:
        raise ConfigError(f"lora.rank={lo.rank} must be >= 0 (0: no adapters, every weight trained)")
    if not lo.rank:
        return
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha={lo.alpha} must be > 0")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout={lo.dropout} must be in [0, 1)")
    if not lo.target_modules:
        raise ConfigError("lora.target_modules=[] names no module: give the Linear layers to adapt, e.g. "
                          "['q_proj', 'v_proj']")
    if cfg.parallelism.tp > 1:
        raise ConfigError(
            f"{cfg.describe('lora.rank')} with {cfg.describe('parallelism.tp')}: LoRA adapters are not "
            f"tensor-parallel here (peft's LoRA layer wraps each projection, and tp's column / row-wise split "
            f"would have to split its A and B matrices with it); set parallelism.tp = 1 (dp_shard and sp then "
            f"shard the frozen base and split the sequence), or lora.rank = 0 to train every weight under tp")
    if not cfg.model.hf_path:
        raise ConfigError(
            f"{cfg.describe('lora.rank')} adapts a pretrained model: set model.hf_path (a random base, "
            f"model.flavor={cfg.model.flavor!r}, is only its seed: nothing to adapt, nothing to export)")


def _check_eval_values(cfg: JobConfig) -> None:
    from .config_schema import EVAL_TASKS

    ev = cfg.eval
    for key, minimum in (("interval", 0), ("depths", 1), ("samples", 1), ("loss_rows", 1)):
        if getattr(ev, key) < minimum:
            raise ConfigError(f"eval.{key}={getattr(ev, key)} must be >= {minimum}")
    bad = [t for t in ev.tasks if t not in EVAL_TASKS]
    if bad or not ev.tasks or len(set(ev.tasks)) != len(ev.tasks):
        raise ConfigError(
            f"eval.tasks={ev.tasks} must be distinct names among {', '.join(EVAL_TASKS)}"
            + (did_you_mean(bad[0], EVAL_TASKS, cutoff=0.5) if bad else "")
        )
    bad_len = [n for n in ev.lengths if n < 2]
    if bad_len:
        raise ConfigError(f"eval.lengths={ev.lengths}: every length must be >= 2 tokens")
    if not 0.0 <= ev.holdout_fraction < 1.0:
        raise ConfigError(f"eval.holdout_fraction={ev.holdout_fraction} must be in [0, 1)")
    if ev.data_path and ev.holdout_fraction:
        raise ConfigError(
            f"{cfg.describe('eval.data_path')} and {cfg.describe('eval.holdout_fraction')} both "
            f"name held-out documents; give one"
        )


# --------------------------------------------------------------------------- #
# Against the world, the model and the data
# --------------------------------------------------------------------------- #


def validate_config(cfg: JobConfig, world_size: int, *, weights: bool = True):
    """Check everything that can be checked before training; return the ParallelDims.

    Raises ConfigError. Touches no folder and starts no process group.
    ``weights=False`` (the memory planner): a transformers model's directory needs
    its config.json only, not its safetensors.
    """
    from ..parallel.mesh import ParallelDims

    fit_to_world(cfg, world_size)  # "auto" sizes -> numbers, before anything reads them
    par = cfg.parallelism
    try:
        dims = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size, ring=par.ring, tp=par.tp)
    except ValueError as e:
        raise ConfigError(f"parallelism: {e}") from None
    _check_float8(cfg, dims)

    schedule = cfg.context_schedule()
    try:
        schedule.validate(sp=dims.sp, dp=dims.dp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_micro_batch(cfg, schedule, dims.dp)
    _check_ring(cfg, schedule, dims)

    _check_data(cfg)
    if cfg.eval.interval:
        check_eval_data(cfg)
    if cfg.metrics.enable_tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "metrics.enable_tensorboard=true needs the 'tensorboard' package: "
                "pip install 'ulysses-dtensor[tensorboard]'"
            ) from None
    from .hf_model import check_transformers_model, uses_transformers

    if uses_transformers(cfg):  # the model class itself, through the integration's checks
        check_transformers_model(cfg, dims, weights=weights)
        return dims
    args = model_args(cfg, vocab_size=cfg.model.vocab_size or 256)
    if cfg.model.hf_path and weights:
        check_hf_weights(cfg)
    from .rope_stages import stage_ropes

    stage_ropes(cfg, args)  # every stage's rope_theta / rope_scaling (ConfigError)
    from ..parallel.tensor_parallel import check_tp_heads
    from ..parallel.ulysses import check_chunks_for_heads, kv_replication

    model = f"model.hf_path={cfg.model.hf_path!r}" if cfg.model.hf_path else f"model.flavor={cfg.model.flavor!r}"
    if dims.tp > 1:
        try:
            check_tp_heads(args.n_heads, args.n_kv_heads or args.n_heads, dims.tp, dims.ulysses, model)
        except ValueError as e:
            raise ConfigError(f"parallelism.tp={dims.tp}: {e}") from None
        return dims
    try:
        kv_replication(args.n_heads, args.n_kv_heads or args.n_heads, dims.ulysses)
    except ValueError as e:
        if dims.ring == 1:
            where = f"parallelism.sp={dims.sp}"
            hint = "; parallelism.ring > 1 splits sp into ring x ulysses, and only ulysses must suit the heads"
        else:
            where = f"ulysses = parallelism.sp / parallelism.ring = {dims.sp} / {dims.ring} = {dims.ulysses}"
            hint = " (sp here is the ulysses degree)"
        raise ConfigError(f"{model} with {where}: {e}{hint}") from None
    try:
        check_chunks_for_heads(cfg.memory.head_chunks or None, args.n_heads, args.n_kv_heads or args.n_heads,
                               dims.ulysses, "memory.head_chunks")
    except ValueError as e:
        raise ConfigError(f"{e} ({model} on ulysses {dims.ulysses})") from None
    if cfg.lora.rank:  # the adapters' targets, on the model built on meta
        import torch

        from ..models.llama import Llama
        from .lora_setup import check_lora_model

        with torch.device("meta"):
            check_lora_model(cfg, Llama(args), native=True)
    return dims


def _check_float8(cfg: JobConfig, dims) -> None:
    """[float8]: its options, torchao present, no tensor parallelism (the device is checked at build)."""
    if not cfg.float8.enable:
        return
    from ..precision.float8 import FLOAT8_EXTRA_MSG
    from .float8_config import float8_options

    float8_options(cfg)  # the recipe and its options (ConfigError)
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"float8.enable=true: {FLOAT8_EXTRA_MSG}")
    if dims.tp > 1:
        raise ConfigError(f"float8.enable=true with parallelism.tp={dims.tp}: FP8 linear layers are not combined "
                          f"with tensor parallelism here; use sp (and dp) instead, or float8.enable=false")


def _check_ring(cfg: JobConfig, schedule, dims) -> None:
    """Ring attention: sequence lengths its layout can split, a backend it can run."""
    if dims.ring == 1:
        return
    from ..parallel.ring import RING_BACKENDS
    from ..parallel.ring_layout import seq_multiple

    unit = seq_multiple(dims.sp, dims.ring)
    for i, st in enumerate(schedule.stages):
        if st.seq_len % unit:
            raise ConfigError(
                f"{schedule.key(i)}={st.seq_len} (stage from step {st.start_step}) must be a "
                f"multiple of lcm(sp={dims.sp}, 2*ring={2 * dims.ring}) = {unit} with "
                f"parallelism.ring={dims.ring}: the ring's load-balanced layout cuts each sequence "
                f"into 2*ring chunks (e.g. {max(unit, st.seq_len // unit * unit)})"
            )
    if cfg.training.compile:
        raise ConfigError(
            f"training.compile=true with parallelism.ring={dims.ring}: ring attention reads the "
            f"packed documents' edges to the host once per batch, which a fullgraph-compiled block "
            f"cannot do; set training.compile=false (or parallelism.ring=1)"
        )
    if cfg.model.attn_backend not in RING_BACKENDS:
        raise ConfigError(
            f"model.attn_backend={cfg.model.attn_backend!r} cannot run inside ring attention "
            f"(parallelism.ring={dims.ring}): the ring merges blocks by the log-sum-exp of SDPA's "
            f"kernels; valid: {', '.join(RING_BACKENDS)}"
        )


def check_attention_kernel(backend: str, args, device, dtype) -> None:
    """A named backend whose kernel cannot take this run's attention tensors (the
    device, the compute dtype, the head dims: ``args.head_dim`` and MLA's
    ``v_head_dim``), or that this machine cannot run (cuDNN's version, the
    flash-attn-4 package), is refused here, before any step; ``auto`` picks one that can."""
    import torch

    from ..attention.kernel_table import Case
    from ..attention.planning import PlannedKernelError, planned_choice, planning_target
    from ..attention.select import backend_refusal

    device = torch.device(device)
    head_dim, v_head_dim = args.head_dim, getattr(args, "v_head_dim", 0) or None
    target = planning_target()
    if target is not None:  # the memory planner: the kernel must run on the GPU planned for
        try:
            planned_choice(backend, Case(dtype, head_dim, v_head_dim), target)
        except PlannedKernelError as e:
            raise ConfigError(f"model.attn_backend={backend!r}: {e}") from None
        return
    why = backend_refusal(backend, device, dtype, head_dim, v_head_dim)
    if why:
        dims = head_dim if v_head_dim in (None, head_dim) else f"{head_dim}, v {v_head_dim}"
        raise ConfigError(
            f"model.attn_backend={backend!r} (head dim {dims}, {dtype} on {device.type}; the dtype is "
            f"training.mixed_precision_param's) {why}"
        )


def _check_micro_batch(cfg: JobConfig, schedule, dp: int) -> None:
    micro = cfg.training.micro_batch_size
    if not micro:
        return
    largest = max(schedule.batch_for(st.seq_len) // dp for st in schedule.stages)
    rule = EffectRule(
        "training.micro_batch_size",
        ("training.global_batch_size", "training.tokens_per_step", "parallelism.dp_shard",
         "parallelism.dp_replicate"),
        lambda c: micro < largest,
        f"it splits each dp rank's sequences into passes, and each rank gets at most "
        f"{largest} per step (global batch / {dp} data-parallel streams)",
    )
    check_effect(cfg, [rule])


def _check_data(cfg: JobConfig) -> None:
    """The data and tokenizer files exist; their contents are checked by ``data_checks``."""
    d = cfg.data
    paths = [("data.path", d.path)] if d.path else []
    paths += [(f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)]
    has_records = False
    for key, path in paths:
        problem = data_path_problem(path)
        if problem:
            raise ConfigError(
                f"{key}={path!r} {problem}; give a token store (python -m ulysses_dtensor.prepare_data), "
                f"a data file ({', '.join(DATA_SUFFIXES)}) or a directory of them"
                + (", or '' for the built-in corpus" if key == "data.path" else "")
            )
        if not is_store(path):
            has_records |= any(data_suffix(f) != ".txt" for f in data_files(path))
    check_effect(cfg, [EffectRule(
        "data.text_key", ("data.path", "data.sources"), lambda c: has_records,
        "it names the text field of .jsonl records / table columns, and the data has no such file "
        "(a token store was tokenized when it was prepared)",
    )])
    spec = tokenizer_spec(cfg)  # data.tokenizer, or model.hf_path's tokenizer.json
    if spec != "byte":
        tok = Path(spec)
        if not tok.is_file():
            raise ConfigError(
                f"data.tokenizer={spec!r}: no such file; valid: 'byte' or the path "
                f"of an HF tokenizer.json"
            )
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ConfigError(TOKENIZERS_EXTRA_MSG.format(path=spec)) from None



def check_eval_data(cfg: JobConfig) -> None:
    """The held-out documents of ``[eval]`` exist (before the trainer or the eval entry
    point starts). The retrieval tasks need none: they are generated."""
    ev = cfg.eval
    if "loss" not in ev.tasks:
        return
    if not ev.data_path and not ev.holdout_fraction:
        raise ConfigError(
            f"eval.tasks={ev.tasks} has 'loss', which needs held-out documents: set eval.data_path "
            f"(files training never reads) or eval.holdout_fraction (a share of data.path's "
            f"documents that training then skips), or drop 'loss' from eval.tasks"
        )
    if ev.data_path:
        p = Path(ev.data_path)
        if data_path_problem(ev.data_path):
            raise ConfigError(
                f"eval.data_path={ev.data_path!r} is not a {' / '.join(DATA_SUFFIXES)} file, a "
                f"directory holding one, or a token store"
            )
        if cfg.data.path and Path(cfg.data.path).resolve() == p.resolve():
            raise ConfigError(
                f"eval.data_path={ev.data_path!r} is data.path itself: training reads every one of "
                f"its documents; give other files, or eval.holdout_fraction to split data.path"
            )


def check_offload_dir(cfg: JobConfig, dims, vocab_size: int) -> None:
    """With ``memory.offload_dir``: refuse (ConfigError, one message naming the key, the bytes
    needed and the bytes free) a directory that is missing, not one, where no file can be
    made, or without room for the offloaded activations of every rank of this node at the
    longest stage (:func:`~.memory_banner.offload_disk_plan`). Makes and drops one unlinked
    file there."""
    mem = cfg.memory
    if not (mem.offload_activations and mem.offload_dir):
        return
    from ..memory.offload_dir import OffloadDirError
    from ..memory.offload_dir import check_offload_dir as check_directory
    from .memory_banner import offload_disk_plan

    _, per_rank = offload_disk_plan(cfg, model_args(cfg, vocab_size), cfg.context_schedule(), dims)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks of this node share the directory
    try:
        check_directory(mem.offload_dir, per_rank * ranks, key="memory.offload_dir")
    except OffloadDirError as e:
        share = f" ({per_rank:,} bytes per rank x {ranks} ranks on this node)" if ranks > 1 else ""
        raise ConfigError(f"{e}{share}") from None
