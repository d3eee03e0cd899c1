"""The training loop: config -> mesh -> model -> data -> steps -> metrics, checkpoints.

One step::

    seq_len, B  = context schedule at this step
    rows        = this dp rank's B/dp sequences of the next B*seq_len stream tokens
    shard_batch : shift labels on the full rows, keep this sp rank's slice
    n_valid     = valid labels of the whole global batch (all-reduce over the world)
    loss share  = sum of local token losses / n_valid   (shares sum to the global mean)
    backward (FSDP2 sums gradients), clip, AdamW step with the scheduled lr

Micro-batching (``training.micro_batch_size``) splits a rank's rows into
several forward/backward passes; the shares still divide by the step's global
count, so the update is the same as in one pass.

A step whose loss or gradient norm is not finite on any rank is skipped by every
rank (no update; a metrics row says so and why); ``training.max_nonfinite_steps``
such steps in a row are tolerated, the next stops the run with a
:class:`~ulysses_dtensor.runtime.nonfinite.NonFiniteError` naming the step, the
ranks and the last good checkpoint. No checkpoint is written at a skipped step,
nor from weights or optimizer state that are not finite.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..data import build_tokenizer
from ..data.checks import DataError
from ..models.rope import RopeConfig
from ..parallel.batch import shard_batch
from ..parallel.comm_timing import ExchangeTimer, exchange_metrics
from ..parallel.loss import count_valid_tokens, global_loss
from ..runtime.nonfinite import NonFiniteGuard
from ..runtime.process_group import finish_together
from ..runtime.restarts import restart_store_problem
from .build import build_model, init_distributed, resolve_vocab_size
from .checkpoint import CheckpointManager
from .comm_phases import CommPhases
from .config import (
    JobConfig,
    inactive_settings,
    validate_config,
)
from .config_checks import check_offload_dir
from .data_setup import build_training_data
from .eval_setup import PeriodicEval, check_eval_setup
from .fault_injection import inject_test_fault
from .hf_model import model_info
from .hf_start import tokenizer_spec
from .lora_setup import flops_per_token as lora_flops_per_token
from .lora_setup import uses_lora
from .memory_banner import memory_banner
from .metrics import MetricsLogger
from .rope_stages import (
    global_rope_length,
    rope_args,
    rope_banner,
    rope_row,
    stage_ropes,
    trained_rope_info,
)
from .schedule import LRSchedule
from .step import build_optimizer, train_step

__all__ = ["train"]

def _print0(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def train(cfg: JobConfig) -> list[dict]:
    """Run the job; return the metric rows (on rank 0; empty elsewhere).

    A bad config raises :class:`ConfigError` before any folder or process
    group is created.
    """
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    dims = validate_config(cfg, world)
    tokenizer = build_tokenizer(tokenizer_spec(cfg))
    vocab_size = resolve_vocab_size(cfg, tokenizer.vocab_size)
    check_offload_dir(cfg, dims, vocab_size)  # memory.offload_dir: usable, with room for a step
    data = build_training_data(cfg)  # data.path or data.sources; held-out documents of [eval]
    held_out = data.held_out
    if cfg.eval.interval:
        check_eval_setup(cfg, tokenizer)
    schedule = cfg.context_schedule()
    lr_schedule = LRSchedule(
        cfg.training.steps,
        cfg.lr_scheduler.warmup_steps,
        cfg.lr_scheduler.decay,
        cfg.lr_scheduler.min_lr_ratio,
    )

    # A collective whose peer died or went silent ends the run with one PeerLostError.
    phases = CommPhases(cfg.comm)
    with phases.lost_peer_as_error(), _closed_on_error() as opened:
        device, owns_group = init_distributed(cfg.memory.offload_params, cfg.comm.init_timeout_seconds)
        args = (cfg, dims, device, tokenizer, vocab_size, data, schedule, lr_schedule, held_out, phases, opened)
        if not owns_group:  # a caller's group: leave its lifetime and timeouts to the caller
            return _run(*args)
        phases.sets_timeouts = True
        with finish_together():
            return _run(*args)


@contextlib.contextmanager
def _closed_on_error():
    """A list the run adds closers to (the metrics writers, the loader's thread): called when
    the run ends with an error (a W&B run is then marked failed, the rows so far in it)."""
    closers: list = []
    try:
        yield closers
    except BaseException:
        for close in closers:
            close()
        raise


def _check_data_on_rank0(data, tokenizer, schedule, device) -> None:
    """Rank 0 reads the data once; every rank raises the same DataError if it is unusable."""
    verdict = [None]
    if dist.get_rank() == 0:
        verdict[0] = data.verdict(tokenizer, schedule)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0, device=device if device.type == "cuda" else None)
    if verdict[0] is not None:
        raise DataError(verdict[0])


def _run(cfg, dims, device, tokenizer, vocab_size, data, schedule, lr_schedule, held_out, phases,
         opened: list) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Before anything is built or written: a bad corpus stops the run here.
    _check_data_on_rank0(data, tokenizer, schedule, device)
    torch.manual_seed(cfg.job.seed)
    pmesh = dims.build_mesh(device.type)
    phases.enter("start-up", long=True)  # the mesh's groups get the start-up timeout too

    ckpt = CheckpointManager(
        cfg.checkpoint_folder,
        interval=cfg.checkpoint.interval,
        keep_latest_k=cfg.checkpoint.keep_latest_k,
        enable=cfg.checkpoint.enable,
        trainable_only=uses_lora(cfg),
    )
    latest = ckpt.latest_step() if ckpt.enable else None
    # A resumed run takes its weights from the checkpoint: no init, no HF load. With LoRA
    # the checkpoint holds the adapters only: the base is read from model.hf_path again.
    model = build_model(cfg, pmesh, vocab_size, device, init_weights=latest is None or uses_lora(cfg))
    disk = getattr(getattr(model, "offloader", None), "disk", None)
    if disk is not None:
        disk.key = "memory.offload_dir"  # a disk that fills mid-run is named by the config key
    optimizer = build_optimizer(cfg, model)
    info = model_info(cfg, model.args)
    # Each stage's rope (checked in validate_config); None: a transformers family whose
    # rope cannot change (no stage sets one), config.json's throughout.
    ropes = stage_ropes(cfg, rope_args(model))

    start_step, data_state = 0, None
    if ckpt.enable:
        if latest is not None:
            phases.enter("checkpoint load", long=True)
            state = ckpt.load(latest, model, optimizer)
            data_state = state["data"]
            start_step = int(state["step"])
            saved = state.get("context", {}).get("seq_len")
            if saved is not None and saved != schedule.seq_len(start_step):
                _print0(
                    f"warning: checkpoint step {start_step} trained at seq_len {saved}, this "
                    f"config's schedule says {schedule.seq_len(start_step)}"
                )
            saved_rope = state.get("context", {}).get("rope")
            if ropes is not None and saved_rope is not None and saved_rope != ropes[schedule.stage_index(start_step)].to_dict():
                _print0(
                    f"warning: checkpoint step {start_step} trained with rope "
                    f"{RopeConfig.from_dict(saved_rope).describe()}, this config's schedule says "
                    f"{ropes[schedule.stage_index(start_step)].describe()}"
                )
            _print0(f"resumed from {ckpt.path(latest)} (step {start_step}, "
                    f"{data_state['tokens_seen']} tokens seen)")
    # This rank's rows from the checkpointed position on, read ahead in a thread.
    loader = data.loader(tokenizer, pmesh.dp_rank, dims.dp, schedule, start_step, data_state)
    opened.append(loader.close)  # its thread, when the run fails

    if start_step >= cfg.training.steps:
        _print0(
            f"nothing to train: the checkpoint is at step {start_step} and training.steps="
            f"{cfg.training.steps}; raise training.steps or use another job.dump_folder"
        )
    n_params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # The exchanges' share of step time (eager only: compiled blocks cannot carry the timer).
    timed = cfg.metrics.exchange_timing and dims.sp > 1 and not cfg.training.compile
    timer = ExchangeTimer(device) if timed else None
    restart_note = restart_store_problem()  # several torchrun agents that cannot restart cleanly
    _print0(
        f"{cfg.job.description or 'ulysses_dtensor training'}\n"
        f"  world {world} on {device.type}: dp_replicate={dims.dp_replicate} "
        f"dp_shard={dims.dp_shard} sp={dims.sp}"
        f"{f' (ring {dims.ring} x ulysses {dims.ulysses})' if dims.ring > 1 else ''}"
        f"{f' tp={dims.tp}' if dims.tp > 1 else ''}\n"
        + "".join(f"  fitted to the world: {note}\n" for note in cfg.fitted) +
        f"  model {cfg.model.hf_path or cfg.model.flavor}: {n_params / 1e6:.2f}M params, vocab {vocab_size} "
        f"(tokenizer {tokenizer.vocab_size})\n"
        f"  attention: {_attention_banner(cfg, vocab_size, device)}; {_head_chunks_banner(cfg, vocab_size, dims)}\n"
        f"  implementation {_implementation_banner(cfg)}\n"
        f"  {_checkpointing_banner(cfg)}\n"
        f"  {_memory_banner(cfg, vocab_size, schedule, dims, device)}\n"
        + _family_banner(model) + _mixer_banner(model, device, cfg) +
        f"{_lora_banner(cfg, model, trained, n_params)}"
        + (f"  {model.float8_report.describe()}\n" if getattr(model, "float8_report", None) is not None else "") +
        f"  {data.banner(schedule, loader.source_tokens())}\n  {data.packing_banner()}\n  {data.loading_banner()}\n"
        f"{rope_banner(schedule, ropes) if ropes else '  rope: config.json of model.hf_path, every stage'}\n"
        f"  steps {start_step + 1}..{cfg.training.steps}, dump folder {cfg.dump_folder}\n"
        f"  {_eval_banner(cfg, held_out)}; {_timing_banner(cfg, dims.sp, timer is not None)}\n"
        f"  {_nonfinite_banner(cfg)}"
        + "".join(f"\n  not in effect: {note}" for note in inactive_settings(cfg))
        + (f"\n  warning: {restart_note}" if restart_note else "")
    )
    if rank == 0:
        cfg.dump_folder.mkdir(parents=True, exist_ok=True)
        (cfg.dump_folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    metrics = MetricsLogger(
        cfg.dump_folder,
        rank=rank,
        world_size=world,
        total_steps=cfg.training.steps,
        device=device,
        flops_per_token=lora_flops_per_token(cfg, model),  # a frozen base skips its weight gradients
        log_freq=cfg.metrics.log_freq,
        peak_flops=cfg.metrics.peak_flops,
        enable_tensorboard=cfg.metrics.enable_tensorboard,
        show_progress=cfg.metrics.progress_bar,
        resume_step=start_step,
        # Named after the job's folder; the config attached (rank 0 only starts a run).
        wandb_run=dict(name=cfg.dump_folder.resolve().name, config=cfg.to_dict(), notes=cfg.job.description)
        if cfg.metrics.enable_wandb else None,
    )
    opened.append(lambda: metrics.close(failed=True))

    evaluation = None
    if cfg.eval.interval:
        evaluation = PeriodicEval(cfg, model, pmesh, tokenizer, device, held_out, metrics.tb,
                                  resume_step=start_step)
    recent_step_times: list[float] = []

    rows: list[dict] = []
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.training.max_norm or float("inf")
    guard = NonFiniteGuard(cfg.training.max_nonfinite_steps, "training.max_nonfinite_steps")
    last_saved = latest  # the newest checkpoint written from finite weights (this run's or the one resumed)
    for step in range(start_step + 1, cfg.training.steps + 1):
        # The first step after a (re)start may compile and set up communicators: the long timeout.
        phases.enter("training step", step, long=step == start_step + 1)
        t0 = time.perf_counter()
        seq_len, batch_size = schedule.seq_len(step), schedule.batch_size(step)
        rope = ropes[schedule.stage_index(step)] if ropes else None
        if rope is not None and model.rope != rope:  # a stage boundary, or the first step (resumed too)
            if step > start_step + 1:
                _print0(f"step {step}: rope -> {rope.describe()}")
            model.set_rope(rope)
        batch = loader.batch_for(step)
        local = shard_batch(batch, pmesh.sp, pad=False)
        local = {k: None if v is None else v.to(device) for k, v in local.items()}
        # Valid targets of the whole global batch: every rank divides by it.
        n_valid = count_valid_tokens(local["labels"], pmesh.loss)

        lr = cfg.optimizer.lr * lr_schedule(step)
        if rope is not None and rope.length_dependent:  # dynamic / longrope: L of the whole global batch
            model.rope_seq_len = global_rope_length(local["position_ids"], pmesh.loss)
        with timer.active() if timer is not None else contextlib.nullcontext():
            loss_sum, grad_norm = train_step(
                model,
                optimizer,
                local,
                n_valid,
                micro_batch_size=cfg.training.micro_batch_size,
                max_norm=max_norm,
                lr=lr,
                params=params,
                step=step,
                guard=guard,
            )
        if rope is not None:
            model.rope_seq_len = None  # evaluation forwards take their own batch's length

        loss_value = global_loss(loss_sum, pmesh.loss).item()
        # MoE router load-balancing loss (transformers models, output_router_logits): in loss, and alone.
        aux = model.pop_router_aux_loss() if hasattr(model, "pop_router_aux_loss") else None
        aux_row = {} if aux is None else {"router_aux_loss": global_loss(aux, pmesh.loss).item()}
        grad_norm = float(grad_norm)
        skipped = guard.skipped(step)  # what was not finite, when this step was skipped
        step_time = time.perf_counter() - t0
        recent_step_times.append(step_time)
        row = metrics.log(
            step=step,
            seq_len=seq_len,
            batch_size=batch_size,
            loss=loss_value,
            grad_norm=grad_norm,
            lr=lr,
            tokens_seen=loader.tokens_seen,
            step_tokens=batch_size * seq_len,
            step_time=step_time,
            # Read after the loss was fetched: on CUDA the exchange events are done.
            extra={**(rope_row(rope) if rope is not None else {}), **aux_row, **data.step_metrics(loader),
                   **(exchange_metrics(timer.read(), step_time) if timer is not None else {}),
                   **(skipped.row() if skipped is not None else {})},
        )
        if row is not None:
            rows.append(row)
        if guard.should_stop():
            raise guard.error(_last_checkpoint(cfg, ckpt, last_saved))
        if evaluation is not None and evaluation.due(step):
            phases.enter("evaluation", step, long=True)
            evaluation.run(step, seq_len, step_seconds=statistics.median(recent_step_times))
            recent_step_times.clear()
            dist.barrier()  # rank 0 writes the report and plots: the next step's short timeout starts together

        if ckpt.should_save(step, cfg.training.steps) and skipped is not None:
            # Its weights are the last applied step's, and a run that goes on diverging would
            # rotate the good checkpoints out (checkpoint.keep_latest_k).
            _print0(f"checkpoint of step {step} not written: the step was skipped (non-finite)")
        elif ckpt.should_save(step, cfg.training.steps):
            phases.enter("checkpoint save", step, long=True)
            ckpt.save(
                step,
                model,
                optimizer,
                {
                    "step": step,
                    "data": loader.state_dict(),
                    "context": {
                        "stage": schedule.stage_index(step),
                        "seq_len": seq_len,
                        "batch_size": batch_size,
                        "rope": None if rope is None else rope.to_dict(),
                    },
                    "lr_scheduler": {"step": step, "lr": lr},
                    "tokens_seen": loader.tokens_seen,
                },
                model_info={**info, **(trained_rope_info(schedule, ropes, step) if ropes else {})},
            )
            last_saved = step
            _print0(f"saved checkpoint {ckpt.path(step)}")
        inject_test_fault(step, cfg.dump_folder)  # only with ULYSSES_DTENSOR_TEST_FAULT set (tests)
    phases.enter("the final barrier", long=True)  # ranks finish their last save / eval at different times
    loader.close()
    metrics.close()
    return rows


def _lora_banner(cfg: JobConfig, model, trained: int, total: int) -> str:
    if not uses_lora(cfg):
        return ""
    from ..integrations.lora import adapter_names

    lo = cfg.lora
    modules = len(adapter_names(model)) // 2
    saved = f", modules_to_save {', '.join(lo.modules_to_save)} trained whole" if lo.modules_to_save else ""
    drop = f", dropout {lo.dropout:g}" if lo.dropout else ""
    return (f"  LoRA rank {lo.rank}, alpha {lo.alpha:g}{drop} on {modules} modules ({', '.join(lo.target_modules)})"
            f"{saved}: {trained / 1e6:.3f}M of {total / 1e6:.2f}M parameters trained, the base frozen; "
            f"checkpoints hold the trained ones\n")


def _attention_banner(cfg: JobConfig, vocab_size: int, device: torch.device) -> str:
    """What attention kernel runs and why (the kernel table on this device), and the
    trap when there is one (cuDNN too old, hidden or deprioritized -> FlashAttention-2)."""
    from ..attention.capabilities import Capabilities
    from ..attention.kernel_table import describe_run
    from .build import _DTYPES
    from .config_checks import model_args

    shape = model_args(cfg, vocab_size)
    return describe_run(cfg.model.attn_backend, Capabilities.probe(device),
                        _DTYPES[cfg.training.mixed_precision_param], shape.head_dim,
                        getattr(shape, "v_head_dim", 0) or None)


def _head_chunks_banner(cfg: JobConfig, vocab_size: int, dims) -> str:
    """How many head chunks the exchange runs at the longest stage (parallel/head_chunks.py)."""
    from ..parallel.ulysses import describe_head_chunks
    from .build import _DTYPES
    from .config_checks import model_args

    shape = model_args(cfg, vocab_size)
    seq = cfg.context_schedule().max_seq_len
    heads, kv = shape.n_heads // dims.tp, (getattr(shape, "n_kv_heads", 0) or shape.n_heads) // dims.tp
    dv = getattr(shape, "v_head_dim", 0) or shape.head_dim
    return describe_head_chunks(cfg.memory.head_chunks or None, seq // dims.ring, heads, kv, shape.head_dim, dv,
                                dims.ulysses, _DTYPES[cfg.training.mixed_precision_param].itemsize)


def _implementation_banner(cfg: JobConfig) -> str:
    from .hf_model import resolve_implementation

    impl = resolve_implementation(cfg)
    return f"{impl.name} ({impl.reason})"


def _checkpointing_banner(cfg: JobConfig) -> str:
    ac, mem = cfg.activation_checkpoint, cfg.memory
    if ac.mode == "none":
        return "activation checkpointing off"
    if ac.mode == "selective":
        what = ("op: attention, exchanges and every other matmul saved" if ac.selective == "op"
                else f"one layer in {ac.selective} fully")
        return f"activation checkpointing selective ({what})"
    kept = ("; attention kernel outputs kept from forward, not recomputed (save_attention)"
            if ac.save_attention else "")
    moved = ""
    if mem.offload_activations:
        moved = ("; layer inputs" + (" and kept attention outputs" if ac.save_attention else "")
                 + (" offloaded to disk" if mem.offload_dir else " offloaded to host"))
    return f"activation checkpointing full{kept}{moved}"


def _memory_banner(cfg: JobConfig, vocab_size: int, schedule, dims, device: torch.device) -> str:
    from .config_checks import model_args
    from .hf_model import uses_transformers

    return memory_banner(cfg, model_args(cfg, vocab_size), schedule, dims, device.type,
                         transformers=bool(cfg.model.hf_path) and uses_transformers(cfg))


def _nonfinite_banner(cfg: JobConfig) -> str:
    n = cfg.training.max_nonfinite_steps
    return ("a step with a non-finite loss or gradient norm stops the run (training.max_nonfinite_steps=0)" if n == 0
            else f"steps with a non-finite loss or gradient norm are skipped, {n} in a row at most "
                 f"(training.max_nonfinite_steps={n}), then the run stops")


def _last_checkpoint(cfg: JobConfig, ckpt: CheckpointManager, step: int | None) -> str:
    """Where a stopped run can resume from, for its message."""
    if not ckpt.enable:
        return "No checkpoint: checkpoint.enable=false."
    if step is None:
        return (f"No checkpoint was written from finite weights (checkpoint.interval={ckpt.interval}): a new run "
                f"starts from step 1.")
    return (f"Last good checkpoint: {ckpt.path(step)} (step {step}); a run in the same job.dump_folder resumes "
            f"from it: change what diverged first (e.g. a lower optimizer.lr), or it will diverge again.")


def _family_banner(model) -> str:
    """The transformers family's standing (measured by the family matrix, verified at start,
    or not checked: model.allow_untested); nothing for this package's Llama."""
    status = getattr(model, "family_status", None)
    return f"  family {status.banner()}\n" if status is not None else ""


def _mixer_banner(model, device: torch.device, cfg: JobConfig) -> str:
    """What runs the token mixing of a hybrid model's mixers (GPU kernels or torch), and why;
    nothing for models without such mixers."""
    from ..integrations.hf.mixers.layer_types import mixer_ops
    from ..mixers.kernel_choice import describe_mixer_kernels
    from .build import _DTYPES

    ops = mixer_ops(model)
    if not ops:
        return ""
    return f"  mixers: {describe_mixer_kernels(ops, device, _DTYPES[cfg.training.mixed_precision_param])}\n"


def _eval_banner(cfg: JobConfig, held_out) -> str:
    ev = cfg.eval
    data = ""
    if held_out is not None:
        data = (f", held-out {len(held_out)} documents ("
                + (f"eval.data_path={ev.data_path!r}" if ev.data_path
                   else f"eval.holdout_fraction={ev.holdout_fraction:g}, never trained on") + ")")
    if not ev.interval:
        split = " (held-out split kept out of training)" if held_out is not None and ev.holdout_fraction else ""
        return f"eval off during training (eval.interval=0){split}"
    lengths = ",".join(map(str, ev.lengths)) or "the training length"
    return (f"eval every {ev.interval} steps at {lengths}: {', '.join(ev.tasks)}"
            f" ({ev.depths} depths x {ev.samples} samples){data}")


def _timing_banner(cfg: JobConfig, sp: int, on: bool) -> str:
    if on:
        return "all-to-all time and share of step logged (exchange_ms, exchange_share)"
    why = ("no all-to-all at sp=1" if sp == 1 else "training.compile" if cfg.training.compile
           else "metrics.exchange_timing=false")
    return f"all-to-all timing off ({why})"
