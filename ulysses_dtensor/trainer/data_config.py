"""The ``[data]`` keys that describe where tokens come from: parsing and checks.

``[[data.sources]]`` tables become :class:`~ulysses_dtensor.data.SourceSpec` entries
(on the command line ``--data.sources PATH:WEIGHT,PATH:WEIGHT``). Checked before
anything starts, each with one message naming the key: ``data.path`` and
``data.sources`` exclusive, weights positive (one per source, or one per
context stage), up-sampling values, every path a data file, a directory of
them, or a prepared token store.
"""

from __future__ import annotations

from pathlib import Path

from ..data import DATA_SUFFIXES, SourceSpec, data_files, data_suffix, is_store
from ..runtime.suggest import did_you_mean
from .config_schema import ConfigError, JobConfig

__all__ = ["coerce_sources", "parse_sources_cli", "check_data_values", "data_path_problem", "packing_of",
           "SOURCES_TYPE_NAME", "SOURCES_CLI_HINT"]

SOURCES_TYPE_NAME = ("a list of {path = <str>, weight = <number or list>, upsample_min_tokens = <int>, "
                     "upsample_factor = <number>, name = <str>} tables")
SOURCES_CLI_HINT = " written as PATH:WEIGHT,PATH:WEIGHT (per-stage weights and up-sampling: in the TOML file)"
_KEYS = ("path", "weight", "upsample_min_tokens", "upsample_factor", "name")


def _number(value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return float(value)


def coerce_sources(value, key: str) -> list[SourceSpec]:
    """TOML ``[[data.sources]]`` tables -> SourceSpecs (ConfigError naming the entry)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config key {key} must be {SOURCES_TYPE_NAME}, got {value!r}")
    out = []
    for i, table in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(table, SourceSpec):
            out.append(table)
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table {{path = ..., weight = ...}}, got {table!r}")
        for k in table:
            if k not in _KEYS:
                raise ConfigError(f"unknown key {k!r} in {where}{did_you_mean(k, _KEYS, cutoff=0.5)}; "
                                  f"valid: {', '.join(_KEYS)}")
        if not isinstance(table.get("path"), str) or not table["path"]:
            raise ConfigError(f"{where} needs a path (a string), got {table.get('path')!r}")
        weight = table.get("weight", 1.0)
        if isinstance(weight, (list, tuple)):
            weight = tuple(_number(w, f"{where}.weight[{j}]") for j, w in enumerate(weight))
        else:
            weight = _number(weight, f"{where}.weight")
        upmin = table.get("upsample_min_tokens", 0)
        if isinstance(upmin, bool) or not isinstance(upmin, int):
            raise ConfigError(f"{where}.upsample_min_tokens must be an integer, got {upmin!r}")
        name = table.get("name", "")
        if not isinstance(name, str):
            raise ConfigError(f"{where}.name must be a string, got {name!r}")
        out.append(SourceSpec(path=table["path"], weight=weight, upsample_min_tokens=upmin,
                              upsample_factor=_number(table.get("upsample_factor", 1.0), f"{where}.upsample_factor"),
                              name=name))
    return out


def parse_sources_cli(text: str) -> list[SourceSpec]:
    """``PATH:WEIGHT,PATH:WEIGHT`` -> SourceSpecs (ValueError if malformed)."""
    out = []
    for part in text.strip("[]").split(","):
        if not part.strip():
            continue
        path, sep, weight = part.strip().rpartition(":")
        if not sep or not path:
            raise ValueError(part)
        out.append(SourceSpec(path=path, weight=float(weight)))
    return out


def data_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be read as training data, or None."""
    p = Path(path)
    if not p.exists():
        return "does not exist"
    if p.is_file():
        if data_suffix(p) is None:
            return f"has suffix {''.join(p.suffixes[-2:]) or '(none)'!r}; valid: {', '.join(DATA_SUFFIXES)}"
        return None
    if is_store(p):
        return None
    if not data_files(p):
        return (f"is a directory without a token store manifest or any {' / '.join(DATA_SUFFIXES)} "
                f"file")
    return None


def packing_of(cfg: JobConfig) -> str:
    """``data.packing`` resolved: ``auto`` is best-fit rows for SFT records (a sample whole
    with its prompt), the stream cut for pretraining text (no padding)."""
    if cfg.data.packing != "auto":
        return cfg.data.packing
    return "stream" if cfg.data.format == "text" else "bfd"


def check_data_values(cfg: JobConfig) -> None:
    """The [data] source keys, before any file is opened beyond ``stat``."""
    d = cfg.data
    if d.packing_window < 1:
        raise ConfigError(f"data.packing_window={d.packing_window} must be >= 1")
    if d.prefetch < 0:
        raise ConfigError(f"data.prefetch={d.prefetch} must be >= 0 (0: no background loading)")
    if d.format != "text" and not d.path and not d.sources:
        raise ConfigError(
            f"{cfg.describe('data.format')} reads records from data.path or data.sources, and the built-in "
            f"corpus (data.path='') is plain text: give .jsonl records or a store prepared with "
            f"python -m ulysses_dtensor.prepare_data --format {d.format}, or data.format='text'")
    if not d.sources:
        return
    if d.path:
        raise ConfigError(f"{cfg.describe('data.path')} and data.sources both name the training data; "
                          f"give one (a single source is data.path, or one [[data.sources]] entry)")
    if cfg.eval.holdout_fraction:
        raise ConfigError(
            f"{cfg.describe('eval.holdout_fraction')} splits data.path, and this config has data.sources; "
            f"give held-out documents with eval.data_path instead"
        )
    n_stages = len(cfg.stages())
    labels = [s.label for s in d.sources]
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        weights = s.weight if isinstance(s.weight, tuple) else (s.weight,)
        if isinstance(s.weight, tuple) and len(s.weight) != n_stages:
            raise ConfigError(
                f"{key}.weight={list(s.weight)} has {len(s.weight)} weights; context.schedule has "
                f"{n_stages} stage(s): give one weight per stage, or one number for all"
            )
        bad = [w for w in weights if not w > 0]
        if bad:
            shown = list(weights) if isinstance(s.weight, tuple) else s.weight
            raise ConfigError(f"{key}.weight={shown} ({s.path}): every weight must be > 0 (weights "
                              f"are relative shares of the rows)")
        if s.upsample_factor < 1:
            raise ConfigError(f"{key}.upsample_factor={s.upsample_factor} must be >= 1 (1: no up-sampling)")
        if s.upsample_min_tokens < 0:
            raise ConfigError(f"{key}.upsample_min_tokens={s.upsample_min_tokens} must be >= 0")
        if s.upsample_min_tokens and s.upsample_factor == 1:
            raise ConfigError(f"{key}.upsample_min_tokens={s.upsample_min_tokens} has no effect: it is "
                              f"used with upsample_factor > 1")
        if labels.count(s.label) > 1:
            raise ConfigError(f"{key} is named {s.label!r} like another source; give each a distinct "
                              f"name (data.sources[].name)")
