"""Typed trainer configuration: defaults < TOML file < command-line overrides.

A config is a set of dataclass sections (``job``, ``model``, ``training``, ...).
A TOML file sets any subset of their keys; ``--section.key value`` (or
``--section.key=value``) on the command line overrides it, parsed to the
field's type (bools: true/false; lists: comma separated; the context schedule:
``start:seq_len,start:seq_len``).

Validation happens in two layers, both before any process group, folder or
model exists:

* :func:`parse_config` / :func:`load_config` check names, types and choices;
* :func:`validate_config` checks the config against the world size, the model
  flavor and the data: mesh degrees, every stage's sequence length and batch
  size, heads versus sp, data and tokenizer files.

Every problem raises one :class:`ConfigError` whose message names the key and
what would be valid.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..attention import BACKENDS
from ..schedule import DECAYS, ContextSchedule, Stage
from ..suggest import did_you_mean

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
    "config_help",
    "TOKENIZERS_EXTRA_MSG",
]

TOKENIZERS_EXTRA_MSG = (
    "data.tokenizer={path!r} is an HF tokenizer.json, which needs the optional "
    "'tokenizers' package: pip install 'ulysses-dtensor[tokenizers]'"
)


class ConfigError(ValueError):
    """A bad configuration; the message names the key and the valid choices."""


def _f(default, help: str, choices: tuple | None = None):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------- #
# Sections
# --------------------------------------------------------------------------- #


@dataclass
class Job:
    dump_folder: str = _f("./outputs", "folder for metrics.jsonl, checkpoints and TensorBoard")
    seed: int = _f(0, "seed of weight init, data order and RNG")
    description: str = _f("", "free text, printed at start")


@dataclass
class Model:
    hf_path: str = _f(
        "", "a local Hugging Face model directory (config.json + *.safetensors) to start from; "
        "its config sets the shapes and vocabulary (then flavor and the overrides must stay unset)")
    flavor: str = _f("debug", "model size, a key of ulysses_dtensor.models.llama.FLAVORS")
    attn_backend: str = _f(
        "auto", "local attention after the all-to-all (auto: sdpa on CPU, flash_attn/varlen on CUDA bf16)", BACKENDS
    )
    vocab_size: int = _f(0, "0: the tokenizer's vocabulary rounded up to vocab_multiple_of")
    vocab_multiple_of: int = _f(64, "round the tokenizer vocabulary up to a multiple of this")
    dim: int = _f(0, "override of the flavor's hidden size (0: keep)")
    n_layers: int = _f(0, "override of the flavor's layer count (0: keep)")
    n_heads: int = _f(0, "override of the flavor's attention heads (0: keep)")
    n_kv_heads: int = _f(0, "override of the flavor's key/value heads (0: keep)")
    ffn_dim: int = _f(0, "override of the flavor's MLP hidden size (0: keep)")
    rope_theta: float = _f(0.0, "override of the flavor's RoPE base (0: keep)")


@dataclass
class Training:
    steps: int = _f(10, "number of optimizer steps (counted from 1)")
    global_batch_size: int = _f(8, "sequences per step over all dp ranks (fixed-batch mode)")
    tokens_per_step: int = _f(
        0, "tokens per step when context.constant_tokens_per_step (0: global_batch_size "
        "x the first stage's seq_len)")
    micro_batch_size: int = _f(0, "sequences per forward/backward on one dp rank, "
                                  "gradients accumulated (0: the whole local batch at once)")
    seq_len: int = _f(2048, "sequence length when context.schedule is empty (one stage)")
    max_norm: float = _f(1.0, "gradient clipping norm (0: no clipping)")
    mixed_precision_param: str = _f("float32", "FSDP2 parameter dtype for compute",
                                    ("float32", "bfloat16"))
    mixed_precision_reduce: str = _f("float32", "FSDP2 gradient reduce dtype",
                                     ("float32", "bfloat16"))
    compile: bool = _f(False, "torch.compile each transformer block")
    compile_backend: str = _f("inductor", "torch.compile backend")
    pack_qkv: bool = _f(False, "one all-to-all for q, k, v together")


@dataclass
class Parallelism:
    dp_replicate: int = _f(1, "data-parallel replicas (HSDP outer dim)")
    dp_shard: int = _f(-1, "FSDP2 data-parallel shards (-1: what the world size leaves)")
    sp: int = _f(1, "Ulysses sequence-parallel degree")


@dataclass
class Optimizer:
    name: str = _f("adamw", "optimizer", ("adamw",))
    lr: float = _f(3e-4, "peak learning rate")
    betas: list[float] = _f([0.9, 0.95], "AdamW betas")
    eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.1, "AdamW weight decay")


@dataclass
class LRScheduler:
    warmup_steps: int = _f(0, "linear warm-up steps")
    decay: str = _f("linear", "decay after warm-up down to min_lr_ratio at the last step",
                    DECAYS)
    min_lr_ratio: float = _f(0.0, "final learning rate / peak learning rate")


@dataclass
class Context:
    schedule: list[Stage] = _f(
        [], "progressive context length: stages {start_step, seq_len}; the first starts "
        "at step 1 (empty: training.seq_len for the whole run)")
    constant_tokens_per_step: bool = _f(
        False, "keep tokens per step constant across stages (sequences = tokens_per_step "
        "/ seq_len) instead of a constant number of sequences")


@dataclass
class Data:
    path: str = _f("", "'' = built-in corpus (Python stdlib sources); else a local .txt / "
                       ".jsonl file or a directory of them")
    tokenizer: str = _f("byte", "'byte' or the path of an HF tokenizer.json")
    text_key: str = _f("text", "field of each .jsonl record that holds the text")
    shuffle: bool = _f(True, "shuffle document order each epoch (seeded by job.seed)")
    max_corpus_mb: float = _f(8.0, "size cap of the built-in corpus in MiB")


@dataclass
class Checkpoint:
    enable: bool = _f(False, "save checkpoints and resume from the latest complete one")
    folder: str = _f("checkpoint", "checkpoint folder, relative to job.dump_folder")
    interval: int = _f(500, "save every this many steps (and at the last step)")
    keep_latest_k: int = _f(0, "keep only the newest k checkpoints (0: keep all)")


@dataclass
class ActivationCheckpoint:
    mode: str = _f("none", "activation checkpointing", ("none", "full", "selective"))
    selective: str = _f("op", "selective AC: 'op' (save matmuls) or every Nth layer, e.g. '2'")


@dataclass
class Memory:
    tiled_mlp: bool = _f(False, "compute each MLP over sequence tiles (no whole (seq, ffn) tensors)")
    mlp_tiles: int = _f(0, "MLP tiles (0: from the shapes, about seq*ffn/dim^2)")
    tiled_loss: bool = _f(False, "compute logits + loss over sequence chunks (no whole (seq, vocab) logits)")
    loss_chunks: int = _f(0, "loss chunks (0: from the shapes)")
    offload_activations: bool = _f(
        False, "keep checkpointed block inputs in pinned host memory (needs activation_checkpoint.mode='full')"
    )
    offload_params: bool = _f(
        False, "keep parameters, gradients and AdamW state in host memory; AdamW steps on the CPU"
    )


@dataclass
class Metrics:
    log_freq: int = _f(1, "print a console line every this many steps")
    enable_tensorboard: bool = _f(False, "also write TensorBoard events (needs tensorboard)")
    peak_flops: float = _f(0.0, "peak FLOP/s per device for MFU (0: known GPUs only)")
    progress_bar: bool = _f(True, "show a progress bar in the console line")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    context: Context = field(default_factory=Context)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    memory: Memory = field(default_factory=Memory)
    metrics: Metrics = field(default_factory=Metrics)
    # "section.key" names the TOML file or the command line set (parse_config).
    explicit_keys: typing.ClassVar[frozenset] = frozenset()

    def is_set(self, section: str, key: str) -> bool:
        """Whether the user set ``section.key`` (or it differs from its default)."""
        f = _FIELDS[section][key]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        return f"{section}.{key}" in self.explicit_keys or getattr(getattr(self, section), key) != default

    # ----------------------------------------------------------- derived
    def stages(self) -> list[Stage]:
        return list(self.context.schedule) or [Stage(1, self.training.seq_len)]

    def context_schedule(self) -> ContextSchedule:
        """The context schedule this config describes (raises ConfigError)."""
        stages = self.stages()
        tr = self.training
        try:
            if self.context.constant_tokens_per_step:
                tokens = tr.tokens_per_step or tr.global_batch_size * stages[0].seq_len
                return ContextSchedule(stages, tokens_per_step=tokens)
            return ContextSchedule(stages, global_batch_size=tr.global_batch_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def dump_folder(self) -> Path:
        return Path(self.job.dump_folder)

    @property
    def checkpoint_folder(self) -> Path:
        return self.dump_folder / self.checkpoint.folder

    def to_dict(self) -> dict:
        out = {}
        for sec in dataclasses.fields(self):
            out[sec.name] = dataclasses.asdict(getattr(self, sec.name))
        return out


# `from __future__ import annotations` leaves field types as strings: resolve once.
_SECTION_TYPES = {
    name: tp for name, tp in typing.get_type_hints(JobConfig).items()
    if name in {f.name for f in dataclasses.fields(JobConfig)}
}
_FIELD_TYPES = {name: typing.get_type_hints(cls) for name, cls in _SECTION_TYPES.items()}
_FIELDS = {name: {f.name: f for f in dataclasses.fields(cls)} for name, cls in _SECTION_TYPES.items()}


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
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp == list[float]:
        return "a list of numbers"
    if tp == list[Stage]:
        return "a list of {start_step = <int>, seq_len = <int>} tables"
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
    if tp == list[Stage]:
        if not isinstance(value, (list, tuple)):
            raise bad()
        return [_coerce_stage(v, f"{key}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"unsupported config type {tp} for {key}")  # pragma: no cover


def _coerce_stage(value, key: str) -> Stage:
    if isinstance(value, Stage):
        return value
    if not isinstance(value, dict):
        raise ConfigError(
            f"config key {key} must be a table {{start_step = <int>, seq_len = <int>}}, "
            f"got {value!r}"
        )
    names = ("start_step", "seq_len")
    for k in value:
        if k not in names:
            raise ConfigError(
                f"unknown key {k!r} in {key}{_suggest(k, names)}; valid: {', '.join(names)}"
            )
    for k in names:
        if k not in value:
            raise ConfigError(f"{key} is missing {k!r} (a stage is {{start_step, seq_len}})")
    return Stage(
        start_step=_coerce(value["start_step"], int, f"{key}.start_step"),
        seq_len=_coerce(value["seq_len"], int, f"{key}.seq_len"),
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
        if tp is float:
            return float(text)
        if tp is str:
            return text
        if tp == list[float]:
            return [float(x) for x in text.strip("[]").split(",") if x.strip()]
        if tp == list[Stage]:
            stages = []
            for part in text.strip("[]").split(","):
                if not part.strip():
                    continue
                start, length = part.split(":")
                stages.append(Stage(int(start), int(length)))
            return stages
    except ValueError:
        pass
    hint = {
        list[Stage]: " written as start_step:seq_len,start_step:seq_len (e.g. 1:128,4:256)",
        list[float]: " written comma separated (e.g. 0.9,0.95)",
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
    explicit = set()
    for section, table in (toml or {}).items():
        _check_section(section)
        if not isinstance(table, dict):
            raise ConfigError(f"config section [{section}] must be a table, got {table!r}")
        for key, value in table.items():
            _check_key(section, key)
            _apply(cfg, section, key, value, from_cli=False)
            explicit.add(f"{section}.{key}")
    for dotted, raw in overrides:
        section, key = _split_dotted(dotted)
        _apply(cfg, section, key, raw, from_cli=True)
        explicit.add(dotted)
    cfg.explicit_keys = frozenset(explicit)
    _check_values(cfg)
    return cfg


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


def _check_values(cfg: JobConfig) -> None:
    """Range checks that need no world size, model or file."""
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
    positive("checkpoint.interval", cfg.checkpoint.interval)
    positive("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, 0)
    positive("metrics.log_freq", cfg.metrics.log_freq)
    positive("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, 0)
    positive("model.vocab_multiple_of", cfg.model.vocab_multiple_of)
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
    if cfg.memory.offload_activations and cfg.activation_checkpoint.mode != "full":
        raise ConfigError(
            f"memory.offload_activations=true needs activation_checkpoint.mode='full' "
            f"(got {cfg.activation_checkpoint.mode!r}): it offloads the block inputs that "
            f"full checkpointing keeps"
        )
    from .hf_start import check_hf_exclusive_keys

    check_hf_exclusive_keys(cfg, cfg.is_set)
    if not cfg.job.dump_folder:
        raise ConfigError("job.dump_folder must not be empty")
    if Path(cfg.checkpoint.folder).is_absolute() or ".." in Path(cfg.checkpoint.folder).parts:
        raise ConfigError(
            f"checkpoint.folder={cfg.checkpoint.folder!r} must be a relative path inside "
            f"job.dump_folder"
        )
    cfg.context_schedule()  # stage order and tokens_per_step divisibility


# --------------------------------------------------------------------------- #
# Validation against the world, the model and the data
# --------------------------------------------------------------------------- #


def validate_config(cfg: JobConfig, world_size: int):
    """Check everything that can be checked before training; return the ParallelDims.

    Raises ConfigError. Touches no folder and starts no process group.
    """
    from ..mesh import ParallelDims

    par = cfg.parallelism
    try:
        dims = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size)
    except ValueError as e:
        raise ConfigError(f"parallelism: {e}") from None

    try:
        cfg.context_schedule().validate(sp=dims.sp, dp=dims.dp)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    _check_data(cfg)
    args = model_args(cfg, vocab_size=cfg.model.vocab_size or 256)
    from ..ulysses import kv_replication

    try:
        kv_replication(args.n_heads, args.n_kv_heads or args.n_heads, dims.sp)
    except ValueError as e:
        raise ConfigError(
            f"model.flavor={cfg.model.flavor!r} with parallelism.sp={dims.sp}: {e}"
        ) from None
    return dims


def model_args(cfg: JobConfig, vocab_size: int):
    """The LlamaArgs for this config (flavor + overrides, or model.hf_path's
    config.json, whose vocabulary wins over ``vocab_size``), or a ConfigError."""
    if cfg.model.hf_path:
        from .hf_start import hf_model_args

        return hf_model_args(cfg)
    try:
        from ..models.llama import FLAVORS, llama_args
    except ImportError as e:  # pragma: no cover - the model module is part of the package
        raise ConfigError(f"cannot import the model code: {e}") from None
    m = cfg.model
    if m.flavor not in FLAVORS:
        raise ConfigError(
            f"model.flavor={m.flavor!r} is unknown{_suggest(m.flavor, FLAVORS)}; valid: "
            f"{', '.join(FLAVORS)}"
        )
    overrides = {
        k: getattr(m, k)
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta")
        if getattr(m, k)
    }
    try:
        return llama_args(m.flavor, vocab_size=vocab_size, attn_backend=m.attn_backend, **overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.flavor={m.flavor!r} with overrides {overrides}: {e}") from None


def _check_data(cfg: JobConfig) -> None:
    from ..data import DATA_SUFFIXES, data_files

    d = cfg.data
    if d.path:
        p = Path(d.path)
        if not p.exists():
            raise ConfigError(
                f"data.path={d.path!r} does not exist; give a .txt / .jsonl file, a "
                f"directory of them, or '' for the built-in corpus"
            )
        if p.is_file() and p.suffix not in DATA_SUFFIXES:
            raise ConfigError(
                f"data.path={d.path!r} has suffix {p.suffix!r}; valid: "
                f"{', '.join(DATA_SUFFIXES)} (or a directory of such files)"
            )
        if p.is_dir() and not data_files(p):
            raise ConfigError(
                f"data.path={d.path!r} is a directory without any "
                f"{' / '.join(DATA_SUFFIXES)} file"
            )
    from .hf_start import tokenizer_spec

    spec = tokenizer_spec(cfg)
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
    if d.max_corpus_mb <= 0:
        raise ConfigError(f"data.max_corpus_mb={d.max_corpus_mb} must be > 0")


# --------------------------------------------------------------------------- #
# Help
# --------------------------------------------------------------------------- #


def _fmt_default(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        if value and isinstance(value[0], Stage):
            return ",".join(f"{s.start_step}:{s.seq_len}" for s in value)
        return ",".join(map(str, value)) or "[]"
    return repr(value)


def config_help() -> str:
    lines = [
        "usage: torchrun --nproc_per_node=N -m ulysses_dtensor.train "
        "--config train_configs/NAME.toml [--section.key value ...]",
        "",
        "Command-line values override the TOML file, which overrides the defaults.",
    ]
    default = JobConfig()
    for section in _FIELDS:
        lines.append(f"\n[{section}]")
        for key, f in _FIELDS[section].items():
            meta = f.metadata
            choices = f" (choices: {', '.join(meta['choices'])})" if "choices" in meta else ""
            value = _fmt_default(getattr(getattr(default, section), key))
            lines.append(f"  --{section}.{key} = {value}{choices}\n      {meta.get('help', '')}")
    return "\n".join(lines)
