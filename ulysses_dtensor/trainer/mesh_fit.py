"""Sizes the trainer fits to the ranks it gets: ``parallelism.sp = "auto"`` and
``training.local_batch_size``.

A config that names its sizes (``sp = 2``, ``global_batch_size = 16``) means them:
a world they do not fit is refused with the valid values. The default config
instead fits whatever machine runs it (a laptop's CPU ranks, 1 to 8 GPUs), so
``bash scripts/run_train.sh`` works everywhere; :func:`fit_to_world` turns the
"auto" sizes into numbers once the world size is known, and records what it
chose and why in ``cfg.fitted`` for the run's banner.

Why the largest sp: it gives each GPU the fewest tokens (the longest context per
GPU); capped at one node's ranks so that the all-to-all stays on the node's
links; it must divide the ranks, suit the heads (the Ulysses rule, kv heads
replicated where fewer than sp) and every stage's length. dp takes the rest.
"""

from __future__ import annotations

import math
import os

from .config_schema import AUTO, SOURCE_DEFAULT, ConfigError, JobConfig
from .model_shape import model_args

__all__ = ["fit_to_world", "check_local_batch", "resolve_batch_keys"]


def resolve_batch_keys(cfg: JobConfig) -> None:
    """``training.local_batch_size`` versus ``training.global_batch_size``: the later
    source wins (a command-line global batch over a TOML file's local one gives the
    same batch on every mesh, as parity runs need); both in one source is a
    contradiction."""
    tr = cfg.training
    local, glob = cfg.source_of("training.local_batch_size"), cfg.source_of("training.global_batch_size")
    if not tr.local_batch_size or glob == SOURCE_DEFAULT:
        return
    if local == glob:
        raise ConfigError(
            f"{cfg.describe('training.local_batch_size')} and {cfg.describe('training.global_batch_size')} "
            f"both set the batch; give one (local_batch_size: per data-parallel rank, so it fits any world)"
        )
    if glob > local:
        tr.local_batch_size = 0
        cfg.sources["training.local_batch_size"] = glob


def check_local_batch(cfg: JobConfig) -> None:
    """Range and combination checks that need no world size."""
    tr = cfg.training
    if tr.local_batch_size < 0:
        raise ConfigError(f"training.local_batch_size={tr.local_batch_size} must be >= 0 (0: use "
                          f"training.global_batch_size)")
    if tr.local_batch_size and tr.tokens_per_step:
        raise ConfigError(
            f"{cfg.describe('training.local_batch_size')} with {cfg.describe('training.tokens_per_step')}: "
            f"give one (tokens_per_step fixes the tokens of a step, local_batch_size its sequences per rank)"
        )


def fit_to_world(cfg: JobConfig, world_size: int, local_world_size: int | None = None) -> None:
    """Replace ``parallelism.sp = "auto"`` and ``training.local_batch_size`` by the
    numbers this world takes; idempotent (a fitted config has nothing left to fit).

    ``local_world_size``: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``,
    else the whole world, as on one machine or in the planner).
    """
    par = cfg.parallelism
    if par.sp == AUTO:
        if local_world_size is None:
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
        sp, why = _fit_sp(cfg, world_size, local_world_size)
        par.sp = sp
        cfg.fitted.append(f"parallelism.sp=auto -> {sp}: {why}")
    dp = _dp(cfg, world_size)
    if cfg.training.local_batch_size and dp:  # no dp: the mesh is refused next, by ParallelDims
        local = cfg.training.local_batch_size
        cfg.training.global_batch_size = local * dp
        cfg.training.local_batch_size = 0
        cfg.sources["training.global_batch_size"] = cfg.source_of("training.local_batch_size")
        cfg.fitted.append(
            f"training.global_batch_size -> {local * dp}: training.local_batch_size={local} sequences "
            f"x {dp} data-parallel rank{'s' if dp > 1 else ''}")


def _dp(cfg: JobConfig, world_size: int) -> int | None:
    """Data-parallel ranks of this world (None: the degrees do not fit it)."""
    par = cfg.parallelism
    if par.sp == AUTO:
        return None
    if par.dp_shard > 0:
        return par.dp_replicate * par.dp_shard
    inner = par.dp_replicate * par.sp * par.tp
    return None if world_size % inner else world_size // inner


def _fit_sp(cfg: JobConfig, world_size: int, local_world_size: int) -> tuple[int, str]:
    par = cfg.parallelism
    fixed = par.dp_replicate * par.tp * (par.dp_shard if par.dp_shard > 0 else 1)
    if world_size % fixed:
        raise ConfigError(
            f"parallelism.sp=auto: world_size={world_size} is not divisible by dp_replicate*tp"
            f"{'*dp_shard' if par.dp_shard > 0 else ''}={fixed}; change those, or give parallelism.sp")
    room = world_size // fixed
    if par.dp_shard > 0:  # every other degree is fixed: sp is what is left
        limits = [room]
    else:
        limits = [d for d in range(room, 0, -1) if room % d == 0 and d <= max(local_world_size // par.tp, 1)]
    heads, kv_heads = _heads(cfg)
    lengths = [st.seq_len for st in cfg.stages()]
    refused: dict[int, str] = {}
    for sp in limits:
        problem = _sp_problem(sp, par.ring, heads, kv_heads, lengths, par.tp)
        if problem is None:
            return sp, _why(sp, room, local_world_size, heads, kv_heads, refused, par)
        refused[sp] = problem
    reasons = "; ".join(f"sp={d}: {r}" for d, r in refused.items())
    raise ConfigError(f"parallelism.sp=auto: no sequence-parallel degree fits {world_size} ranks ({reasons}); "
                      f"give parallelism.sp and the other degrees explicitly")


def _heads(cfg: JobConfig) -> tuple[int, int]:
    args = model_args(cfg, vocab_size=cfg.model.vocab_size or 256)
    return args.n_heads, args.n_kv_heads or args.n_heads


def _sp_problem(sp: int, ring: int, heads: int, kv_heads: int, lengths: list[int], tp: int) -> str | None:
    """Why ``sp`` cannot run this model and schedule (None: it can)."""
    from ..parallel.ulysses import kv_replication

    if sp % ring:
        return f"parallelism.ring={ring} does not divide it"
    ulysses = sp // ring
    heads, kv_heads = heads // tp, max(kv_heads // tp, 1)
    try:
        kv_replication(heads, kv_heads, ulysses)
    except ValueError:
        per = " per tp rank" if tp > 1 else ""
        return f"{heads} heads{per} do not split over {ulysses} ranks"
    unit = sp if ring == 1 else math.lcm(sp, 2 * ring)
    bad = [n for n in lengths if n % unit]
    if bad:
        return f"seq_len {bad[0]} is not a multiple of {unit}"
    return None


def _why(sp: int, room: int, local: int, heads: int, kv_heads: int, refused: dict, par) -> str:
    if par.dp_shard > 0:
        return f"what dp_replicate={par.dp_replicate} x dp_shard={par.dp_shard} x tp={par.tp} leave"
    if room == 1:
        return "one rank"
    node = f", within a node of {local} ranks" if local < room * par.tp else ""
    why = (f"the largest divisor of the {room} ranks for sp x dp{node} that suits {heads} heads / "
           f"{kv_heads} kv heads and every stage's seq_len")
    if refused:
        why += " (" + "; ".join(f"not {d}: {r}" for d, r in refused.items()) + ")"
    dp = room // sp
    return why + (f"; dp is the rest, {dp}" if dp > 1 else "")
