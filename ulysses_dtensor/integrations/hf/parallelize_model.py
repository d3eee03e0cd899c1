"""Ulysses SP + activation checkpointing + torch.compile + FSDP2 for unmodified
Hugging Face ``transformers`` causal LMs.

::

    pmesh = ParallelDims(dp_shard=-1, sp=4).build_mesh("cuda")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    parallelize_hf_model(model, pmesh, ac_mode="full", compile=True)
    inputs, labels = shard_hf_batch(batch, pmesh.sp)       # this rank's slice
    loss = sp_cross_entropy(model(**inputs).logits, labels, pmesh.loss)

The model's own code runs unchanged on this rank's slice of the sequence
(embeddings, norms, q/k/v projections, rope with global position ids, q/k
norms, MLP, head); only the attention core sees the whole sequence, for
``heads/sp`` heads, through transformers' attention registry (see
:mod:`.attention_function`). Per decoder layer the order is the one
``parallelize_llama`` uses and explains: Ulysses, activation checkpointing,
compile, ``fully_shard``. Two differences keep parameter names those of the
checkpoint (so ``state_dict()`` keys load and save as HF files): compile is
applied in place (``module.compile()``, no ``_orig_mod.`` prefix), and the
checkpoint wrapper's prefix is already hidden from ``state_dict()`` by torch.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Callable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import parallelize_module

from ulysses_dtensor.attention import check_backend
from ulysses_dtensor.memory.offload import OffloadedCheckpointBlock, make_offloader
from ulysses_dtensor.memory.saved_attention import attention_keeping
from ulysses_dtensor.memory.options import MemoryOptions
from ulysses_dtensor.precision.float8 import Float8Options
from ulysses_dtensor.models.llama_parallelize import (
    _check_compile_backend,
    apply_float8,
    checkpoint_block,
    needs_rng_replay,
    shard_model,
)
from ulysses_dtensor.parallel.head_chunk_plan import recomputes_in_chunks
from ulysses_dtensor.parallel.mesh import ParallelMesh
from ulysses_dtensor.parallel.ring_layout import layout_position_ids
from ulysses_dtensor.parallel.tensor_parallel import check_tp_heads, hf_tp_plan, tensor_parallelize
from ulysses_dtensor.parallel.ulysses import UlyssesAttention, check_chunks_for_heads, kv_replication

from ..versions import check_library
from .attention_function import (
    ATTN_IMPLEMENTATION,
    DOCUMENT_IDS_KWARG,
    CallState,
    UlyssesCore,
    check_backend_for_patterns,
    model_patterns,
    ulysses_attention_forward,
)
from .families import (
    check_known_family,
    decoder_layers,
    is_attention_module,
    text_config_key,
)
from .matrix.check import verify_at_start
from .matrix.results import FamilyStatus
from .memory_switches import (
    lean_norms,
    per_token_blocks,
    per_token_width,
    tile_per_token_blocks,
)
from .memory_switches import norm_formula as _norm_formula
from .mixers.layer_types import (
    PER_TOKEN_LAYER_TYPES,
    check_layer_types,
    has_token_mixers,
    token_mixer_modules,
)
from .model_inputs import SEQ_LEN_KWARG, shard_hf_batch
from .moe import install_router_aux_loss

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DOCUMENT_IDS_KWARG",
    "SEQ_LEN_KWARG",
    "check_ring_model",
    "check_tp_model",
    "parallelize_hf_model",
    "register_ulysses_attention",
    "shard_hf_batch",
]

# Layer kinds whose attention is ordinary causal attention (sliding windows are
# checked against the sequence length at run time). Anything else -- chunked or
# indexed attention, recurrences other than the mixers of hf_mixers -- would mix
# tokens over the local slice only, silently wrong under SP.
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")

# Inputs of a multimodal model's encoders: those run on whole images, which
# under SP would be scattered into a sliced sequence. The text path only.
_ENCODER_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "input_features")


def register_ulysses_attention() -> None:
    """Register :func:`ulysses_attention_forward` in transformers' attention
    registry as :data:`ATTN_IMPLEMENTATION` (idempotent; a class-wide mapping)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention_forward)


def parallelize_hf_model(
    model: nn.Module,
    pmesh: ParallelMesh,
    *,
    memory: MemoryOptions | None = None,
    compile: bool = False,
    compile_backend: str | Callable = "inductor",
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    attn_backend: str = "auto",
    pack_qkv: bool = False,
    allow_untested: bool = False,
    float8: Float8Options | None = None,
    **switches,
) -> nn.Module:
    """Apply Ulysses SP, activation checkpointing, compile and FSDP2 to ``model`` in place.

    ``model`` is a transformers causal LM (``AutoModelForCausalLM.from_config``
    or ``from_pretrained``), on a device or on ``meta`` (then ``to_empty``
    after this call and :func:`~.hf_checkpoint.load_hf_weights`).

    Args:
        pmesh: from ``ParallelDims(...).build_mesh(device_type)``. Parameters
            are sharded over ``dp_shard x sp`` (HSDP over ``dp_replicate``).
        memory: the memory switches (:class:`~ulysses_dtensor.memory.options.MemoryOptions`);
            ``**switches``: the same as keywords (``ac_mode="full"``, ``tiled_mlp=True``, ...).
            As in ``parallelize_llama``, with these differences: ``tiled_mlp`` tiles each
            decoder layer's per-token block (its MLP, or its MoE block: router, experts,
            shared experts; :mod:`.memory_switches`); ``tiled_loss`` / ``loss_chunks`` act
            in the output head :func:`~.causal_lm.adapt_causal_lm` puts on the model (it
            reads them from ``model.memory_options``); ``save_attention`` recomputes the
            ``sdpa`` backend's soft-cap / sinks path (not one kernel), with a warning; a
            head chunk whose kernel has no split backward (soft-capping and sinks, ``flex``,
            ``flash_attn``, ``cudnn`` with a mask) re-runs its attention forward in
            backward, outside the layer's compiled graph.
        compile_backend, param_dtype, reduce_dtype, reshard_after_forward, pack_qkv: as in
            :func:`~ulysses_dtensor.models.llama_parallelize.parallelize_llama`.
        compile: compile each decoder layer in place, with ``fullgraph=True``
            where transformers declares the model fullgraph-compilable
            (``_can_compile_fullgraph``), else allowing graph breaks.
        attn_backend: the local attention backend
            (:func:`~ulysses_dtensor.attention.local_attention`): ``"auto"``,
            ``"sdpa"``, ``"flash_attn"``, ``"varlen"``, ``"flex"``. Sliding
            windows, soft-capping and sinks pass through to it (``auto`` picks a
            kernel that has them; a named one that has not is refused).
        float8: FP8 linear layers (:class:`~ulysses_dtensor.precision.float8.Float8Options`), converted
            before anything else; the output head and MoE routers stay in high precision by default, and
            fused MoE experts are refused by name unless filtered.
        allow_untested: skip the family check. By default a family must pass the
            family matrix for the installed transformers (:mod:`~ulysses_dtensor.integrations.hf.matrix.results`; a family
            it refused is refused with its reason), or, when the matrix has not measured
            it (a newer family, another transformers version), pass the same comparison at
            start on this mesh's ranks (:func:`~.family_check.verify_at_start`: a tiny model
            of its config class, about a second). ``model.family_status`` says which.

    USP (a mesh with ``ring > 1``): the exchange runs over the ulysses ranks and
    ring attention over the ring ranks, for causal attention with packed
    documents; models with sliding windows, soft-capping, sinks or linear-attention
    layers are refused with the reason. Batches come from :func:`shard_hf_batch`
    with ``pmesh.sp`` (it lays the sequence out for the ring).

    Multimodal models (Qwen2.5-VL): the text decoder is parallelized and the
    vision tower left as it is; calls with image or video inputs are refused.
    MoE models: ``output_router_logits=True`` returns as ``aux_loss`` this
    rank's share of the router loss of the whole global batch (see
    :mod:`.moe`), folded into ``loss`` where transformers adds it.

    Gradients are SUMMED over ranks: use :func:`~ulysses_dtensor.parallel.loss.sp_cross_entropy`
    (each rank's share of the global token mean). The model is then called with
    :func:`shard_hf_batch`'s inputs; generation (a KV cache) is not supported.
    """
    check_library("transformers", "models", user="parallelize_hf_model")
    mem = MemoryOptions.merged(memory, switches, "parallelize_hf_model")  # the switches' own rules checked here
    ac_mode, head_chunks = mem.ac_mode, mem.head_chunks
    name = type(model).__name__
    ring = getattr(pmesh.dims, "ring", 1)
    tp = getattr(pmesh.dims, "tp", 1)
    layers, attentions, linear, status = _check_model(model, pmesh.dims.ulysses, allow_untested, tp, head_chunks)
    blocks = per_token_blocks(name, layers) if mem.tiled_mlp else []
    if ring > 1:
        check_ring_model(model, attentions, linear, attn_backend, ring)
    tp_plan = check_tp_model(model, layers, linear, tp) if tp > 1 else None
    # transformers 5 renamed is_gradient_checkpointing (deprecated, warns) to is_activation_checkpointing.
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if ac_mode != "none" and checkpointing:
        raise ValueError(
            f"{name} already has transformers' gradient checkpointing enabled; use either it "
            f"(ac_mode='none') or ac_mode={ac_mode!r}, not both"
        )
    if compile and isinstance(compile_backend, str):
        _check_compile_backend(compile_backend)
    check_backend(attn_backend)
    check_backend_for_patterns(name, attn_backend, model_patterns(model.config.get_text_config(), attentions))
    if status.state == "unmeasured":  # newer than the family matrix: measured here, on these ranks
        status = verify_at_start(model, pmesh, status.model_type, status.detail,
                                 parallelize=parallelize_hf_model, attn_backend=attn_backend, pack_qkv=pack_qkv)
    model.family_status = status  # what the trainer's banner shows

    apply_float8(model, float8, pmesh, tp)  # first: the FP8 layers are what the rest wraps and shards

    # 1. Ulysses: transformers' attention dispatch -> our exchange + local attention.
    register_ulysses_attention()
    text_key = text_config_key(model)
    if text_key is None:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:
        # The text decoder only: a vision tower keeps its own (bidirectional) attention.
        keep = {k: getattr(model.config, k)._attn_implementation for k in model.config.sub_configs
                if getattr(model.config, k, None) is not None}
        model.set_attn_implementation({**keep, "": ATTN_IMPLEMENTATION, text_key: ATTN_IMPLEMENTATION})
    if model.config.get_text_config()._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{name} refused attention implementation {ATTN_IMPLEMENTATION!r} (it stays "
            f"{model.config._attn_implementation!r}): it does not dispatch attention through "
            "transformers' AttentionInterface"
        )
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.use_cache = False  # a KV cache of local slices would be wrong
    call = CallState()  # what each call's pre-hook learns, for the layers and post-hooks
    for attn in attentions:
        core = UlyssesCore(attn_backend, name, pmesh.dims.ulysses, pmesh.ring, call)
        attn.ulysses = parallelize_module(core, pmesh.ulysses,
                                          UlyssesAttention(pack_qkv=pack_qkv, head_chunks=head_chunks))
    # Hybrid models: each token mixer (gated delta-net, Mamba, short convolution) exchanges
    # around its convolution + recurrence.
    for module, mixer in linear:
        parallelize_module(module, pmesh.sp, mixer.style(name, call))
    # Tensor parallelism: transformers' own plan for the family, PyTorch's styles.
    if tp_plan is not None:
        tensor_parallelize(list(layers), pmesh.tp, tp_plan)
    # The per-token blocks over tiles of the tokens, and RMSNorms that keep only their input for
    # backward (classes swapped in place: names unchanged).
    if blocks:
        tile_per_token_blocks(blocks, mem.mlp_tiles, per_token_width(model.config.get_text_config()))
    lean_norms(model)

    # 2-3. Activation checkpointing (or the host-offloaded checkpoint), then compile around
    # it (in place: names unchanged). Offload wraps the compiled layer: its host copies
    # and side streams are not traceable, the layer is.
    fullgraph = bool(getattr(model, "_can_compile_fullgraph", False)) and not recomputes_in_chunks(
        head_chunks, attn_backend, model_patterns(model.config.get_text_config(), attentions))
    model.offloader = make_offloader(mem)
    model.memory_options = mem
    keep = attention_keeping(model, mem.save_attention)
    rng = needs_rng_replay(model)  # dropout (LoRA's): recomputation replays forward's masks
    for i, layer in enumerate(layers):
        if model.offloader is None:
            layer = checkpoint_block(layer, i, ac_mode, mem.every_k, preserve_rng_state=rng, keep=keep)
        if compile:
            layer.compile(backend=compile_backend, fullgraph=fullgraph)
        if model.offloader is not None:
            layer = OffloadedCheckpointBlock(layer, model.offloader, preserve_rng_state=rng, keep=keep)
        layers[i] = layer

    # 4. FSDP2 / HSDP, one group per decoder layer.
    _fully_shard(model, layers, pmesh, param_dtype, reduce_dtype, reshard_after_forward, mem.offload_params)
    # Input checks run first, before FSDP's own pre-forward (all-gathers): bad
    # input fails before any communication.
    model.register_forward_pre_hook(
        functools.partial(_prepare_inputs, name=name, sp=pmesh.dims.sp, sp_rank=pmesh.sp_rank, ring=ring, call=call),
        with_kwargs=True, prepend=True,
    )
    install_router_aux_loss(model, pmesh.loss, functools.partial(_valid_tokens, call=call, sp=pmesh.dims.sp,
                                                                 sp_rank=pmesh.sp_rank, ring=ring))
    return model


def _valid_tokens(batch: int, seq: int, *, call: CallState, sp: int, sp_rank: int, ring: int) -> Tensor | None:
    """(batch * seq,) True for this rank's real tokens, False for padding; None: all real."""
    if call.seq_len is None:
        return None
    positions = layout_position_ids(seq, sp_rank, sp, ring)  # where this rank's tokens sit in the sequence
    return (positions < call.seq_len).expand(batch, seq).reshape(-1)


def _check_model(
    model: nn.Module, sp: int, allow_untested: bool = False, tp: int = 1, head_chunks: int | None = 1
) -> tuple[nn.ModuleList, list[nn.Module], list[tuple], FamilyStatus]:
    """Refuse what Ulysses attention (``sp``: the ulysses degree) cannot run correctly,
    with ``tp`` ranks splitting the heads first; return the decoder layers, the
    attention modules, the other token mixers (module, :class:`~.hf_mixers.TokenMixer`) in
    them and the family's status (:func:`~.hf_families.check_known_family`)."""
    try:
        from transformers import PreTrainedModel
    except ImportError as e:  # pragma: no cover - the hf extra is absent
        raise ImportError("parallelize_hf_model needs transformers: pip install 'ulysses-dtensor[hf]'") from e
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"parallelize_hf_model expects a transformers PreTrainedModel, got {name}")
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; Ulysses SP here supports decoder-only causal LMs")
    # Layer types first: hybrids (Mamba, conv, linear attention) are named by their layer type.
    check_layer_types(model, _SUPPORTED_LAYER_TYPES)
    # Hybrids declare no attention backend (their mixers cannot honour one); their attention
    # layers dispatch through the registry all the same (the family matrix measures it).
    if not getattr(model, "_supports_attention_backend", False) and not has_token_mixers(model):
        raise ValueError(
            f"{name} does not dispatch attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so Ulysses attention cannot be plugged in"
        )
    text = config.get_text_config()
    if not getattr(text, "is_causal", True) or not getattr(config, "is_causal", True):
        raise ValueError(f"{name} is configured for bidirectional attention (is_causal=False); only causal is supported")
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(
            f"{name} is configured for bidirectional attention (use_bidirectional_attention=True); Ulysses "
            "attention here is causal only"
        )
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "kv_lora_rank", None):
        kv_heads = heads  # MLA expands its latent into one k and v per head
    try:
        if tp > 1:
            check_tp_heads(heads, kv_heads, tp, sp, name)
        else:
            kv_replication(heads, kv_heads, sp)
    except ValueError as e:
        raise ValueError(f"{name}: {e}" if tp == 1 else str(e)) from None
    check_chunks_for_heads(head_chunks, heads // tp, kv_heads // tp, sp, f"{name}: head_chunks")

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    lists = decoder_layers(model)
    if len(lists) != 1:
        raise ValueError(
            f"{name}: expected one list of decoder layers of types {sorted(block_names)}, found {len(lists)}"
        )
    layers = lists[0]
    attentions = [m for layer in layers for m in layer.modules() if is_attention_module(m)]
    layer_types = list(getattr(text, "layer_types", None) or ())
    linear = token_mixer_modules(name, layers, layer_types, sp)
    mixers = {id(m) for m, _ in linear}
    bare = [i for i, layer in enumerate(layers)
            if not any(is_attention_module(m) or id(m) in mixers for m in layer.modules())
            and not (i < len(layer_types) and layer_types[i] in PER_TOKEN_LAYER_TYPES)]
    if bare:
        raise ValueError(
            f"{name}: decoder layer {bare[0]} ({type(layers[bare[0]]).__name__}) holds no *Attention / *MLA module "
            "nor a token mixer Ulysses SP runs: how it mixes tokens is unknown"
        )
    for attn in attentions:
        if not getattr(attn, "is_causal", True):
            raise ValueError(f"{name}: {type(attn).__name__} is not causal; only causal attention is supported")
    status = check_known_family(model, allow_untested)  # a family the matrix refused, refused before anything runs
    return layers, attentions, linear, status


def check_tp_model(model: nn.Module, layers: nn.ModuleList, linear: list[tuple], tp: int) -> dict[str, str]:
    """The model's tensor-parallel plan (transformers' ``base_model_tp_plan``, block-relative),
    or ValueError naming the model and why it cannot take ``tp``: no plan, a style this
    package does not run, token mixers other than attention (gated delta-nets, Mamba, short
    convolutions), or a norm whose weight gradient must be
    summed over tp but whose forward is not one this package computes (nothing changed)."""
    name = type(model).__name__
    if linear:
        module, mixer = linear[0]
        raise ValueError(f"{name} with tp={tp}: its {type(module).__name__} layers ({mixer.kind}s) are not "
                         "split over tp ranks; use tp=1")
    plan = hf_tp_plan(model, "layers.*.")
    block = dict(layers[0].named_modules())
    for key, style in plan.items():
        targets = fnmatch.filter(block, key)
        if not targets:
            raise ValueError(f"{name}: base_model_tp_plan names layers.*.{key}, which its decoder layer "
                             f"{type(layers[0]).__name__} does not have; use tp=1")
        if style == "replicated_with_grad_allreduce":
            for target in targets:
                if _norm_formula(block[target]) is None:
                    raise ValueError(f"{name} with tp={tp}: {key} ({type(block[target]).__name__}) sees only a tp "
                                     "rank's heads, and its forward is not an RMSNorm this package computes (it would "
                                     "sum its weight's gradient over tp); use tp=1")
    return plan


def check_ring_model(model: nn.Module, attentions: list[nn.Module], linear: list[tuple], backend: str,
                     ring: int) -> None:
    """Refuse, naming the model and the reason, what ring attention (``ring > 1``) does not run:
    its blocks are merged from plain causal kernels (no window, soft-cap or sinks), and a
    recurrent layer would need its state passed around the ring."""
    from ulysses_dtensor.parallel.ring import check_ring_backend, refused_pattern

    name = type(model).__name__
    where = f"{name} with ring={ring}"
    if linear:
        module, mixer = linear[0]
        raise ValueError(
            f"{where}: its {type(module).__name__} layers are {mixer.kind}s (recurrent or convolutional); ring "
            "attention would have to pass their state around the ring, which is not implemented. Use ring=1 "
            "(Ulysses up to the mixer's head / channel count)")
    for feature, value in model_patterns(model.config.get_text_config(), attentions).items():
        raise ValueError(f"{where}: {refused_pattern(feature, value)}")
    try:
        check_ring_backend(backend)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _prepare_inputs(module, args, kwargs, *, name: str, sp: int, sp_rank: int, ring: int, call: CallState):
    """Model forward pre-hook: refuse inputs whose meaning SP would change, default
    the position ids to this rank's GLOBAL positions."""
    call.seq_len = kwargs.pop(SEQ_LEN_KWARG, None)
    call.document_ids = kwargs.get(DOCUMENT_IDS_KWARG)
    if len(args) > 1:
        raise TypeError(f"{name} under Ulysses SP: pass everything after input_ids as keyword arguments")
    ref = args[0] if args else kwargs.get("input_ids")
    ref = kwargs.get("inputs_embeds") if ref is None else ref
    if ref is None:
        return None  # transformers raises its own error
    batch, seq = ref.shape[:2]
    encoder = [k for k in _ENCODER_INPUTS if kwargs.get(k) is not None]
    if encoder:
        raise ValueError(
            f"{name} under Ulysses SP runs its text path only; got {encoder[0]}=...: the vision/audio encoder "
            "runs on whole images and its features would be scattered into this rank's slice of the sequence"
        )
    if call.seq_len is not None and not 0 < call.seq_len <= seq * sp:
        raise ValueError(
            f"{name}: {SEQ_LEN_KWARG}={call.seq_len} must be in [1, local_seq * sp = {seq * sp}] (shard_hf_batch sets it)"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or not bool(mask.all()):
            raise ValueError(
                f"{name} under Ulysses SP takes no padding or custom attention_mask (its mask would be "
                "built for this rank's slice); pack documents and give position_ids instead (shard_hf_batch)"
            )
        kwargs["attention_mask"] = None  # all ones: no information
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise ValueError(f"{name} under Ulysses SP: a KV cache (generation) is not supported; use_cache must be False")
    if kwargs.get("labels") is not None and (kwargs.get("shift_labels") is None or kwargs.get("num_items_in_batch") is None):
        raise ValueError(
            f"{name} under Ulysses SP: labels= alone makes transformers shift the labels within this "
            "rank's slice (one target lost per slice boundary) and average per rank. Compute "
            "sp_cross_entropy(out.logits, labels, pmesh.loss), or pass labels=labels, shift_labels=labels, "
            "num_items_in_batch=count_valid_tokens(labels, pmesh.loss) with shard_hf_batch's labels"
        )
    docs = kwargs.get(DOCUMENT_IDS_KWARG)
    if docs is not None and tuple(docs.shape) != (batch, seq * sp):
        raise ValueError(
            f"{name}: {DOCUMENT_IDS_KWARG} has shape {tuple(docs.shape)}; it must cover the whole "
            f"padded sequence, (batch, local_seq * sp) = ({batch}, {seq * sp})"
        )
    pos = kwargs.get("position_ids")
    # One document per row: this rank's slots hold these positions (contiguous without a ring).
    plain = layout_position_ids(seq, sp_rank, sp, ring, ref.device)
    if pos is None:
        kwargs["position_ids"] = plain.expand(batch, seq)
    elif docs is None and pos.shape[-1] > 1 and bool(((pos - plain) != (pos - plain)[..., :1]).any()):
        raise ValueError(
            f"{name}: position_ids restart inside the sequence (packed documents), but no "
            f"{DOCUMENT_IDS_KWARG} describe the documents of the whole sequence, so attention would "
            "cross them; prepare the batch with shard_hf_batch"
        )
    return args, kwargs


def _fully_shard(model, layers, pmesh, param_dtype, reduce_dtype, reshard_after_forward, offload_params) -> None:
    """FSDP2 / HSDP as for our Llama; inputs are not cast per group (transformers
    casts what it needs itself)."""
    mesh = pmesh.param_mesh
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload_params else OffloadPolicy()
    embed, out = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out is not None and embed is not None and out.weight is embed.weight
    head = None
    if out is not None and not tied:
        norm = getattr(_layers_parent(model, layers), "norm", None)
        head = [out] if norm is None else [norm, out]
    shard_model(model, list(layers), mesh, embed=None if tied else embed, head=head, param_dtype=param_dtype,
                reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward, offload_policy=policy)


def _layers_parent(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """The module holding the decoder layer list (it also holds the final norm)."""
    for module in model.modules():
        if any(child is layers for child in module.children()):
            return module
    raise ValueError(f"{type(model).__name__}: the decoder layer list has no parent module")
