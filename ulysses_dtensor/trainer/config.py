"""Build the trainer configuration: defaults < TOML file < command-line overrides.

A TOML file sets any subset of the keys of :mod:`.config_schema`;
``--section.key value`` (or ``--section.key=value``) on the command line
overrides it, parsed to the key's type (bools: true/false; lists: comma
separated; the context schedule: ``start:seq_len,start:seq_len``). The config
remembers which source set each key, so that a setting that cannot take effect
is reported rather than ignored (:mod:`.config_effects`).

Validation happens in two layers, both before any process group, folder or
model exists:

* :func:`parse_config` / :func:`load_config` check names, types, choices, ranges
  and settings that would have no effect;
* :func:`validate_config` checks the config against the world size, the model
  flavor and the data files: mesh degrees, every stage's sequence length and
  batch size, heads versus sp.

Every problem raises one :class:`ConfigError` whose message names the key and
what would be valid.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..data import TOKENIZERS_EXTRA_MSG, SourceSpec
from ..runtime.suggest import did_you_mean
from .config_checks import check_values, model_args, validate_config
from .config_effects import inactive_settings
from .config_schema import (
    _FIELD_TYPES,
    _FIELDS,
    _SECTION_TYPES,
    SOURCE_CLI,
    SOURCE_DEFAULT,
    SOURCE_TOML,
    AUTO,
    ConfigError,
    JobConfig,
    config_help,
)
from .data_config import (
    SOURCES_CLI_HINT,
    SOURCES_TYPE_NAME,
    coerce_sources,
    parse_sources_cli,
)
from .mesh_fit import resolve_batch_keys
from .schedule import Stage

INT_OR_AUTO = int | str  # a size given as a number, or "auto" (fitted to the world: mesh_fit.py)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "JobConfig",
    "load_config",
    "parse_config",
    "parse_cli",
    "validate_config",
    "model_args",
    "inactive_settings",
    "config_help",
    "TOKENIZERS_EXTRA_MSG",
]


# --------------------------------------------------------------------------- #
# Names
# --------------------------------------------------------------------------- #


def _suggest(name: str, options) -> str:
    return did_you_mean(name, options, cutoff=0.5)


def _check_section(section: str) -> None:
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"unknown config section {section!r}{_suggest(section, _SECTION_TYPES)}; "
            f"valid sections: {', '.join(_SECTION_TYPES)}"
        )


def _check_key(section: str, key: str) -> None:
    _check_section(section)
    if key not in _FIELDS[section]:
        full = [f"{section}.{k}" for k in _FIELDS[section]]
        raise ConfigError(
            f"unknown config key {section}.{key}{_suggest(f'{section}.{key}', full)}; "
            f"valid keys of [{section}]: {', '.join(_FIELDS[section])}"
        )


def _split_dotted(dotted: str) -> tuple[str, str]:
    if "." not in dotted:
        # A bare key: find the section it belongs to, for a helpful message.
        every = [f"{s}.{k}" for s in _FIELDS for k in _FIELDS[s]]
        raise ConfigError(
            f"option --{dotted} must be --section.key{_suggest(dotted, every)}; "
            f"sections: {', '.join(_SECTION_TYPES)}"
        )
    section, key = dotted.split(".", 1)
    _check_key(section, key)
    return section, key


# --------------------------------------------------------------------------- #
# Types
# --------------------------------------------------------------------------- #


def _type_name(tp) -> str:
    if tp is bool:
        return "a bool (true/false)"
    if tp is int:
        return "an integer"
    if tp == INT_OR_AUTO:
        return f"an integer or {AUTO!r}"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp == list[float]:
        return "a list of numbers"
    if tp == list[int]:
        return "a list of integers"
    if tp == list[str]:
        return "a list of strings"
    if tp == list[Stage]:
        return ("a list of {start_step = <int>, seq_len = <int>} tables (optional rope_theta, "
                "rope_scaling)")
    if tp == list[SourceSpec]:
        return SOURCES_TYPE_NAME
    return str(tp)


def _coerce(value, tp, key: str):
    """A TOML value -> the field's type, or a ConfigError naming the key."""

    def bad():
        return ConfigError(
            f"config key {key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        )

    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp == INT_OR_AUTO:
        if value == AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    if tp == list[float]:
        if not isinstance(value, (list, tuple)):
            raise bad()
        return [_coerce(v, float, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp in (list[int], list[str]):
        if not isinstance(value, (list, tuple)):
            raise bad()
        item = int if tp == list[int] else str
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp == list[Stage]:
        if not isinstance(value, (list, tuple)):
            raise bad()
        return [_coerce_stage(v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp == list[SourceSpec]:
        return coerce_sources(value, key)
    raise TypeError(f"unsupported config type {tp} for {key}")  # pragma: no cover


def _coerce_stage(value, key: str) -> Stage:
    if isinstance(value, Stage):
        return value
    if not isinstance(value, dict):
        raise ConfigError(
            f"config key {key} must be a table {{start_step = <int>, seq_len = <int>}}, "
            f"got {value!r}"
        )
    names = ("start_step", "seq_len", "rope_theta", "rope_scaling")
    for k in value:
        if k not in names:
            raise ConfigError(
                f"unknown key {k!r} in {key}{_suggest(k, names)}; valid: {', '.join(names)}"
            )
    for k in names[:2]:
        if k not in value:
            raise ConfigError(f"{key} is missing {k!r} (a stage is {{start_step, seq_len}})")
    theta = value.get("rope_theta")
    if theta is not None:
        theta = _coerce(theta, float, f"{key}.rope_theta")
        if theta <= 0:
            raise ConfigError(f"{key}.rope_theta={theta:g} must be > 0")
    scaling = value.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(
            f"{key}.rope_scaling must be a table {{rope_type = \"yarn\", factor = 4.0, ...}} "
            f"(transformers' rope_parameters form), got {scaling!r}"
        )
    # The table's own checks need the model (head_dim, max_position_embeddings):
    # trainer/rope_stages.py runs them in validate_config.
    return Stage(
        start_step=_coerce(value["start_step"], int, f"{key}.start_step"),
        seq_len=_coerce(value["seq_len"], int, f"{key}.seq_len"),
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling is not None else None,
    )


def _parse_cli_value(text: str, tp, key: str):
    """A command-line string -> the field's type."""
    try:
        if tp is bool:
            low = text.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(text)
        if tp == INT_OR_AUTO:
            return AUTO if text.strip() == AUTO else int(text)
        if tp is float:
            return float(text)
        if tp is str:
            return text
        if tp == list[float]:
            return [float(x) for x in text.strip("[]").split(",") if x.strip()]
        if tp == list[int]:
            return [int(x) for x in text.strip("[]").split(",") if x.strip()]
        if tp == list[str]:
            return [x.strip().strip("'\"") for x in text.strip("[]").split(",") if x.strip()]
        if tp == list[Stage]:
            stages = []
            for part in text.strip("[]").split(","):
                if not part.strip():
                    continue
                start, length = part.split(":")
                stages.append(Stage(int(start), int(length)))
            return stages
        if tp == list[SourceSpec]:
            return parse_sources_cli(text)
    except ValueError:
        pass
    hint = {
        list[Stage]: " written as start_step:seq_len,start_step:seq_len (e.g. 1:128,4:256)",
        list[float]: " written comma separated (e.g. 0.9,0.95)",
        list[int]: " written comma separated (e.g. 4096,8192)",
        list[SourceSpec]: SOURCES_CLI_HINT,
    }.get(tp, "")
    raise ConfigError(f"--{key} must be {_type_name(tp)}{hint}, got {text!r}")


# --------------------------------------------------------------------------- #
# Building a config
# --------------------------------------------------------------------------- #


def _apply(cfg: JobConfig, section: str, key: str, value, *, from_cli: bool) -> None:
    dotted = f"{section}.{key}"
    tp = _FIELD_TYPES[section][key]
    value = _parse_cli_value(value, tp, dotted) if from_cli else _coerce(value, tp, dotted)
    choices = _FIELDS[section][key].metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(
            f"{dotted}={value!r} is not valid{_suggest(str(value), choices)}; "
            f"valid: {', '.join(map(str, choices))}"
        )
    setattr(getattr(cfg, section), key, value)
    cfg.sources[dotted] = SOURCE_CLI if from_cli else SOURCE_TOML


def parse_cli(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """``argv`` -> (config path or None, [(section.key, raw value), ...])."""
    path = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}; options are --config FILE and "
                f"--section.key value (see --help)"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("--"):
                # A bare flag: only bools may omit their value (it means true).
                if name != "config" and "." in name:
                    section, key = _split_dotted(name)
                    if _FIELD_TYPES[section][key] is bool:
                        overrides.append((name, "true"))
                        i += 1
                        continue
                raise ConfigError(f"option --{name} needs a value")
            value = nxt
            i += 1
        i += 1
        if name in ("config", "job.config_file"):
            path = value
        else:
            _split_dotted(name)  # unknown names fail here, before anything else
            overrides.append((name, value))
    return path, overrides


def parse_config(toml: dict | None = None, overrides: list[tuple[str, str]] = ()) -> JobConfig:
    """Defaults, then the TOML dict, then the CLI overrides (strings)."""
    cfg = JobConfig()
    for section, table in (toml or {}).items():
        _check_section(section)
        if not isinstance(table, dict):
            raise ConfigError(f"config section [{section}] must be a table, got {table!r}")
        for key, value in table.items():
            _check_key(section, key)
            _apply(cfg, section, key, value, from_cli=False)
    for dotted, raw in overrides:
        section, key = _split_dotted(dotted)
        _apply(cfg, section, key, raw, from_cli=True)
    _resolve_context_length(cfg)
    resolve_batch_keys(cfg)
    check_values(cfg)
    return cfg


def _resolve_context_length(cfg: JobConfig) -> None:
    """``training.seq_len`` versus ``context.schedule``: the later source wins.

    A command-line ``--training.seq_len`` over a TOML file's schedule trains at
    that one length (the schedule is dropped); a command-line
    ``--context.schedule`` over a TOML ``seq_len`` uses the schedule. Both in the
    same source is a contradiction.
    """
    seq, sched = cfg.source_of("training.seq_len"), cfg.source_of("context.schedule")
    if seq == SOURCE_DEFAULT or not cfg.context.schedule:
        return
    if seq == sched:
        raise ConfigError(
            f"{cfg.describe('training.seq_len')} and {cfg.describe('context.schedule')} "
            f"both set the sequence length; give one (training.seq_len is one stage)"
        )
    if seq > sched:
        cfg.context.schedule = []
        cfg.sources["context.schedule"] = seq


def load_config(argv: list[str] | None = None, path: str | os.PathLike | None = None) -> JobConfig:
    """Parse the command line (``--config FILE --section.key value ...``)."""
    cli_path, overrides = parse_cli(list(argv or []))
    path = cli_path or path
    toml = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file")
        try:
            with open(p, "rb") as fh:
                toml = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {str(path)!r} is not valid TOML: {e}") from None
    return parse_config(toml, overrides)
