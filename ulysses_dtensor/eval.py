"""Entry point: evaluate a checkpoint under the training mesh.

    torchrun --nproc_per_node=N -m ulysses_dtensor.eval --config FILE \\
        [--checkpoint DIR] [--output DIR] [--section.key value ...]

The config is the training config (its ``[eval]`` section says what to
evaluate; ``[parallelism]``, ``[model]``, ``[memory]``, ``[training]`` how to run
the model: the same mesh, attention backend and memory features as training).
``--checkpoint`` is a ``step-N`` folder of this trainer's DCP checkpoints, or a
checkpoint folder (its newest complete step). Without it: the Hugging Face
model of ``model.hf_path`` itself when the config has one (e.g. the base model
before a context extension; reported as step 0), else the newest checkpoint in
the config's ``<job.dump_folder>/<checkpoint.folder>``. The mesh may differ from
the one the checkpoint was saved on. Results go to ``--output`` (default
``<job.dump_folder>/eval_checkpoint``): ``eval.jsonl``, the PNGs, and TensorBoard
events under ``tb/`` with ``metrics.enable_tensorboard``. Same code as the
trainer's periodic evaluation, same numbers for the same weights.

A bad config, checkpoint or data exits with status 2 and one message.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from .data import DataError
from .trainer.known_errors import exit_on_known_error
from .runtime.process_group import exit_process
from .trainer.config_schema import ConfigError


def _own_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """``--checkpoint`` and ``--output`` out of ``argv``; the rest is a trainer command line."""
    own, rest, i = {}, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in ("--checkpoint", "--output"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"option {name} needs a value")
                value, i = argv[i + 1], i + 1
            own[name[2:]] = value
        else:
            rest.append(argv[i])
        i += 1
    return own, rest


def evaluate(argv: list[str]) -> list[dict]:
    """Run the evaluation; return its rows (every rank)."""
    import torch.distributed as dist

    from .data import build_tokenizer
    from .data.sources import open_source
    from .evaluation.runner import Evaluator, spec_from
    from .runtime.process_group import finish_together
    from .trainer.build import init_distributed, resolve_vocab_size
    from .trainer.comm_phases import CommPhases
    from .trainer.config import load_config, validate_config
    from .trainer.config_checks import check_eval_data
    from .trainer.eval_setup import (
        check_eval_setup,
        eval_lengths,
        find_checkpoint,
        held_out_error,
        held_out_mismatch,
        model_for_eval,
        publish,
        split_for_eval,
    )
    from .trainer.hf_start import tokenizer_spec

    own, rest = _own_flags(argv)
    cfg = load_config(rest)
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    dims = validate_config(cfg, world)
    check_eval_data(cfg)
    lengths = eval_lengths(cfg)
    tokenizer = build_tokenizer(tokenizer_spec(cfg))
    check_eval_setup(cfg, tokenizer, lengths=lengths)
    vocab_size = resolve_vocab_size(cfg, tokenizer.vocab_size)
    train_source, held_out = split_for_eval(cfg, open_source(cfg.data.path, cfg.data.format, tokenizer_spec(cfg),
                                                             cfg.data.text_key, cfg.data.max_corpus_mb))
    if "checkpoint" in own or not cfg.model.hf_path:
        checkpoint = find_checkpoint(own.get("checkpoint", cfg.checkpoint_folder))
    else:
        checkpoint = None  # the HF model directory itself
    output = Path(own.get("output", cfg.dump_folder / "eval_checkpoint"))
    problem = held_out_error(held_out, tokenizer, cfg.eval.loss_rows, max(lengths))
    if problem:
        raise DataError(problem)

    # The whole evaluation waits for peers under comm.init_timeout_seconds; a lost one: one line.
    phases = CommPhases(cfg.comm)
    with phases.lost_peer_as_error():
        device, owns_group = init_distributed(cfg.memory.offload_params, cfg.comm.init_timeout_seconds)
    phases.sets_timeouts = owns_group
    context = finish_together() if owns_group else contextlib.nullcontext()
    with phases.lost_peer_as_error(), context:
        pmesh = dims.build_mesh(device.type)
        phases.enter("evaluation", long=True)
        model, train_state = model_for_eval(cfg, pmesh, device, vocab_size, checkpoint)
        # Our checkpoints record what they trained on; an HF model's pretraining data is unknown.
        mismatch = checkpoint is not None and held_out_mismatch(cfg, train_source, train_state)
        if mismatch:
            raise DataError(f"{checkpoint}: {mismatch}")
        loss_chunks = cfg.memory.loss_chunks if cfg.memory.tiled_loss and cfg.memory.loss_chunks else None
        evaluator = Evaluator(model, pmesh, tokenizer, spec_from(cfg.eval, loss_chunks=loss_chunks),
                              device, held_out)
        step = int(train_state["step"])
        if dist.get_rank() == 0:
            what = checkpoint if checkpoint is not None else f"model.hf_path={cfg.model.hf_path}"
            rope = getattr(model, "rope", None)
            print(f"evaluating {what} (step {step}{f', rope {rope.describe()}' if rope else ''}) at "
                  f"{lengths} on dp_replicate={dims.dp_replicate} "
                  f"dp_shard={dims.dp_shard} sp={dims.sp}: {', '.join(cfg.eval.tasks)}", flush=True)
        result = evaluator.run(step, lengths)
        writer = None
        if cfg.metrics.enable_tensorboard and dist.get_rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(output / "tb"))
        publish(result, output, writer)
        if writer is not None:
            writer.close()
        return result.rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    with exit_on_known_error():
        evaluate(argv)
    return 0


if __name__ == "__main__":
    # A finished rank, or one that reported why it stops, exits without interpreter
    # teardown (see runtime.exit_process; after a lost peer the teardown only adds noise).
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    exit_process(code)
