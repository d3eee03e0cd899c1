"""Settings that only take effect when other settings allow it.

A key that only matters when another key switches it on (``memory.mlp_tiles``
without ``memory.tiled_mlp``) is an error when the user set it (to a non-default
value) in the same or a later source than the switch: the run would otherwise
silently differ from what was asked. When a later source turned the switch off (a
TOML sets ``checkpoint.interval``, the command line says ``--checkpoint.enable
false``), the user overrode it on purpose: the run goes on and its banner lists the
key as not in effect (:func:`inactive_settings`). :data:`EFFECT_RULES` lists every
such key with its switches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .config_schema import AUTO, SOURCE_DEFAULT, ConfigError, JobConfig
from .data_config import packing_of
from .hf_start import HF_IGNORED_MODEL_KEYS

__all__ = ["EFFECT_RULES", "EffectRule", "check_effect", "inactive_settings"]


@dataclass(frozen=True)
class EffectRule:
    """``key`` has an effect only while ``active(cfg)``, which ``switches`` decide."""

    key: str
    switches: tuple[str, ...]
    active: Callable[[JobConfig], bool]
    needs: str  # what it needs, for the message


def _warmup_ends(c: JobConfig) -> bool:
    return c.lr_scheduler.warmup_steps < c.training.steps


def _sp_may_exceed_1(c: JobConfig) -> bool:
    # "auto" is fitted to the world later (mesh_fit.py): it may be > 1, so no key is refused for it.
    return c.parallelism.sp == AUTO or c.parallelism.sp > 1


def _has_retrieval(c: JobConfig) -> bool:
    return any(t != "loss" for t in c.eval.tasks)


EFFECT_RULES: list[EffectRule] = [
    EffectRule("training.seq_len", ("context.schedule",), lambda c: not c.context.schedule,
               "it is the one stage's length when context.schedule is empty"),
    EffectRule("training.tokens_per_step", ("context.constant_tokens_per_step",),
               lambda c: c.context.constant_tokens_per_step,
               "it is used with context.constant_tokens_per_step=true"),
    EffectRule("training.global_batch_size",
               ("context.constant_tokens_per_step", "training.tokens_per_step"),
               lambda c: not (c.context.constant_tokens_per_step and c.training.tokens_per_step),
               "with context.constant_tokens_per_step=true and training.tokens_per_step > 0 "
               "each stage's batch is tokens_per_step / seq_len"),
    EffectRule("training.compile_backend", ("training.compile",), lambda c: c.training.compile,
               "it is used with training.compile=true"),
    EffectRule("training.pack_qkv", ("parallelism.sp",), lambda c: _sp_may_exceed_1(c),
               "there is no all-to-all to pack at parallelism.sp=1"),
    EffectRule("activation_checkpoint.selective", ("activation_checkpoint.mode",),
               lambda c: c.activation_checkpoint.mode == "selective",
               "it is used with activation_checkpoint.mode='selective'"),
    EffectRule("memory.mlp_tiles", ("memory.tiled_mlp",), lambda c: c.memory.tiled_mlp,
               "it is used with memory.tiled_mlp=true"),
    EffectRule("memory.loss_chunks", ("memory.tiled_loss",), lambda c: c.memory.tiled_loss,
               "it is used with memory.tiled_loss=true"),
    EffectRule("memory.offload_dir", ("memory.offload_activations",), lambda c: c.memory.offload_activations,
               "the disk tier holds the offloaded layer inputs: it is used with memory.offload_activations=true"),
    *(EffectRule(f"float8.{k}", ("float8.enable",), lambda c: c.float8.enable, "it is used with float8.enable=true")
      for k in ("recipe_name", "filter_fqns", "emulate", "enable_fsdp_float8_all_gather")),
    *(EffectRule(f"checkpoint.{k}", ("checkpoint.enable",), lambda c: c.checkpoint.enable,
                 "it is used with checkpoint.enable=true")
      for k in ("folder", "interval", "keep_latest_k")),
    EffectRule("lr_scheduler.decay", ("lr_scheduler.warmup_steps", "training.steps"), _warmup_ends,
               "the decay starts after lr_scheduler.warmup_steps, which must be < training.steps"),
    EffectRule("lr_scheduler.min_lr_ratio",
               ("lr_scheduler.decay", "lr_scheduler.warmup_steps", "training.steps"),
               lambda c: c.lr_scheduler.decay != "none" and _warmup_ends(c),
               "it is where lr_scheduler.decay ('linear' or 'cosine') ends, after the warm-up"),
    EffectRule("model.vocab_multiple_of", ("model.vocab_size",), lambda c: c.model.vocab_size == 0,
               "it rounds the tokenizer's vocabulary when model.vocab_size=0"),
    EffectRule("data.max_corpus_mb", ("data.path", "data.sources"),
               lambda c: c.data.path == "" and not c.data.sources,
               "it caps the built-in corpus (data.path='' and no data.sources)"),
    *(EffectRule(f"data.{k}", ("data.packing", "data.format"), lambda c: packing_of(c) == "bfd",
                 "it shapes best-fit packing (data.packing='bfd', or 'auto' with data.format chat / "
                 "prompt_completion); the stream cut splits every sample that crosses a row end")
      for k in ("packing_window", "overlong")),
    *(EffectRule(f"lora.{k}", ("lora.rank",), lambda c: c.lora.rank > 0,
                 "it shapes the LoRA adapters, which lora.rank > 0 switches on")
      for k in ("alpha", "dropout", "target_modules", "modules_to_save")),
    EffectRule("metrics.exchange_timing", ("parallelism.sp", "training.compile"),
               lambda c: _sp_may_exceed_1(c) and not c.training.compile,
               "it times the eager Ulysses all-to-alls (parallelism.sp > 1; torch.compile'd "
               "blocks cannot carry the timer)"),
    *(EffectRule(f"eval.{k}", ("eval.tasks",), _has_retrieval,
                 "it shapes the retrieval tasks (passkey, multikey or vartrack in eval.tasks)")
      for k in ("depths", "samples", "seed")),
    *(EffectRule(f"eval.{k}", ("eval.tasks",), lambda c: "loss" in c.eval.tasks,
                 "it is for the held-out loss by position ('loss' in eval.tasks)")
      for k in ("loss_rows", "data_path", "holdout_fraction")),
    *(EffectRule(f"model.{k}", ("model.hf_path",), lambda c: not c.model.hf_path,
                 "with model.hf_path the model's shapes, vocabulary and rope come from its "
                 "config.json")
      for k in HF_IGNORED_MODEL_KEYS if k != "rope_theta"),
    EffectRule("model.rope_theta", ("model.hf_path",), lambda c: not c.model.hf_path,
               "with model.hf_path the starting rope comes from its config.json; change it per "
               "stage with context.schedule[i].rope_theta / rope_scaling"),
    EffectRule("model.implementation", ("model.hf_path",), lambda c: bool(c.model.hf_path),
               "it chooses what trains the model of model.hf_path (model.flavor is always this "
               "package's Llama)"),
]


def _value(cfg: JobConfig, dotted: str):
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


_DEFAULTS = JobConfig()


def _without_effect(cfg: JobConfig, rules) -> list[tuple[EffectRule, bool]]:
    """(rule, the user's own choice) for every explicitly set key that has no effect.

    Keys set to their default value change nothing and are left alone.
    """
    out = []
    for rule in rules:
        if cfg.source_of(rule.key) == SOURCE_DEFAULT or rule.active(cfg):
            continue
        if _value(cfg, rule.key) == _value(_DEFAULTS, rule.key):
            continue
        latest_switch = max(cfg.source_of(s) for s in rule.switches)
        out.append((rule, cfg.source_of(rule.key) >= latest_switch))
    return out


def _effect_message(cfg: JobConfig, rule: EffectRule) -> str:
    switches = ", ".join(cfg.describe(s) for s in rule.switches)
    return (
        f"{cfg.describe(rule.key)} has no effect: {rule.needs}, and here {switches}; "
        f"remove {rule.key} or change {' / '.join(rule.switches)}"
    )


def check_effect(cfg: JobConfig, rules) -> None:
    """A ConfigError for the first key of ``rules`` set by the user where it has no effect."""
    for rule, chosen in _without_effect(cfg, rules):
        if chosen:
            raise ConfigError(_effect_message(cfg, rule))


def inactive_settings(cfg: JobConfig) -> list[str]:
    """Keys a later source switched off: accepted, and listed in the run's banner."""
    return [
        f"{cfg.describe(r.key)}: {', '.join(cfg.describe(s) for s in r.switches)}"
        for r, chosen in _without_effect(cfg, EFFECT_RULES) if not chosen
    ]
