"""The trainer configuration's schema: its sections, keys, types, defaults and help.

A config is a set of dataclass sections (``job``, ``model``, ``training``, ...);
:mod:`.config` builds one from defaults < a TOML file < command-line overrides
and records which source set each key, and :mod:`.config_checks` validates it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..attention import BACKENDS
from ..data.mixture import SourceSpec
from ..evaluation.tasks import TASKS as EVAL_TASKS
from .schedule import DECAYS, ContextSchedule, Stage

# A size the trainer fits to the ranks it gets (``parallelism.sp = "auto"``).
AUTO = "auto"

# Where a key's value came from; a later source overrides an earlier one.
SOURCE_DEFAULT, SOURCE_TOML, SOURCE_CLI = 0, 1, 2
SOURCE_NAMES = {SOURCE_DEFAULT: "the default", SOURCE_TOML: "from the TOML file",
                SOURCE_CLI: "from the command line"}


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
        "its config sets the shapes and vocabulary (flavor and the overrides then have no effect)")
    implementation: str = _f(
        "auto", "what trains the model of hf_path: native (this package's Llama: Llama 3.x, Mistral, "
        "Qwen2/2.5, Qwen3 checkpoints; every memory feature), transformers (transformers' own model "
        "class: any family the Ulysses integration runs), auto (native when it can load the "
        "checkpoint, else transformers)", ("auto", "native", "transformers"))
    allow_untested: bool = _f(
        False, "implementation transformers: run the family without checking it. By default a family must "
        "pass the family matrix for the installed transformers (one it refused is refused with its reason); "
        "one the matrix has not measured (newer than it) is checked at start on the run's own ranks")
    flavor: str = _f("debug", "model size, a key of ulysses_dtensor.models.llama.FLAVORS")
    attn_backend: str = _f(
        "auto", "local attention after the all-to-all (auto: the kernel table, docs/attention-kernels.md: "
        "sdpa on CPU; on CUDA bf16 cudnn for plain causal on Hopper, FlashAttention for documents)", BACKENDS
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
    local_batch_size: int = _f(
        0, "sequences per step on each data-parallel rank: the global batch is this x the data-parallel "
        "ranks, so it divides on any world size (0: training.global_batch_size; give one of the two)")
    tokens_per_step: int = _f(
        0, "tokens per step when context.constant_tokens_per_step (0: global_batch_size "
        "x the first stage's seq_len)")
    micro_batch_size: int = _f(0, "sequences per forward/backward on one dp rank, "
                                  "gradients accumulated (0: the whole local batch at once)")
    seq_len: int = _f(2048, "sequence length when context.schedule is empty (one stage)")
    max_norm: float = _f(1.0, "gradient clipping norm (0: no clipping)")
    max_nonfinite_steps: int = _f(
        3, "steps in a row whose loss or gradient norm is NaN or inf that are skipped (every rank skips the "
        "update; no checkpoint is written); the next one in a row stops the run with one message naming the "
        "step, the ranks and the last good checkpoint (0: stop at the first)")
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
    sp: int | str = _f(
        1, "sequence-parallel degree (ranks that share one sequence), or \"auto\": the largest degree that "
        "divides the ranks left by dp_replicate, dp_shard and tp, stays within one node (LOCAL_WORLD_SIZE), "
        "suits the model's heads and every stage's seq_len; the banner says what it chose")
    ring: int = _f(1, "ring-attention degree inside sp: sp = ring x ulysses, the Ulysses "
                      "all-to-all within groups of sp/ring consecutive ranks (a node), the ring "
                      "across them (1: Ulysses only)")
    tp: int = _f(1, "tensor-parallel degree: the innermost ranks split each block's weights (heads, "
                    "MLP width) with PyTorch's Colwise/RowwiseParallel; world = dp_replicate x dp_shard "
                    "x sp x tp (1: none)")


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
        "at step 1 (empty: training.seq_len for the whole run). A stage may also set "
        "rope_theta and/or rope_scaling = {rope_type = 'default'|'linear'|'dynamic'|'yarn'|"
        "'llama3'|'longrope', <its parameters>} (TOML only); a stage without them keeps "
        "the previous stage's rope")
    constant_tokens_per_step: bool = _f(
        False, "keep tokens per step constant across stages (sequences = tokens_per_step "
        "/ seq_len) instead of a constant number of sequences")


@dataclass
class Data:
    path: str = _f("", "'' = built-in corpus (Python stdlib sources); a token store made by "
                       "python -m ulysses_dtensor.prepare_data; or raw files (small data): .txt, "
                       ".jsonl[.gz|.zst], .parquet, .arrow, or a directory of them")
    sources: list[SourceSpec] = _f(
        [], "a weighted mixture instead of data.path: [[data.sources]] tables {path, weight (one, or "
        "one per context stage), upsample_min_tokens, upsample_factor, name}; on the command line "
        "PATH:WEIGHT,PATH:WEIGHT")
    tokenizer: str = _f("byte", "'byte' or the path of an HF tokenizer.json")
    format: str = _f("text", "text: every token is trained on; chat: 'messages' records rendered with the "
                             "chat template beside the tokenizer, only assistant turns trained on; "
                             "prompt_completion: 'prompt' + 'completion', only the completion trained on",
                     ("text", "chat", "prompt_completion"))
    packing: str = _f(
        "auto", "how samples fill rows: bfd (best-fit decreasing over packing_window samples: a sample is never "
        "split unless it alone is longer than a row; row ends padded, padding ignored), stream (cut the token "
        "stream every seq_len tokens: no padding, a sample crossing a row end continues in the next row as a "
        "new document), auto (bfd for chat / prompt_completion, stream for text)", ("auto", "bfd", "stream"))
    packing_window: int = _f(4096, "bfd: samples packed together (a bounded buffer: the rows of one window "
                                   "are emitted before the next window is read)")
    overlong: str = _f("error", "bfd: samples longer than a row: error (refused before the run starts, with "
                                "their count and the longest), truncate (keep the first seq_len tokens: the "
                                "prompt, the answer cut at its end), split (pieces of seq_len tokens, each its "
                                "own document), drop (counted in the banner and metrics)",
                       ("error", "truncate", "split", "drop"))
    text_key: str = _f("text", "field of each .jsonl record / table column that holds the text")
    shuffle: bool = _f(True, "shuffle document order each epoch (seeded by job.seed)")
    max_corpus_mb: float = _f(8.0, "size cap of the built-in corpus in MiB")
    prefetch: int = _f(1, "batches read ahead in a background thread while a step runs (0: read "
                          "on the training thread)")


@dataclass
class Checkpoint:
    enable: bool = _f(False, "save checkpoints and resume from the latest complete one")
    folder: str = _f("checkpoint", "checkpoint folder, relative to job.dump_folder")
    interval: int = _f(500, "save every this many steps (and at the last step)")
    keep_latest_k: int = _f(0, "keep only the newest k checkpoints (0: keep all)")


@dataclass
class Comm:
    init_timeout_seconds: int = _f(
        600, "seconds any collective may wait for a peer rank during start-up (process group, checkpoint "
        "load), the first step after a (re)start, checkpoint saves, evaluation and the final barrier")
    train_timeout_seconds: int = _f(
        300, "seconds any collective may wait for a peer rank in the other steps; a rank whose peer died "
        "or hangs exits after this long with one line, so torchrun can restart the job or stop it")


@dataclass
class ActivationCheckpoint:
    mode: str = _f("none", "activation checkpointing", ("none", "full", "selective"))
    selective: str = _f("op", "selective AC: 'op' (save matmuls) or every Nth layer, e.g. '2'")
    save_attention: bool = _f(
        False, "with mode='full': keep each layer's attention kernel output and log-sum-exp from forward "
               "(offloaded with the layer input under memory.offload_activations) instead of recomputing the "
               "attention forward; everything else is recomputed")


@dataclass
class Memory:
    tiled_mlp: bool = _f(False, "compute each MLP over sequence tiles (no whole (seq, ffn) tensors)")
    mlp_tiles: int = _f(0, "MLP tiles (0: from the shapes, about seq*ffn/dim^2)")
    tiled_loss: bool = _f(False, "compute logits + loss over sequence chunks (no whole (seq, vocab) logits)")
    loss_chunks: int = _f(0, "loss chunks (0: from the shapes, at most 1 GiB of float32 logits each)")
    head_chunks: int = _f(0, "run the Ulysses exchange and attention over this many chunks of a rank's heads, "
                             "forward and backward (0: from the shapes, one query head per chunk at long "
                             "context; 1: none); counts follow the kv groups")
    offload_activations: bool = _f(
        False, "keep checkpointed block inputs in pinned host memory (needs activation_checkpoint.mode='full')"
    )
    offload_dir: str = _f(
        "", "with offload_activations: a directory on a local disk (NVMe) the offloaded layer inputs go to, "
        "through a bounded pinned staging area in host memory ('': host memory only); checked for space before "
        "step 1; its files are unlinked at once and never outlive the run")
    offload_params: bool = _f(
        False, "keep parameters, gradients and AdamW state in host memory; AdamW steps on the CPU"
    )


@dataclass
class Float8:
    enable: bool = _f(False, "FP8 linear layers (torchao's float8 training, the 'float8' extra): the blocks' matmuls "
                             "in float8 with dynamic scales, the weights in their own precision")
    recipe_name: str = _f("rowwise", "rowwise: a scale per token (what SP needs nothing for); rowwise_with_gw_hp: the "
                                     "weight gradient in high precision; tensorwise: one scale per tensor, its amax "
                                     "reduced over the sp ranks", ("rowwise", "rowwise_with_gw_hp", "tensorwise"))
    filter_fqns: list[str] = _f(["output", "lm_head", "gate", "router"],
                                "modules left in high precision: a dotted part of their name (output head, MoE routers "
                                "by default) or a name prefix")
    emulate: bool = _f(False, "emulate FP8 matmuls (any device, CPU included): for tests only")
    enable_fsdp_float8_all_gather: bool = _f(
        False, "FSDP2 all-gathers the weights in FP8 (half the bf16 bytes; scales computed once per step); "
        "recipe_name='tensorwise' only")


@dataclass
class Lora:
    rank: int = _f(0, "LoRA adapters of this rank on target_modules, the base weights frozen (peft's LoRA "
                      "layers; needs model.hf_path; 0: train every weight)")
    alpha: float = _f(16.0, "LoRA scaling numerator: the adapters' output is scaled by alpha / rank")
    dropout: float = _f(0.0, "dropout on the adapters' input (recomputation under activation checkpointing "
                             "replays the same masks)")
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Linear modules that get adapters: names or name suffixes, as peft matches them (transformers' names; "
        "this package's Llama takes the same names)")
    modules_to_save: list[str] = _f([], "modules trained whole beside the adapters (e.g. norm, embed_tokens), "
                                        "saved in the adapter")


@dataclass
class Metrics:
    log_freq: int = _f(1, "print a console line every this many steps")
    enable_tensorboard: bool = _f(False, "also write TensorBoard events (needs tensorboard)")
    enable_wandb: bool = _f(
        False, "also log each metrics.jsonl row to Weights & Biases, from rank 0 (needs wandb: pip install "
        "'ulysses-dtensor[wandb]'); the run is named after job.dump_folder, the config attached; WANDB_PROJECT, "
        "WANDB_ENTITY, WANDB_MODE=offline ... as wandb reads them")
    peak_flops: float = _f(0.0, "peak FLOP/s per device for MFU (0: known GPUs only)")
    progress_bar: bool = _f(True, "show a progress bar in the console line")
    exchange_timing: bool = _f(
        True, "time the Ulysses all-to-alls (forward and backward) and log their share of the "
        "step time (needs parallelism.sp > 1; eager blocks only, not training.compile)")


@dataclass
class Eval:
    interval: int = _f(0, "evaluate every this many steps and at the last step during training "
                          "(0: not during training; python -m ulysses_dtensor.eval uses this section)")
    lengths: list[int] = _f([], "eval lengths in tokens (empty: the training length at that step; "
                                "for python -m ulysses_dtensor.eval the last stage's)")
    tasks: list[str] = _f(list(EVAL_TASKS), f"any of {', '.join(EVAL_TASKS)}: held-out loss by "
                          "position, passkey retrieval, multi-key needle, variable tracking")
    depths: int = _f(10, "needle depths per length, evenly spaced from 0% to 100%")
    samples: int = _f(1, "retrieval samples per (task, length, depth)")
    loss_rows: int = _f(4, "held-out sequences per length for the loss by position")
    data_path: str = _f("", "held-out documents for the loss (.txt / .jsonl / directory, read "
                            "with data.tokenizer and data.text_key)")
    holdout_fraction: float = _f(0.0, "or: hold this fraction of data.path's documents out of "
                                      "training and evaluate the loss on them")
    seed: int = _f(1234, "seed of the retrieval samples")


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
    comm: Comm = field(default_factory=Comm)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    memory: Memory = field(default_factory=Memory)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    metrics: Metrics = field(default_factory=Metrics)
    eval: Eval = field(default_factory=Eval)

    def __post_init__(self) -> None:
        # Where each key was set: "section.key" -> SOURCE_TOML or SOURCE_CLI
        # (absent: the default). Checks use it to tell a setting the user made
        # from a default, and which of two settings came later. Not a field: it
        # is not part of the saved config.
        self.sources: dict[str, int] = {}
        # What the trainer chose for "auto" sizes and why (parallelism.sp, the global
        # batch from training.local_batch_size), for the banner: see trainer/mesh_fit.py.
        self.fitted: list[str] = []

    def source_of(self, dotted: str) -> int:
        return self.sources.get(dotted, SOURCE_DEFAULT)

    def describe(self, dotted: str) -> str:
        """``section.key=value (where it was set)``, for messages."""
        section, key = dotted.split(".", 1)
        value = getattr(getattr(self, section), key)
        shown = _fmt_default(value) if isinstance(value, (bool, list)) else repr(value)
        return f"{dotted}={shown} ({SOURCE_NAMES[self.source_of(dotted)]})"

    # ----------------------------------------------------------- derived
    def stages(self) -> list[Stage]:
        return list(self.context.schedule) or [Stage(1, self.training.seq_len)]

    def context_schedule(self) -> ContextSchedule:
        """The context schedule this config describes (raises ConfigError)."""
        stages = self.stages()
        tr = self.training
        key = None if self.context.schedule else "training.seq_len"
        try:
            if self.context.constant_tokens_per_step:
                tokens = tr.tokens_per_step or tr.global_batch_size * stages[0].seq_len
                return ContextSchedule(stages, tokens_per_step=tokens, length_key=key)
            return ContextSchedule(stages, global_batch_size=tr.global_batch_size, length_key=key)
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
_SECTION_TYPES = typing.get_type_hints(JobConfig)
_FIELD_TYPES = {name: typing.get_type_hints(cls) for name, cls in _SECTION_TYPES.items()}
_FIELDS = {name: {f.name: f for f in dataclasses.fields(cls)} for name, cls in _SECTION_TYPES.items()}


# --------------------------------------------------------------------------- #
# Help
# --------------------------------------------------------------------------- #


def _fmt_default(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        if value and isinstance(value[0], Stage):
            return ",".join(f"{s.start_step}:{s.seq_len}" + (" (rope)" if s.sets_rope else "")
                            for s in value)
        if value and isinstance(value[0], SourceSpec):
            return ",".join(f"{s.path}:{s.weight}" for s in value)
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
