"""The rope of each context stage, and what the run reports and saves about it.

A ``context.schedule`` stage may set ``rope_theta`` and/or ``rope_scaling`` (a
table in transformers' ``rope_parameters`` form); a stage without them keeps
the previous stage's rope, and the first stage starts from the model's own (its
flavor's, or ``model.hf_path``'s config.json). The loop applies a stage's rope
at its first step and on resume through ``model.set_rope(rope)`` -- the one
method a model implementation must offer to take part -- and pins the sequence
length of the length-dependent types (``dynamic``, ``longrope``) to the step's
global batch (``model.rope_seq_len``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..integrations.hf.rotary import RopeSupport
from ..models.rope import ROPE_TYPES, RopeConfig, RopeError
from .config_schema import ConfigError, JobConfig

__all__ = ["stage_ropes", "rope_banner", "rope_row", "trained_rope_info", "global_rope_length",
           "model_rope_start", "rope_args"]


def rope_args(model):
    """What :func:`stage_ropes` reads of a built model: our Llama's ``args``, or a
    transformers model's ``rope_support`` (its rope, rotated dims, or why none)."""
    return getattr(model, "rope_support", None) or model.args


def model_rope_start(cfg: JobConfig, args) -> tuple[RopeConfig | None, int | None]:
    """(the model's own rope, its max_position_embeddings or None) before any stage."""
    if isinstance(args, RopeSupport):  # a transformers model's (its text config's)
        return args.rope, args.max_position_embeddings
    max_pos = None
    if cfg.model.hf_path:
        from .hf_start import hf_source_config

        max_pos = hf_source_config(cfg).get("max_position_embeddings")
    return args.rope, max_pos


def stage_ropes(
    cfg: JobConfig,
    args,
    *,
    rope_types: tuple[str, ...] = ROPE_TYPES,
    family: str = "this model",
) -> list[RopeConfig] | None:
    """The rope of every stage of ``cfg.stages()`` (ConfigError naming the stage's key).

    ``args``: the model's LlamaArgs (its ``rope`` and ``head_dim``), or a
    transformers model's :class:`~ulysses_dtensor.integrations.hf.rotary.RopeSupport`
    (:func:`rope_args`). None for a model whose rope cannot change (Gemma3's
    per-layer-type ropes) when no stage sets one; a stage that does is an error
    naming its key and the reason.
    ``rope_types``: the types the model's implementation can compute (ours: all).
    """
    rope, max_pos = model_rope_start(cfg, args)
    if rope is None:
        for i, st in enumerate(cfg.stages()):
            if st.sets_rope:
                key = "rope_scaling" if st.rope_scaling is not None else "rope_theta"
                raise ConfigError(f"context.schedule[{i}].{key} cannot be applied: {args.reason}; leave the "
                                  "model's own rope (config.json) for every stage")
        return None
    family_rules = isinstance(args, RopeSupport)  # a transformers family checks its own ropes
    head_dim = args.rope_dim if family_rules else args.head_dim
    out = []
    for i, st in enumerate(cfg.stages()):
        key = f"context.schedule[{i}]"
        if st.rope_scaling is not None:
            table = dict(st.rope_scaling)
            inner = table.get("rope_theta")
            if inner is not None and st.rope_theta is not None and float(inner) != st.rope_theta:
                raise ConfigError(
                    f"{key}.rope_theta={st.rope_theta:g} and {key}.rope_scaling.rope_theta={inner!r} "
                    "disagree; give the base once")
            try:
                rope = RopeConfig.from_parameters(
                    table, where=f"{key}.rope_scaling",
                    theta=st.rope_theta if st.rope_theta is not None else rope.theta,
                    head_dim=head_dim, max_position_embeddings=max_pos)
            except RopeError as e:
                raise ConfigError(str(e)) from None
        elif st.rope_theta is not None:
            rope = rope.with_theta(st.rope_theta)
        where = (f"{key}.rope_scaling.rope_type" if st.rope_scaling is not None
                 else f"rope_type of {key} (kept from {'the previous stage' if i else 'the model'})")
        if rope.rope_type not in rope_types:
            raise ConfigError(
                f"{where}={rope.rope_type!r} cannot be used by {family}; valid: {', '.join(rope_types)}")
        if family_rules and st.sets_rope:
            try:
                args.check_rope(rope)
            except (RopeError, ValueError) as e:
                raise ConfigError(f"{where}={rope.rope_type!r} cannot be used by this model: {e}") from None
        out.append(rope)
    return out


def rope_banner(schedule, ropes: list[RopeConfig]) -> str:
    """One banner line per stage: where it starts, its length and its rope."""
    lines = []
    for i, (st, rope) in enumerate(zip(schedule.stages, ropes)):
        changed = "" if i == 0 or rope != ropes[i - 1] else " (unchanged)"
        lines.append(f"  rope stage {i} (from step {st.start_step}, seq_len {st.seq_len}): "
                     f"{rope.describe()}{changed}")
    return "\n".join(lines)


def rope_row(rope: RopeConfig) -> dict:
    """metrics.jsonl fields saying the rope in effect."""
    return {"rope_type": rope.rope_type, "rope_theta": rope.theta, "rope_factor": rope.factor}


def trained_rope_info(schedule, ropes: list[RopeConfig], step: int) -> dict:
    """What an export of the checkpoint at ``step`` needs: the rope it trained with
    last and the longest sequence trained up to it."""
    idx = schedule.stage_index(step)
    return {"rope": ropes[idx].to_dict(),
            "max_seq_len": max(st.seq_len for st in schedule.stages[: idx + 1])}


def global_rope_length(position_ids: torch.Tensor, mesh=None) -> int:
    """``1 + max(position_ids)`` over every rank of ``mesh`` (the step's whole batch;
    one all-reduce of a scalar): the L transformers would take for the whole global
    batch in one forward, the same on every mesh and micro-batch split."""
    longest = position_ids.max().reshape(1).to(torch.int64)
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return int(longest.item()) + 1
