"""The library versions the integrations were tested with, checked where each integration starts.

The parity tests ran against one version of each library (:data:`TESTED`, the one place
that names them; ``tests/test_versions.py`` holds it to pyproject.toml's pins and to the
test environment). When another version is installed, the integration says so at start:

* a warning (:class:`UntestedVersionWarning`, once per process, on local rank 0) when
  every private member it relies on (:data:`PRIVATE_MEMBERS`) is still there: it runs,
  its results on that version untested;
* a refusal (:class:`UntestedVersionError`, one message naming the library, the installed
  and tested versions, each missing member and the override) when one is gone or lost a
  parameter: an override of a renamed private method is silently never called, a call to
  a removed one fails deep inside a step. ``ULYSSES_DTENSOR_ALLOW_UNTESTED_VERSIONS=trl``
  (comma-separated library names, or ``all``) turns the refusal into a warning.

"Private" here is what the libraries do not promise to keep: underscored methods and
attributes, module globals that are patched, and the undocumented seams that are
overridden (torchtitan 0.x has no stable API: its trainer hooks and the functions the
plug-in calls). Public API (``peft``'s) is not listed: another version only warns.

At the tested version nothing is imported or read; at another, the members are looked
up once per process (imports of modules the integration imports anyway, and a search
of a few modules' source for the attributes set in ``__init__``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import warnings
from dataclasses import dataclass

__all__ = [
    "ALLOW_ENV",
    "PRIVATE_MEMBERS",
    "TESTED",
    "Member",
    "UntestedVersionError",
    "UntestedVersionWarning",
    "check_library",
    "check_version",
    "installed_version",
    "missing_members",
]

# The versions the parity tests ran (pyproject.toml pins those it pins with ==).
TESTED = {
    "transformers": "5.24.0",
    "accelerate": "1.16.0",
    "trl": "1.16.0",
    "peft": "0.21.2",
    "torchtitan": "0.3.0",
}

ALLOW_ENV = "ULYSSES_DTENSOR_ALLOW_UNTESTED_VERSIONS"


class UntestedVersionError(RuntimeError):
    """An installed library lacks a private member the integration relies on.

    Not an ImportError: torchtitan's ``--module`` lookup swallows ImportErrors of the
    module it imports, and this message must reach the user."""


class UntestedVersionWarning(UserWarning):
    """An installed library is not the version the integration was tested with."""


@dataclass(frozen=True)
class Member:
    """``path``: ``"module:Owner.name"`` (``"module:name"`` for a module global).
    ``params``: the leading parameters (after ``self``), in order, as the integration
    calls the member or overrides it. ``keywords``: parameters it passes by name.
    ``in_source``: an attribute set at run time (in ``__init__``), so the check is that
    its name still appears in the module's source."""

    path: str
    params: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    in_source: bool = False

    @property
    def name(self) -> str:
        return self.path.replace(":", ".")


def _m(path: str, *params: str, keywords: tuple[str, ...] = (), in_source: bool = False) -> Member:
    return Member(path, tuple(params), keywords, in_source)


_TRAINER = "transformers.trainer:Trainer."
_GRPO = "trl.trainer.grpo_trainer:GRPOTrainer."
_TT_TRAINER = "torchtitan.trainer:Trainer."
_FSDP_KEYWORDS = ("param_dtype", "reduce_dtype", "pp_enabled", "cpu_offload", "reshard_after_forward_policy",
                  "ep_degree", "edp_mesh", "enable_symm_mem")

# library -> part -> the members that part of the integration relies on (where it uses them in brackets).
PRIVATE_MEMBERS: dict[str, dict[str, tuple[Member, ...]]] = {
    "transformers": {
        # hf/ulysses_trainer/ (UlyssesHFTrainer, and TRL's trainers through UlyssesTrainerMixin)
        "Trainer": (
            _m(_TRAINER + "create_accelerator_and_postprocess"),  # mixin: where the model is sharded
            _m(_TRAINER + "loss_is_scaled_for_ga"),  # mixin: the loss is not divided again
            _m(_TRAINER + "_get_num_items_in_batch", "batch_samples", "device"),  # mixin
            _m(_TRAINER + "_move_model_to_device", "model", "device"),  # mixin
            _m(_TRAINER + "_set_signature_columns_if_needed"),  # mixin.causal_lm
            _m(_TRAINER + "_prepare_inputs", "inputs"),  # mixin.prediction_step
            _m(_TRAINER + "save_model", "output_dir", "_internal_call"),  # mixin
            _m(_TRAINER + "_save_optimizer_and_scheduler", "output_dir"),  # mixin
            _m(_TRAINER + "_load_from_checkpoint", "resume_from_checkpoint", "model"),  # mixin
            _m(_TRAINER + "_load_best_model"),  # mixin
            _m(_TRAINER + "_load_optimizer_and_scheduler", "checkpoint"),  # mixin
            _m(_TRAINER + "_clip_grad_norm", "model"),  # nonfinite_steps
            _m(_TRAINER + "_get_grad_norm", "model", "grad_norm"),  # nonfinite_steps
            _m(_TRAINER + "_save_checkpoint", "model", "trial"),  # nonfinite_steps
            _m(_TRAINER + "_train_batch_size", in_source=True),  # mixin.get_total_train_batch_size
            _m(_TRAINER + "current_gradient_accumulation_steps", in_source=True),  # mixin.compute_loss
        ),
        # hf/ (parallelize_hf_model and what it calls)
        "models": (
            _m("transformers.configuration_utils:PreTrainedConfig._attn_implementation", in_source=True),
            _m("transformers.modeling_utils:PreTrainedModel._supports_attention_backend"),  # parallelize_model
            _m("transformers.modeling_utils:PreTrainedModel._no_split_modules"),  # families, parallelize_model
            _m("transformers.modeling_utils:PreTrainedModel._init_weights", "module"),  # checkpoint_io
            _m("transformers.models.auto.modeling_auto:AutoModelForCausalLM._model_mapping"),  # causal_lm
            _m("transformers.models.auto.modeling_auto:AutoModelForImageTextToText._model_mapping"),  # causal_lm
            _m("transformers.initialization:_is_hf_initialized", in_source=True),  # weights: skips our tensors
        ),
    },
    "accelerate": {
        # hf/ulysses_trainer/accelerator.py: the Trainer's accelerator over data-parallel ranks
        "Accelerator": (
            _m("accelerate.accelerator:Accelerator._models", in_source=True),
            _m("accelerate.accelerator:Accelerator._dataloaders", in_source=True),
            _m("accelerate.accelerator:_is_accelerate_prepared", in_source=True),
        ),
    },
    "trl": {
        "SFTTrainer": (  # trl/sft_trainer.py
            _m("trl.trainer.sft_trainer:SFTTrainer._metrics", in_source=True),
            _m("trl.trainer.sft_trainer:SFTTrainer._total_train_tokens", in_source=True),
            _m("trl.trainer.sft_trainer:SFTTrainer._is_vision_dataset", in_source=True),
        ),
        "GRPOTrainer": (  # trl/grpo_trainer.py, trl/rollouts.py
            _m(_GRPO + "_generate", "prompts"),
            _m(_GRPO + "_calculate_rewards", "inputs", "prompts", "completions", "completion_ids_list"),
            _m(_GRPO + "_generate_and_score_completions", "inputs"),
            _m(_GRPO + "_get_per_token_logps_and_entropies", "model", "input_ids", "attention_mask",
               "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss"),
            _m(_GRPO + "_pending_extra_logs", in_source=True),
            _m(_GRPO + "_pending_metrics", in_source=True),
            _m(_GRPO + "_is_vlm", in_source=True),
            _m("trl.trainer.grpo_trainer:gather_object"),  # rollouts: patched for the rank views
            _m("trl.generation.vllm_generation:VLLMGeneration._iter_named_params"),  # vLLM gets full weights
        ),
        "DPOTrainer": (  # trl/dpo_trainer.py
            _m("trl.trainer.dpo_trainer:hash_module", "module"),  # patched: the precompute's cache key
        ),
    },
    # integrations/lora.py, the trainers' peft models: peft's public API only.
    "peft": {},
    "torchtitan": {
        # integrations/torchtitan/: the hooks the plug-in overrides, the functions it calls
        "plug-in": (
            _m(_TT_TRAINER + "init_distributed"),
            _m(_TT_TRAINER + "train_step", "data_iterator"),
            _m(_TT_TRAINER + "forward_backward_step", keywords=("input_dict", "labels", "global_valid_tokens")),
            _m(_TT_TRAINER + "post_dataloading_process", "input_dict", "labels"),
            _m(_TT_TRAINER + "ntokens_seen", in_source=True),
            _m(_TT_TRAINER + "pp_has_last_stage", in_source=True),
            _m(_TT_TRAINER + "pp_schedule", in_source=True),
            _m("torchtitan.components.validate:Validator.post_dataloading_process", "input_dict", "labels",
               "model_parts"),
            _m("torchtitan.components.metrics:MetricsProcessor.log", "step", "global_avg_loss", "global_max_loss",
               "grad_norm", "extra_metrics"),
            _m("torchtitan.distributed.utils:init_distributed", "comm_config",
               keywords=("enable_cpu_backend", "base_folder")),
            _m("torchtitan.distributed.fsdp:apply_fsdp_to_decoder", "model", "dp_mesh", keywords=_FSDP_KEYWORDS),
            _m("torchtitan.models.deepseek_v3.mtp:apply_fsdp_to_mtp_decoder", "model", "dp_mesh",
               keywords=_FSDP_KEYWORDS),
            _m("torchtitan.distributed.compile:apply_compile", "model", keywords=("compile_config", "parallel_dims")),
            _m("torchtitan.protocols.model_spec:ModelSpec.parallelize_fn"),
            _m("torchtitan.config.override:derive"),
            _m("torchtitan.config.override:override"),
        ),
    },
}


@functools.cache  # once per process: every parallelize_hf_model call asks
def installed_version(library: str) -> str | None:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


def _problem(member: Member) -> str | None:
    """What is wrong with ``member`` on the installed version (None: nothing)."""
    module_name, _, qualname = member.path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a module that no longer imports: everything in it is gone
        return f"{module_name} does not import ({type(e).__name__}: {e})"
    *owners, attr = qualname.split(".")
    owner = module
    for i, name in enumerate(owners):
        owner = getattr(owner, name, None)
        if owner is None:
            return f"{module_name}.{'.'.join(owners[:i + 1])} is gone"
    if member.in_source:
        try:
            text = inspect.getsource(module)
        except (OSError, TypeError):
            return None  # no source to read (a compiled install): not a finding
        return None if re.search(rf"\b{re.escape(attr)}\b", text) else "gone"
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    if not hasattr(owner, attr) and attr not in fields:
        return "gone"
    if not (member.params or member.keywords):
        return None
    value = getattr(owner, attr)
    try:
        names = list(inspect.signature(value).parameters)
    except (TypeError, ValueError):
        return None
    if inspect.isclass(owner) and inspect.isfunction(value) and not isinstance(
            inspect.getattr_static(owner, attr), staticmethod):
        names = names[1:]  # a method read off its class: self
    if names[:len(member.params)] != list(member.params):
        return f"parameters ({', '.join(names)}), not ({', '.join(member.params)}, ...)"
    absent = [k for k in member.keywords if k not in names]
    return f"no parameter {absent[0]!r}" if absent else None


_found: dict[tuple[str, str | None], list[str]] = {}  # (library, part) -> its problems, looked up once


def missing_members(library: str, part: str | None = None) -> list[str]:
    """``"member (what is wrong)"`` for each member of ``part`` of ``library``
    (every part: None) that the installed version lacks; cached per process."""
    key = (library, part)
    if key not in _found:
        parts = PRIVATE_MEMBERS[library]
        members = [m for p in ([part] if part else parts) for m in parts[p]]
        _found[key] = [f"{m.name} ({why})" for m in members if (why := _problem(m)) is not None]
    return _found[key]


def _allowed(library: str) -> str | None:
    """The override's value when it lets ``library`` run untested."""
    value = os.environ.get(ALLOW_ENV, "")
    names = {n.strip().lower() for n in value.split(",")}
    return value if library in names or "all" in names else None


_warned: set[tuple[str, tuple[str, ...]]] = set()


def _warn_once(library: str, missing: list[str], message: str) -> None:
    key = (library, tuple(missing))
    if key in _warned:
        return
    _warned.add(key)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node under torchrun
        warnings.warn(message, UntestedVersionWarning, stacklevel=2)


def check_version(library: str, found: str | None, part: str | None = None, *, user: str | None = None) -> None:
    """At ``found`` (the installed version; None: not installed, its own import says so):
    nothing at :data:`TESTED`'s version, else a warning, or :class:`UntestedVersionError`
    when a member of ``part`` (None: every part) is missing and the override does not
    allow it. ``user``: what relies on the members, for the message."""
    tested = TESTED[library]
    if found is None or found == tested:
        return
    user = user or f"ulysses_dtensor's {library} integration"
    missing = missing_members(library, part)
    if not missing:
        _warn_once(library, missing, (
            f"{library}=={found} is installed; {user} was tested with {library}=={tested}. The private "
            f"{library} members it relies on are all there, so it runs, but its results with {found} are "
            f"untested; install {library}=={tested} for the tested setup."))
        return
    what = "; ".join(missing)
    allowed = _allowed(library)
    if allowed is None:
        raise UntestedVersionError(
            f"{user} relies on private {library} members that {library}=={found} (installed) lacks: {what}. "
            f"It was tested with {library}=={tested}: install {library}=={tested}, or set "
            f"{ALLOW_ENV}={library} to run it anyway (it may fail or compute wrong results).")
    _warn_once(library, missing, (
        f"{library}=={found} is installed; {user} was tested with {library}=={tested} and relies on private "
        f"members it lacks: {what}. Running anyway ({ALLOW_ENV}={allowed}): it may fail or compute wrong "
        "results."))


def check_library(library: str, part: str | None = None, *, user: str | None = None) -> None:
    """:func:`check_version` at the installed version of ``library``."""
    check_version(library, installed_version(library), part, user=user)
