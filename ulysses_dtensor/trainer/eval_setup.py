"""From a trainer config to the evaluation: held-out data, the periodic hook, the model.

Used by the training loop (every ``eval.interval`` steps) and by ``python -m
ulysses_dtensor.eval`` (on a checkpoint): both build the same
:class:`~ulysses_dtensor.evaluation.Evaluator` from the same ``[eval]`` section,
so they give the same numbers for the same weights.

Held-out documents. With ``eval.holdout_fraction`` the training data is split
(:mod:`ulysses_dtensor.evaluation.heldout`) whenever the config asks for the
loss task, whether or not the trainer evaluates (``eval.interval = 0``), so a
later evaluation of its checkpoints reads documents training never did. With
``eval.data_path`` the held-out documents are other files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import DataError, DocumentSource
from ..data.checks import check_corpus
from ..evaluation import report
from ..evaluation.heldout import split_held_out
from ..evaluation.runner import EvalResult, Evaluator, spec_from
from ..evaluation.tasks import min_length
from .config_schema import ConfigError, JobConfig
from .metrics import drop_rows_after

__all__ = ["split_for_eval", "check_eval_setup", "check_held_out_data", "eval_lengths",
           "PeriodicEval", "model_for_eval", "held_out_mismatch"]


def split_for_eval(cfg: JobConfig, source: DocumentSource) -> tuple[DocumentSource, DocumentSource | None]:
    """(the documents training reads, the held-out documents or None)."""
    ev = cfg.eval
    if "loss" not in ev.tasks:
        return source, None
    if ev.holdout_fraction:
        try:
            return split_held_out(source, ev.holdout_fraction,
                                  what=f"data.path={cfg.data.path!r}" if cfg.data.path else "the built-in corpus")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if ev.data_path:  # read like the training data (data.format: SFT targets)
        from ..data.sources import open_source
        from .hf_start import tokenizer_spec

        return source, open_source(ev.data_path, cfg.data.format, tokenizer_spec(cfg), cfg.data.text_key,
                                   key="eval.data_path")
    return source, None


def eval_lengths(cfg: JobConfig, seq_len: int | None = None) -> list[int]:
    """``eval.lengths``, or the given training length (default: the last stage's)."""
    if cfg.eval.lengths:
        return list(cfg.eval.lengths)
    return [seq_len if seq_len is not None else cfg.stages()[-1].seq_len]


def check_eval_setup(cfg: JobConfig, tokenizer, *, lengths: list[int] | None = None) -> None:
    """Every eval length fits every retrieval sample with this tokenizer (ConfigError)."""
    if lengths is None:
        lengths = list(cfg.eval.lengths) or sorted({st.seq_len for st in cfg.stages()})
    need = min_length(cfg.eval.tasks, tokenizer, cfg.eval.depths, cfg.eval.samples, cfg.eval.seed)
    for task, tokens in need.items():
        short = [n for n in lengths if n < tokens]
        if short:
            where = "eval.lengths" if cfg.eval.lengths else "the training lengths (eval.lengths is empty)"
            raise ConfigError(
                f"{where} {short} are too short for eval task {task!r} with the tokenizer "
                f"{getattr(tokenizer, 'name', 'byte')!r}: its prompt and answer need {tokens} tokens before any filler; "
                f"use lengths >= {tokens} or drop {task!r} from eval.tasks"
            )


def check_held_out_data(held_out: DocumentSource | None, tokenizer, rows: int, length: int) -> None:
    """The held-out documents give ``rows`` rows of ``length`` tokens without repeating
    themselves (DataError)."""
    if held_out is None:
        return
    check_corpus(held_out, tokenizer, rows * length,
                 described=f"the held-out documents ({held_out.fingerprint()}) for eval.loss_rows={rows} "
                           f"rows of {length} tokens")


def held_out_mismatch(cfg: JobConfig, train_source: DocumentSource, train_state: dict) -> str | None:
    """Why a checkpoint's training data may contain the held-out documents, or None.

    With ``eval.holdout_fraction`` the checkpoint's data cursor must name this
    split's training side (its fingerprint): otherwise its training read the
    documents the loss would call held out.
    """
    if "loss" not in cfg.eval.tasks or not cfg.eval.holdout_fraction:
        return None
    trained_on = train_state.get("data", {}).get("source")
    expected = train_source.fingerprint()
    if trained_on != expected:
        return (
            f"the checkpoint was trained on data source {trained_on!r}, not on {expected!r} (the "
            f"training side of eval.holdout_fraction={cfg.eval.holdout_fraction:g}): its training may "
            f"have read the documents this loss calls held out. Evaluate with the data and "
            f"holdout_fraction it was trained with, give eval.data_path, or drop 'loss' from eval.tasks"
        )
    return None


class PeriodicEval:
    """The trainer's hook: every ``eval.interval`` steps and at the last step.

    A run resumed at ``resume_step`` drops the ``eval.jsonl`` rows of later steps
    (an attempt that died after them logged them; they are evaluated again).
    """

    def __init__(self, cfg: JobConfig, model, pmesh, tokenizer, device: torch.device,
                 held_out: DocumentSource | None, tb_writer=None, resume_step: int = 0):
        self.cfg = cfg
        self.interval = cfg.eval.interval
        self.total_steps = cfg.training.steps
        self.folder = cfg.dump_folder / "eval"
        self.tb = tb_writer
        if not dist.is_initialized() or dist.get_rank() == 0:
            drop_rows_after(self.folder / "eval.jsonl", resume_step)
        loss_chunks = cfg.memory.loss_chunks if cfg.memory.tiled_loss and cfg.memory.loss_chunks else None
        self.evaluator = Evaluator(model, pmesh, tokenizer, spec_from(cfg.eval, loss_chunks=loss_chunks),
                                   device, held_out)

    def due(self, step: int) -> bool:
        return bool(self.interval) and (step % self.interval == 0 or step == self.total_steps)

    def run(self, step: int, seq_len: int, step_seconds: float | None = None) -> EvalResult:
        result = self.evaluator.run(step, eval_lengths(self.cfg, seq_len))
        publish(result, self.folder, self.tb, step_seconds)
        return result


def publish(result: EvalResult, folder: Path, tb_writer=None, step_seconds: float | None = None) -> None:
    """Rank 0 writes the JSON lines, TensorBoard scalars and PNGs, and prints a line."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if step_seconds:
        for row in result.of_kind("eval"):
            row["train_step_seconds"] = step_seconds
            row["train_steps_equivalent"] = result.seconds / step_seconds
    report.write_jsonl(result, folder)
    if tb_writer is not None:
        report.write_tensorboard(result, tb_writer)
    t0 = time.perf_counter()
    plots = report.write_plots(result, folder)
    note = (f"; plots in {time.perf_counter() - t0:.1f}s: {', '.join(p.name for p in plots)}" if plots
            else "; no plots (pip install 'ulysses-dtensor[plot]')")
    print(report.summary_line(result, step_seconds) + f" -> {folder / 'eval.jsonl'}{note}", flush=True)


def model_for_eval(cfg: JobConfig, pmesh, device: torch.device, vocab_size: int, checkpoint: Path | None):
    """The model to evaluate, parallelized like training, with the evaluated weights.

    ``checkpoint``: a DCP checkpoint folder of this trainer (model state only;
    any mesh); None: the Hugging Face model of ``model.hf_path`` itself (its
    safetensors, read shard by shard), e.g. the base model before a context
    extension. Returns ``(model, train_state)``; ``train_state`` is the
    checkpoint's (``{"step": 0}`` for an HF model). A checkpoint's model gets the
    rope it trained with (its context stage's).
    """
    from .build import build_model
    from .checkpoint import load_model_weights

    if checkpoint is None:
        return build_model(cfg, pmesh, vocab_size, device, init_weights=True), {"step": 0}
    from .lora_setup import uses_lora

    lora = uses_lora(cfg)  # a LoRA checkpoint holds the adapters: the base comes from model.hf_path
    model = build_model(cfg, pmesh, vocab_size, device, init_weights=lora)
    load_model_weights(checkpoint, model, trainable_only=lora)
    with open(Path(checkpoint) / "train_state.json") as fh:
        state = json.load(fh)
    rope = _trained_rope(cfg, model, state)
    if rope is not None:  # None: a transformers family whose rope no stage can change
        model.set_rope(rope)
    return model, state


def _trained_rope(cfg: JobConfig, model, state: dict):
    """The rope the checkpoint trained with (recorded, else its step's stage in ``cfg``)."""
    from ..models.rope import RopeConfig
    from .rope_stages import rope_args, stage_ropes

    saved = state.get("context", {}).get("rope")
    if saved is not None:
        return RopeConfig.from_dict(saved)
    step = max(1, int(state.get("step", 1)))
    ropes = stage_ropes(cfg, rope_args(model))
    return None if ropes is None else ropes[cfg.context_schedule().stage_index(step)]


def find_checkpoint(path: str | Path) -> Path:
    """A complete ``step-N`` folder, or the newest one inside a checkpoint folder."""
    from .checkpoint import COMPLETE_MARKER, complete_steps

    p = Path(path)
    if (p / COMPLETE_MARKER).is_file():
        return p
    steps = complete_steps(p)
    if not steps:
        raise ConfigError(
            f"no complete checkpoint at {str(p)!r}: give a step-N folder holding {COMPLETE_MARKER}, "
            f"or a checkpoint folder with one (the trainer's <job.dump_folder>/<checkpoint.folder>)"
        )
    return p / f"step-{steps[-1]}"


def held_out_error(held_out, tokenizer, rows: int, length: int) -> str | None:
    try:
        check_held_out_data(held_out, tokenizer, rows, length)
    except DataError as e:
        return str(e)
    return None
