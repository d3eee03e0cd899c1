"""Apply Ulysses SP, activation checkpointing, torch.compile and FSDP2 to a Llama.

Order, per transformer block, and why:

0. **Tensor parallelism** (``tp > 1``): PyTorch's ``ColwiseParallel`` /
   ``RowwiseParallel`` on the block's projections over the tp mesh, so q, k, v
   leave their projections with ``heads / tp`` heads.
1. **Ulysses** on ``block.attention.inner`` (the sp mesh): it only registers
   forward hooks on a parameter-free module, so it must be in place before
   the block is compiled, for the compiled graph to contain the all-to-alls.
   With ``ring > 1`` (USP) the inner module is first replaced by ring
   attention over the ring mesh, and Ulysses runs over the ulysses mesh.
2. **Activation checkpointing** wraps the block, so that compile (next) sees
   the checkpoint region and the recompute policy goes into the graph. With
   ``save_attention`` full AC keeps the attention kernel's outputs
   (:mod:`~ulysses_dtensor.memory.saved_attention`).
3. **torch.compile** (``fullgraph=True``) wraps the checkpointed block. The
   whole block, both all-to-alls included, is one graph.
4. **FSDP2** ``fully_shard`` on the embedding, each (compiled) block, the
   final norm + output projection, then the root. FSDP's hooks are excluded
   from dynamo, so they must sit outside the compiled module: ``fully_shard``
   goes on the ``torch.compile`` wrapper, last.

Parameters are sharded over the flattened ``dp_shard x sp`` mesh (the sp ranks
of a group hold the same parameters) and replicated over ``dp_replicate``
(HSDP). With ``tp > 1`` the blocks' projections are first split over the ``tp``
ranks (:mod:`~ulysses_dtensor.parallel.tensor_parallel`), and FSDP shards the tp shards. The loss from :func:`~ulysses_dtensor.parallel.loss.sp_cross_entropy` is each
rank's share of the global token mean, so gradients must be SUMMED over every
rank: FSDP2 averages by default, so every FSDP module gets a divide factor of
1 and sum-only collectives (which gloo also supports).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from typing import Callable

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ..memory.offload import OffloadedCheckpointBlock, make_offloader
from ..memory.options import AC_MODES, MemoryOptions, parse_selective_ac
from ..memory.saved_attention import (
    AttentionKeeping,
    attention_keeping,
    is_attention_kernel,
)
from ..parallel.mesh import ParallelMesh
from ..precision.float8 import Float8Options, convert_to_float8
from ..parallel.ring import RingAttention
from ..parallel.tensor_parallel import LLAMA_TP_PLAN, check_tp_heads, tensor_parallelize
from ..parallel.head_chunk_plan import recomputes_in_chunks
from ..parallel.ulysses import UlyssesAttention, check_chunks_for_heads, kv_replication
from ..runtime.suggest import unknown_name

__all__ = ["AC_MODES", "check_memory_options", "clip_grad_norm_", "needs_rng_replay", "parallelize_llama"]



def parallelize_llama(
    model: nn.Module,
    pmesh: ParallelMesh,
    *,
    memory: MemoryOptions | None = None,
    compile: bool = False,
    compile_backend: str | Callable = "inductor",
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    pack_qkv: bool = False,
    float8: Float8Options | None = None,
    **switches,
) -> nn.Module:
    """Parallelize ``model`` (a :class:`~ulysses_dtensor.models.llama.Llama`) in place.

    Call on the meta-device model, then ``model.to_empty(device=...)`` and
    ``model.init_weights(seed)``; with ``offload_params`` the parameters must
    be materialised on the host: ``model.to_empty(device="cpu")``.

    Args:
        pmesh: from ``ParallelDims(...).build_mesh(device_type)``.
        memory: the memory switches (:class:`~ulysses_dtensor.memory.options.MemoryOptions`:
            activation checkpointing and what it keeps, tiled MLP and loss, host offload,
            head chunks). ``**switches``: the same as keywords (``ac_mode="full"``,
            ``tiled_mlp=True``, ...), folded into ``memory``.
        compile: ``torch.compile(block, fullgraph=True)`` per transformer block.
        compile_backend: e.g. ``"inductor"`` (CPU needs a C++ compiler),
            ``"aot_eager"`` (no code generation), or a backend callable.
        param_dtype, reduce_dtype: FSDP2 mixed precision (compute / gradient
            reduction dtypes); parameters are kept in their own dtype.
        reshard_after_forward: free gathered parameters after each block's
            forward (ZeRO-3). The last block always keeps them, since backward
            needs them at once.
        pack_qkv: one all-to-all for q, k and v together instead of three.
        float8: FP8 linear layers (:class:`~ulysses_dtensor.precision.float8.Float8Options`;
            torchao), converted first; ``model.float8_report`` says what was converted.
        The switches, in short (their full text is MemoryOptions'): ``ac_mode``
            ``"none"`` / ``"full"`` / ``"selective"`` with ``selective_ac`` (``"op"``
            or every k-th block); ``save_attention`` keeps the attention kernel's outputs
            under full AC (offloaded with the block input under ``offload_activations``;
            ``model.attention_keeping`` counts them); ``tiled_mlp`` / ``mlp_tiles`` and
            ``tiled_loss`` / ``loss_chunks`` (``model.tiled_head``) tile over the sequence;
            ``offload_activations`` keeps block inputs in pinned host memory
            (``model.offloader`` reports the bytes); ``offload_params`` keeps parameter
            shards, gradients and optimizer state on the host (materialise with
            ``model.to_empty(device="cpu")``; on CUDA the process group needs a CPU
            backend too: ``init_process_group("cuda:nccl,cpu:gloo")``); ``head_chunks``
            runs the exchange and the kernel over chunks of a rank's heads
            (:mod:`~ulysses_dtensor.parallel.head_chunks`; None: from the shapes).
    """
    mem = MemoryOptions.merged(memory, switches, "parallelize_llama")  # the switches' own rules checked here
    head_chunks = mem.head_chunks
    layers = _blocks(model)
    if compile and isinstance(compile_backend, str):
        _check_compile_backend(compile_backend)

    dims = pmesh.dims
    ring = getattr(dims, "ring", 1)
    tp = getattr(dims, "tp", 1)
    args = getattr(model, "args", None)
    if args is not None:  # clear errors before any change
        check_tp_heads(args.n_heads, args.n_kv_heads, tp, dims.sp // ring, "parallelize_llama")
        if tp == 1 and dims.sp > 1:
            kv_replication(args.n_heads, args.n_kv_heads, dims.sp // ring)
        check_chunks_for_heads(head_chunks, args.n_heads // tp, args.n_kv_heads // tp, dims.sp // ring,
                               "parallelize_llama: head_chunks")
    apply_float8(model, float8, pmesh, tp)  # first: the FP8 layers are what the rest wraps and shards
    if tp > 1:
        # Tensor parallelism first: q/k/v then carry heads / tp heads into the exchange.
        tensor_parallelize(list(layers.values()), pmesh.tp, LLAMA_TP_PLAN)
    if dims.sp > 1:
        for block in layers.values():
            attn = block.attention
            if ring > 1:
                # Ring first: the Ulysses hooks go on the module that stays.
                attn.inner = parallelize_module(attn.inner, pmesh.ring, RingAttention())
            parallelize_module(attn.inner, pmesh.ulysses, UlyssesAttention(pack_qkv=pack_qkv, head_chunks=head_chunks))
        model.sp_mesh = pmesh.sp

    _set_tiling(model, layers, mem.tiled_mlp, mem.mlp_tiles, mem.tiled_loss, mem.loss_chunks)
    offloader = make_offloader(mem)
    model.offloader = offloader
    model.memory_options = mem
    keep = attention_keeping(model, mem.save_attention)
    rng = needs_rng_replay(model)
    # A kernel re-run in a chunk's backward cannot be traced into the block's graph.
    fullgraph = not recomputes_in_chunks(head_chunks, getattr(args, "attn_backend", "auto"), ())

    for block in layers.values():
        # Full AC: the q / k norms' inputs are recomputed in their backward rather than kept
        # from the block's recompute (Qwen3: 1.25 hidden-wide tensors fewer at the peak).
        block.attention.recompute_qk_norm_inputs = mem.ac_mode == "full"
    for layer_id, block in list(layers.named_children()):
        if offloader is not None:
            # Compile inside, offload outside: the host copies and side
            # streams are not traceable, the block is.
            if compile:
                block = torch.compile(block, fullgraph=fullgraph, backend=compile_backend)
            layers.register_module(layer_id, OffloadedCheckpointBlock(block, offloader, preserve_rng_state=rng,
                                                                      keep=keep))
            continue
        block = checkpoint_block(block, int(layer_id), mem.ac_mode, mem.every_k, preserve_rng_state=rng, keep=keep)
        if compile:
            block = torch.compile(block, fullgraph=fullgraph, backend=compile_backend)
        layers.register_module(layer_id, block)

    mesh = pmesh.param_mesh
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if mem.offload_params else OffloadPolicy()
    # Tied tables must stay in one group: the root's.
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    embed = getattr(model, "tok_embeddings", None) if not tied else None
    head = [model.norm, model.output] if not tied and hasattr(model, "output") else None
    # Inputs are not cast: rope cos/sin stay float32 under bf16 compute
    # (activations already come out of the embedding in param_dtype).
    shard_model(model, list(layers.values()), mesh, embed=embed, head=head, param_dtype=param_dtype,
                reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    if hasattr(model, "hidden_states"):
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "hidden_states")
    return model



def apply_float8(model: nn.Module, float8: Float8Options | None, pmesh: ParallelMesh, tp: int = 1) -> None:
    """FP8 linear layers before anything else is applied (their weights are then what
    tensor parallelism, compile and FSDP see); tensorwise scales reduce over ``pmesh.sp``."""
    if float8 is None or not float8.enable:
        return
    if tp > 1:
        raise ValueError(f"float8 with tp={tp}: FP8 linear layers are not combined with this package's tensor "
                         f"parallelism; use sp (and dp) instead, or float8 enable=false")
    device = pmesh.param_mesh.device_type
    convert_to_float8(model, float8, device=torch.device(device, torch.cuda.current_device()) if device == "cuda"
                      else device, sp_mesh=pmesh.sp if pmesh.dims.sp > 1 else None)


def needs_rng_replay(model: nn.Module) -> bool:
    """The model draws random numbers in forward (a dropout with p > 0, e.g. LoRA's): a
    recomputation must then replay forward's RNG state, or its masks differ from those
    the forward used and the gradients are wrong."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def checkpoint_block(block: nn.Module, index: int, ac_mode: str, every_k: int | None,
                     preserve_rng_state: bool = False, keep: AttentionKeeping | None = None) -> nn.Module:
    """Block ``index`` as activation checkpointing wraps it: every block (``full``),
    op-level selective (``selective``, ``every_k`` None), or every k-th block fully.
    ``preserve_rng_state``: the recomputation replays forward's RNG (blocks with
    dropout, :func:`needs_rng_replay`); off otherwise, as it costs a state copy per block.
    ``keep`` (``save_attention``, full AC): the attention kernels' outputs are kept."""
    if ac_mode == "full" and keep is not None:
        return _checkpoint(block, preserve_rng_state, context_fn=keep.contexts)
    if ac_mode == "full" or (ac_mode == "selective" and every_k is not None and (index + 1) % every_k == 0):
        return _checkpoint(block, preserve_rng_state)
    if ac_mode == "selective" and every_k is None:
        return _checkpoint(block, preserve_rng_state, context_fn=_op_sac_context)
    return block


def shard_model(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh,
    *,
    embed: nn.Module | None,
    head: list[nn.Module] | None,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    offload_policy: OffloadPolicy | None = None,
) -> None:
    """FSDP2 groups over ``mesh``: the embedding table (None: it stays in the root,
    e.g. tied to the head), one group per block, the final norm + head, then the
    root; gradients are summed, not averaged. Forward inputs are not cast per group."""
    shard = functools.partial(fully_shard, mesh=mesh, offload_policy=offload_policy or OffloadPolicy())
    mp = MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=False)
    if embed is not None:
        # Its own group, so the (vocab x dim) table is not held unsharded for the whole step.
        shard(embed, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    n = len(blocks)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward.
        shard(block, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < n - 1)
    if head is not None:
        # Used last in forward and first in backward: never resharded in between.
        shard(head, mp_policy=mp, reshard_after_forward=False)
    # The root (tied tables, else no parameters of its own) keeps FSDP's own root policy.
    shard(
        model, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype),
        reshard_after_forward=None if reshard_after_forward else False,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already divided by the global token count: sum, don't average.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)

def check_memory_options(ac_mode: str, mlp_tiles, offload_activations: bool, loss_chunks=None,
                         save_attention: bool = False) -> None:
    """The memory switches' own rules (kept for callers of the keyword form; the rules
    live in :class:`~ulysses_dtensor.memory.options.MemoryOptions`)."""
    MemoryOptions(ac_mode=ac_mode, mlp_tiles=mlp_tiles, offload_activations=offload_activations,
                  loss_chunks=loss_chunks, save_attention=save_attention)


def _set_tiling(model, layers, tiled_mlp, mlp_tiles, tiled_loss, loss_chunks) -> None:
    # 1 = untiled; None = tile count from the shapes at run time.
    for block in layers.values():
        block.feed_forward.num_tiles = mlp_tiles if tiled_mlp else 1
    model.output.loss_chunks = loss_chunks if tiled_loss else 1


def _blocks(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"parallelize_llama expects a model with a `layers` ModuleDict of transformer "
            f"blocks (ulysses_dtensor.models.llama.Llama), got {type(model).__name__}"
        )
    return layers


_parse_selective_ac = parse_selective_ac  # the name other modules import


def _check_compile_backend(name: str) -> None:
    from torch._dynamo import list_backends

    valid = list_backends(exclude_tags=())
    if name not in valid:
        raise ValueError(unknown_name("compile_backend", name, valid))


# ---------------------------------------------------------------------------
# Activation checkpointing
# ---------------------------------------------------------------------------


def _checkpoint(block: nn.Module, preserve_rng_state: bool = False, **kwargs) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    # Non-reentrant: composes with FSDP2's hooks and with torch.compile.
    return checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state, **kwargs)


def _sac_save_ops() -> set:
    """Ops the selective "op" policy saves besides the attention kernels
    (:func:`~ulysses_dtensor.memory.saved_attention.is_attention_kernel`)."""
    ops = {torch.ops.aten.max.default}
    # The Ulysses exchange: saving its outputs keeps recompute communication-free.
    for ns in ("_c10d_functional", "_c10d_functional_autograd"):
        lib = getattr(torch.ops, ns)
        for name in ("all_to_all_single", "wait_tensor"):
            if hasattr(lib, name):
                ops.add(getattr(lib, name).default)
    return ops


def _op_sac_context():
    """Selective AC policy: save attention, collectives and every other matmul."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    save = _sac_save_ops()
    # The q/k/v projections write the exchange's send layout with a batched matmul (bmm):
    # they count as matmuls like the others.
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        if func in matmuls:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            # Recompute every second matmul: half the matmul memory for a
            # fraction of the FLOPs of full AC.
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if func in save or is_attention_kernel(func):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# ---------------------------------------------------------------------------
# Gradient clipping over sharded gradients
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_redistribute():
    """DTensor logs a warning per call when a norm partial over two mesh dims (FSDP x tp)
    is reduced with two all-reduces of one scalar: true, and nothing to act on."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@torch.no_grad()
def clip_grad_norm_(
    parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip gradients to a global norm; return that norm as a plain tensor.

    Gradients may be plain tensors or DTensors on any mesh (FSDP's 1-D
    ``dp_shard x sp`` mesh, HSDP's 2-D mesh): the norm is that of the full,
    unsharded gradients, the same a single device computes. One reduction per
    distinct mesh. A non-finite norm leaves the gradients unscaled.
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    groups: dict = defaultdict(list)
    for g in grads:
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    norms = []
    for gs in groups.values():
        with _quiet_redistribute():
            n = torch.nn.utils.get_total_norm(gs, norm_type, False, foreach)
            if isinstance(n, DTensor):
                n = n.full_tensor()
        norms.append(n)
    device = norms[0].device
    if len(norms) == 1:
        total = norms[0]
    else:
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})"
        )
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    # A non-finite norm leaves the gradients as they are (no host sync): the trainers skip
    # such a step, and the gradients still show which parameters hold the NaN or inf.
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    return total
