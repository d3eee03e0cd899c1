"""Tracing one training step on rank 0 of a fake world, and extrapolating
traces linearly in the layer count."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .tracker import _classifier, _make_tracker_cls


@contextlib.contextmanager
def _fake_world(world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "plan_memory runs its own fake process group and must be called in a process "
            "without one (call it before init_process_group, or in a subprocess)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _private_sharding_prop_fake_mode():
    """Give DTensor's shape propagation its own FakeTensorMode while tracing.

    DTensor computes an op's output metadata by running the op on fake tensors
    of the GLOBAL (unsharded) shapes, reusing whatever fake mode is active. Under
    the planner's fake mode that reuse makes the tracker count those global
    tensors as allocations: AdamW(foreach=True) over FSDP-sharded parameters then
    "peaks" at several times the full (unsharded) optimizer state (101 GiB for
    Llama-3-8B on 8 ranks whose real state is 7.5 GiB). In eager mode the
    propagation runs in a fresh fake mode, which the tracker skips; a private
    fake mode restores exactly that.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        import torch.distributed.tensor._sharding_prop as sharding_prop
    except ImportError:  # pragma: no cover - other torch layouts
        yield
        return
    if not hasattr(sharding_prop, "detect_fake_mode"):  # pragma: no cover
        yield
        return
    original = sharding_prop.detect_fake_mode
    private = FakeTensorMode()
    sharding_prop.detect_fake_mode = lambda *a, **k: private
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = original


@contextlib.contextmanager
def _meshes_outside_fake_mode():
    """Let FSDP2 build the (dp, tp) mesh of tensor-parallel parameters from real ranks.

    ``fully_shard`` of a TP-sharded module concatenates the FSDP and TP meshes,
    which computes this rank's coordinates from the rank tensor; under the
    planner's fake mode that tensor would be fake (no values to compare).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(meshes):
        with unset_fake_temporarily():
            return original(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)


@dataclass
class _Trace:
    n_layers: int
    phase_peaks: dict
    boundaries: dict
    host_peak: int
    seconds: float
    host_fixed: int = 0  # of host_peak, what does not grow with the length (parameter state)
    ops: int = 0  # ops dispatched (what a trace costs)
    host_phase_peaks: dict = field(default_factory=dict)  # phase -> host peak in it
    edges: bool = False  # sequence loops traced at their edge pieces
    attention: dict = field(default_factory=dict)  # Choice (the kernel planned) -> calls in the step
    disk_peak: int = 0  # offloaded bytes held at once (what the disk holds with memory.offload_dir)
    layer_offload: int = 0  # the largest layer's offloaded bytes (its input, and kept attention outputs)


def _vocab_size(cfg) -> int:
    from ..data import build_tokenizer
    from ..trainer.build import resolve_vocab_size

    return resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer).vocab_size)


def _trace_step(cfg, world_size: int, *, rows: int, micro: int, device: str, foreach: bool,
                edges: bool = True, target=None) -> _Trace:
    """One step on rank 0 of a fake world. ``edges``: sequence loops (tiles, loss and
    norm chunks) run only their edge pieces (:func:`~ulysses_dtensor.memory.tiling.edge_pieces_only`),
    which leaves the memory as it is and the cost of the trace independent of the length.
    ``target``: the machine whose attention kernels are planned
    (:func:`~ulysses_dtensor.attention.planning.planning_for`; default: the one
    :func:`~ulysses_dtensor.attention.planning.default_target` names)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..attention.planning import PlannedKernelError, default_target, planning_for
    from ..parallel.loss import count_valid_tokens
    from ..trainer.config import ConfigError, model_args, validate_config
    from ..trainer.step import build_optimizer, train_step

    if target is None:
        target = default_target(device)
    dims = validate_config(cfg, world_size, weights=False)
    vocab = _vocab_size(cfg)
    args = model_args(cfg, vocab)
    if cfg.model.hf_path and cfg.model.n_layers:
        # The planner's shorter traces set n_layers; an HF config.json fixes the rest.
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    if getattr(args, "num_experts", 0) and cfg.training.mixed_precision_param != "bfloat16":
        raise ConfigError(
            f"planning {args.architecture} (transformers' MoE experts) needs "
            f"training.mixed_precision_param='bfloat16': the shape function of its grouped expert "
            f"matmul accepts bf16 only (got {cfg.training.mixed_precision_param!r})")
    seq_len = cfg.training.seq_len
    s_local = seq_len // dims.sp
    t0 = time.perf_counter()
    try:
        with _fake_world(world_size), planning_for(target) as attention:
            pmesh = dims.build_mesh("cpu")  # before fake mode: flattening reads real tensors
            with FakeTensorMode(allow_non_fake_inputs=True), _private_sharding_prop_fake_mode(), \
                    _meshes_outside_fake_mode():
                model = traced_model(cfg, pmesh, vocab, args, device)
                if getattr(model, "_router_aux", None) is not None:
                    # transformers records each MoE tile's router logits for the router loss
                    # through hooks, which a skipped tile would not run.
                    edges = False
                optimizer = steady_optimizer(build_optimizer(cfg, model, foreach=foreach), model)
                params = [p for p in model.parameters() if p.requires_grad]

                batch = {
                    "input_ids": torch.zeros(rows, s_local, dtype=torch.long),
                    "labels": torch.zeros(rows, s_local, dtype=torch.long),
                    "position_ids": torch.arange(s_local).repeat(rows, 1),
                    "document_ids": None,
                }
                n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
                tracker = step_tracker(model, optimizer, cfg, args, vocab, dims, device)
                tracker.track_inputs((batch["input_ids"], batch["labels"], batch["position_ids"]))
                with tracker, edge_loops(edges):
                    train_step(
                        model,
                        optimizer,
                        batch,
                        n_valid,
                        micro_batch_size=micro,
                        max_norm=cfg.training.max_norm or math.inf,
                        lr=cfg.optimizer.lr,
                        params=params,
                        on_phase=tracker.set_phase,
                    )
                del model, optimizer, params, batch
    except PlannedKernelError as e:
        raise ConfigError(f"model.attn_backend={cfg.model.attn_backend!r}: {e}") from None
    return trace_of(tracker, args.n_layers, time.perf_counter() - t0, edges, attention)


def traced_model(cfg, pmesh, vocab: int, args, device: str):
    """The model of ``cfg`` as the trainer builds it, on fake tensors (weight values do not
    matter for memory, and the init needs real data)."""
    from ..trainer.build import build_model

    model = build_model(cfg, pmesh, vocab, torch.device("cpu"), init_weights=False, args=args)
    offloader = getattr(model, "offloader", None)
    if offloader is not None and device == "cuda":
        # Host copies on "meta": free on the traced device, counted as host memory.
        # (Planning for CPU keeps the trainer's CPU path: a copy in the same memory.)
        offloader.host_device = torch.device("meta")
        _count_slots(offloader)
    return model


def _count_slots(offloader) -> None:
    """Record each offloaded layer's bytes (its input, then what ``add`` puts beside it) in
    ``offloader.planned_slot_bytes``: the disk tier's staging area holds layers' worth of
    them. Wraps this instance's public methods; the offloader's own code is untouched."""
    sizes: dict = {}
    offload, add = offloader.offload, offloader.add

    def counted_offload(x):
        handle = offload(x)
        sizes[handle] = x.numel() * x.element_size()
        return handle

    def counted_add(handle, tensors):
        add(handle, tensors)
        sizes[handle] = sizes.get(handle, 0) + sum(t.numel() * t.element_size() for t in tensors)

    offloader.offload, offloader.add = counted_offload, counted_add
    offloader.planned_slot_bytes = sizes


def step_tracker(model, optimizer, cfg, args, vocab: int, dims, device: str):
    """The memory tracker of one traced step of ``model``: with ``offload_params`` on a GPU
    the parameter state is host memory, and each all-gather's staging copy is added."""
    host_state = cfg.memory.offload_params and device == "cuda"
    tracker = _make_tracker_cls()(
        model,
        optimizer,
        classify=_classifier(vocab, args.ffn_dim, args.dim, ring=dims.ring > 1),
        device=torch.device("cpu"),
        gpu_workspace=device == "cuda",
        host_state=host_state,
        staging=_largest_shard_group_bytes(model) if host_state else 0,
    )
    tracker.offload_slots = getattr(getattr(model, "offloader", None), "planned_slot_bytes", {})
    return tracker


def edge_loops(edges: bool):
    """Loops over the sequence and over head chunks run at their edges (``edges``), or whole."""
    from ..memory.tiling import edge_pieces_only
    from ..parallel.head_chunks import edge_chunks_only

    stack = contextlib.ExitStack()
    if edges:
        stack.enter_context(edge_pieces_only())
        stack.enter_context(edge_chunks_only())
    return stack


def trace_of(tracker, n_layers: int, seconds: float, edges: bool, attention) -> _Trace:
    """What a traced step's tracker recorded, as a :class:`_Trace`."""
    return _Trace(
        n_layers=n_layers,
        phase_peaks=tracker.phase_peaks,
        boundaries=tracker.boundaries,
        host_peak=tracker.host_peak,
        seconds=seconds,
        host_fixed=tracker.host_state_peak,
        ops=tracker.ops,
        edges=edges,
        host_phase_peaks=dict(tracker.host_phase_peaks),
        attention=dict(attention),
        disk_peak=tracker.meta_peak,
        layer_offload=max(tracker.offload_slots.values(), default=0),
    )


def steady_optimizer(optimizer, model):
    """``optimizer`` after one step on zero gradients: its state exists before the traced
    step, as in every step but the first."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _largest_shard_group_bytes(model) -> int:
    """Bytes of the largest FSDP group's local shards.

    Under CPU offload each all-gather first copies its group's shards to the
    device (then casts them to the compute dtype): a transient the trace, run
    on one device, does not allocate."""
    from torch.distributed.fsdp import FSDPModule

    sizes = [0]
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is not None:
            sizes.append(sum(p.to_local().numel() * p.element_size() for p in (fp.sharded_param for fp in group.fsdp_params)))
    return max(sizes)


def _lin_dict(a: dict, b: dict, w: float) -> dict:
    keys = set(a) | set(b)
    return {k: max(0, round(a.get(k, 0) + (b.get(k, 0) - a.get(k, 0)) * w)) for k in keys}


def _lin_split(a: dict, b: dict, w: float) -> dict:
    """A peak's split (by category, by kind) carried to ``w`` like its total. Where the two
    traces' peaks hold different tensors (one kind alive at one trace's peak, another at the
    other's), a line per key runs negative far out, and clamping it would make the parts
    outgrow the whole: the deeper trace's shares of the carried total stand in then."""
    keys = set(a) | set(b)
    raw = {k: a.get(k, 0) + (b.get(k, 0) - a.get(k, 0)) * w for k in keys}
    if min(raw.values(), default=0) >= 0:
        return {k: round(v) for k, v in raw.items()}
    whole, base = sum(raw.values()), sum(b.values())
    return {k: round(v * whole / base) for k, v in b.items()} if base > 0 else {}


def _extrapolate(t1: _Trace, t2: _Trace, n_layers: int) -> _Trace:
    """Each phase's peak, categories and kinds: linear in the layer count."""
    w = (n_layers - t1.n_layers) / (t2.n_layers - t1.n_layers)
    phases = {}
    for ph in set(t1.phase_peaks) & set(t2.phase_peaks):
        p1, p2 = t1.phase_peaks[ph], t2.phase_peaks[ph]
        phases[ph] = {
            "total": round(p1["total"] + (p2["total"] - p1["total"]) * w),
            "cats": _lin_split(p1["cats"], p2["cats"], w),
            "kinds": _lin_split(p1["kinds"], p2["kinds"], w),
        }
    bounds = {
        ph: _lin_dict(t1.boundaries[ph], t2.boundaries[ph], w)
        for ph in set(t1.boundaries) & set(t2.boundaries)
    }
    # Host memory per phase, as the device's: which phase holds the host peak can change
    # with the block count (offloaded block inputs at the end of forward grow with it faster
    # than the parameter state the optimizer step holds).
    host_phases = _lin_dict(t1.host_phase_peaks, t2.host_phase_peaks, w)
    host = max(host_phases.values(), default=0)
    fixed = round(t1.host_fixed + (t2.host_fixed - t1.host_fixed) * w)
    disk = round(t1.disk_peak + (t2.disk_peak - t1.disk_peak) * w)  # a slot per block: linear in them
    return _Trace(n_layers, phases, bounds, host, t1.seconds + t2.seconds, host_fixed=max(0, fixed),
                  ops=t1.ops + t2.ops, edges=t1.edges and t2.edges, host_phase_peaks=host_phases,
                  disk_peak=max(0, disk), layer_offload=max(t1.layer_offload, t2.layer_offload))
