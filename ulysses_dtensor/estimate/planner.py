"""Planning: :func:`plan_memory`, one step's plan from one full trace or
extrapolated from traces of fewer layers."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..attention.planning import default_target

from .disk import STAGING_LAYERS, Rates, disk_split, modelled_step_time
from .plan import MemoryPlan
from .trace import _extrapolate, _Trace, _trace_step, _vocab_size

def _layer_counts(cfg) -> tuple[int, int, int]:
    """Layer counts of the three traces an extrapolated plan is made from.

    Four to six blocks: with fewer, the peak of the backward can sit next to a
    block that is not like the others (the first block to run backward keeps
    its gathered parameters and has no earlier reduce-scatter in flight; the
    embedding is below block 0), and the peak then does not grow by the same
    amount per block (seen on Llama-3-70B between 3 and 4 blocks). The middle
    count checks linearity. Multiples of the selective-AC period so the
    checkpointing pattern repeats.
    """
    period = 1
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective != "op":
        period = int(ac.selective)
    return 4 * period, 5 * period, 6 * period


def _same_peaks(a: _Trace, b: _Trace, rel: float = 1e-3, abs_bytes: int = 1 << 20) -> bool:
    """Every phase's peak of ``a``, on the device and on the host, within ``rel`` (or 1 MiB) of ``b``'s."""
    if set(a.phase_peaks) != set(b.phase_peaks) or set(a.host_phase_peaks) != set(b.host_phase_peaks):
        return False
    pairs = [(pa["total"], b.phase_peaks[ph]["total"]) for ph, pa in a.phase_peaks.items()]
    pairs += [(ha, b.host_phase_peaks[ph]) for ph, ha in a.host_phase_peaks.items()]
    return all(abs(x - y) <= max(abs_bytes, rel * y) for x, y in pairs)


# Cost of a trace in units of one traced block: building the model, the loss and the
# optimizer step come once per trace (measured on Llama-3-8B and Qwen3-8B: ~1.5 blocks).
_TRACE_OVERHEAD = 1.5


def _cheaper_trace(cfg, args, s_local: int, counts: tuple[int, ...], edges: bool = True) -> str:
    """'full' or 'extrapolate' (from traces of ``counts`` blocks), whichever costs less to trace.

    With ``edges`` (sequence loops traced at their edge pieces) a block costs the
    same at any length. Without, rough relative costs measured on Llama-3-8B
    traces: ~200 dispatched ops per untiled block, ~40 more per MLP tile (forward,
    recompute and backward of each tile), ~10 per loss chunk, once per trace.
    """
    if args.n_layers <= max(counts):
        return "full"
    if edges:
        full = args.n_layers + _TRACE_OVERHEAD
        extrapolated = sum(counts) + len(counts) * _TRACE_OVERHEAD
        return "extrapolate" if extrapolated < full else "full"
    from ..memory.tiling import auto_loss_chunks, auto_num_tiles

    mem = cfg.memory
    per_layer = 200
    if mem.tiled_mlp:
        per_layer += 40 * (mem.mlp_tiles or auto_num_tiles(s_local, args.ffn_dim, args.dim))
    loss = 10 * ((mem.loss_chunks or auto_loss_chunks(s_local, args.vocab_size)) if mem.tiled_loss else 5)
    full = args.n_layers * per_layer + loss
    extrapolated = sum(counts) * per_layer + len(counts) * loss
    return "extrapolate" if extrapolated < 0.7 * full else "full"


def _default_world_size(cfg) -> int:
    p = cfg.parallelism
    if p.sp == "auto":  # fitted to whatever world runs it: one process unless --world-size says more
        return p.dp_replicate * p.tp * (p.dp_shard if p.dp_shard > 0 else 1)
    return p.dp_replicate * p.sp * p.tp * (p.dp_shard if p.dp_shard > 0 else 1)


def _prepared_config(cfg, seq_len, rows, notes):
    """A copy of cfg for one traced step of ``seq_len`` and ``rows`` sequences per dp rank."""
    cfg = copy.deepcopy(cfg)
    schedule = cfg.context_schedule()
    if seq_len is None:
        seq_len = schedule.max_seq_len
    batch = max(1, schedule.batch_for(seq_len))
    if cfg.training.compile:
        notes.append(
            "traced eagerly: torch.compile (training.compile=true) fuses elementwise ops and "
            "usually needs somewhat less activation memory than this"
        )
        cfg.training.compile = False
    cfg.context.schedule = []
    cfg.context.constant_tokens_per_step = False
    cfg.training.seq_len = seq_len
    if cfg.memory.offload_dir and cfg.memory.offload_activations:
        # Traced with the host offloader (its copies on "meta", counted), then the offloaded
        # bytes are read as the disk's (disk.disk_split): planning never touches the directory.
        cfg.memory.offload_dir = ""
    return cfg, seq_len, batch


@dataclass
class _Step:
    """One training step to plan: its prepared config and what every trace of it shares."""

    cfg: object
    world_size: int
    seq_len: int
    dims: object
    rows: int
    micro: int
    traced_rows: int
    device: str
    foreach: bool
    vocab: int
    n_layers: int
    edges: bool
    target: object  # the Capabilities whose attention kernels are planned
    notes: list = field(default_factory=list)
    offload_dir: str = ""  # memory.offload_dir of the config ('': offloaded tensors in host memory)
    rates: Rates = field(default_factory=Rates)  # what the MODELLED step time assumes (disk tier)
    attention: dict = field(default_factory=dict)  # Choice -> calls, of the longest model traced
    attention_layers: int = 0

    def trace(self, n_layers: int | None = None) -> _Trace:
        """One traced step of this model with ``n_layers`` blocks (default: all of them)."""
        cfg = self.cfg
        if n_layers is not None and n_layers != self.n_layers:
            cfg = copy.deepcopy(cfg)
            cfg.model.n_layers = n_layers
        trace = self._trace_cfg(cfg)
        if trace.n_layers >= self.attention_layers:
            self.attention, self.attention_layers = trace.attention, trace.n_layers
        return trace

    def _trace_cfg(self, cfg) -> _Trace:
        """One traced step of ``cfg`` (a subclass traces another kind of step)."""
        return _trace_step(cfg, self.world_size, rows=self.traced_rows, micro=self.micro, device=self.device,
                           foreach=self.foreach, edges=self.edges, target=self.target)


def _prepare(cfg, world_size, seq_len, *, rows, device, foreach, edges, target=None, rates: Rates | None = None
             ) -> _Step:
    """Check ``cfg`` for ``world_size`` ranks and prepare it for traces of one step
    (attention planned for ``target``: see :func:`plan_memory`; ``rates``: what the
    MODELLED step time of the disk tier assumes)."""
    from ..models.llama import FLAVORS
    from ..parallel.mesh import ParallelDims
    from ..precision.float8 import MIN_CAPABILITY
    from ..trainer.config import ConfigError, model_args, validate_config
    from ..trainer.mesh_fit import fit_to_world

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu'")
    if world_size is None:
        world_size = _default_world_size(cfg)
    notes: list[str] = []
    cfg = copy.deepcopy(cfg)
    offload_dir = cfg.memory.offload_dir if cfg.memory.offload_activations and device == "cuda" else ""
    if cfg.float8.enable:
        notes.append(f"float8 {cfg.float8.recipe_name}: torchao's FP8 linear layers traced as they run eagerly (FP8 "
                     "copies, scales and each cast's float32 temporaries; torch.compile fuses the casts and "
                     "needs less)" + ("; FP8 all-gathers" if cfg.float8.enable_fsdp_float8_all_gather else ""))
    if offload_dir:
        notes.append(f"memory.offload_dir={offload_dir!r}: the offloaded tensors planned on that disk, through a "
                     f"pinned staging area of {STAGING_LAYERS} layers' worth in host memory (the directory "
                     f"is not touched)")
    fit_to_world(cfg, world_size)  # "auto" sizes as the trainer would fit them to this world
    cfg, seq_len, batch = _prepared_config(cfg, seq_len, rows, notes)
    par = cfg.parallelism
    try:
        dp = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size, ring=par.ring, tp=par.tp).dp
    except ValueError:
        dp = 1  # validate_config below raises the ConfigError
    cfg.training.global_batch_size = batch if rows is None else rows * dp
    if cfg.training.micro_batch_size and cfg.training.micro_batch_size >= cfg.training.global_batch_size // dp:
        # One forward of the rows planned (a config's micro-batch of its own global batch, e.g. of
        # an earlier stage's shorter sequences, would be refused as having no effect on this one).
        cfg.training.micro_batch_size = None
    dims = validate_config(cfg, world_size, weights=False)
    if rows is None:
        rows = max(1, batch // dims.dp)
    micro = cfg.training.micro_batch_size or rows
    micro = min(micro, rows)
    traced_rows = min(rows, 2 * micro)
    if traced_rows < rows:
        notes.append(
            f"{rows} rows in {-(-rows // micro)} micro-batches of {micro}: traced the first two "
            f"(later ones hold the same memory)"
        )
    cfg = copy.deepcopy(cfg)
    cfg.training.global_batch_size = traced_rows * dims.dp
    if foreach is None:
        foreach = device == "cuda"
    vocab = _vocab_size(cfg)
    args = model_args(cfg, vocab)
    flavor_vocab = FLAVORS[cfg.model.flavor].vocab_size
    if vocab != flavor_vocab and not cfg.model.hf_path:  # hf_path: the model's own vocabulary
        notes.append(
            f"vocab {vocab} from data.tokenizer={cfg.data.tokenizer!r}; the flavor's own "
            f"vocabulary is {flavor_vocab} (plan it with --model.vocab_size {flavor_vocab})"
        )
    if target is None:
        target = default_target(device)
    elif device == "cpu" and target.cuda:
        raise ValueError(f"planning for device 'cpu' with a GPU target ({target.describe()}): plan for 'cuda'")
    if cfg.float8.enable and target.cuda and target.sm is not None and target.sm < MIN_CAPABILITY:
        raise ConfigError(f"float8.enable=true planned for {target.describe()}: FP8 matmuls need compute capability "
                          f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (sm{target.sm[0]}{target.sm[1]} has "
                          f"none); plan for an H100 or newer, or with float8.enable=false")
    return _Step(cfg, world_size, seq_len, dims, rows, micro, traced_rows, device, foreach, vocab,
                 args.n_layers, edges, target, notes, offload_dir=offload_dir,
                 rates=rates or Rates())


def _layers_to_trace(step: _Step, layers: str, *, checked: bool = True) -> str:
    """``layers`` ('full', 'extrapolate', 'auto') resolved to 'full' or 'extrapolate';
    ``checked=False``: the extrapolated plans are made of two traces, not three (a
    search checks linearity once, at its answer)."""
    from ..trainer.config import model_args

    if layers not in ("full", "extrapolate", "auto"):
        raise ValueError(f"layers={layers!r} must be 'full', 'extrapolate' or 'auto'")
    counts = _layer_counts(step.cfg)
    if step.n_layers <= counts[-1]:
        return "full"
    if layers == "auto":
        args = model_args(step.cfg, step.vocab)
        traced = counts if checked else (counts[0], counts[-1])
        return _cheaper_trace(step.cfg, args, step.seq_len // step.dims.sp, traced, step.edges)
    return layers


def _combine(step: _Step, traces: dict, layers: str, *, check: bool = True) -> tuple[_Trace, dict, list]:
    """The step's trace, how it was made and notes saying so, from ``traces`` (layer
    count -> trace), tracing what is missing into ``traces``. 'extrapolate'
    extrapolates linearly in the layer count from the shortest and longest of
    :func:`_layer_counts`; with ``check`` only after the middle count is seen to lie
    on that line (else every layer is traced)."""
    n = step.n_layers
    notes = []

    def get(k: int) -> _Trace:
        if k not in traces:
            traces[k] = step.trace(k)
        return traces[k]

    if layers == "extrapolate":
        l1, lm, l2 = _layer_counts(step.cfg)
        a, b = get(l1), get(l2)
        spent = a.seconds + b.seconds
        linear = True
        if check:
            spent += get(lm).seconds
            linear = _same_peaks(_extrapolate(a, b, lm), traces[lm])
        if linear:
            trace = _extrapolate(a, b, n)
            trace.seconds = spent
            if check:
                notes.append(
                    f"extrapolated to {n} layers from traces of {l1} and {l2} layers, after "
                    f"checking that the {lm}-layer trace lies on that line (every phase's peak); "
                    f"--layers full traces every layer"
                )
            else:
                notes.append(f"extrapolated to {n} layers from traces of {l1} and {l2} layers (not checked)")
            layers_traced = [l1, lm, l2] if check else [l1, l2]
            return trace, {"layers_traced": layers_traced, "extrapolated": True, "seconds": spent}, notes
        notes.append(
            f"the {l1}/{lm}/{l2}-layer traces are not linear in the layer count: traced all "
            f"{n} layers instead"
        )
    trace = get(n)
    seconds = sum(t.seconds for t in traces.values())
    return trace, {"layers_traced": [n], "extrapolated": False, "seconds": seconds}, notes


def _assemble(step: _Step, trace: _Trace, trace_info: dict, trace_notes: list = ()) -> MemoryPlan:
    """The plan of ``step`` from its (extrapolated) trace."""
    cfg, dims, device = step.cfg, step.dims, step.device
    peak_phase = max(trace.phase_peaks, key=lambda ph: trace.phase_peaks[ph]["total"])
    peak = trace.phase_peaks[peak_phase]
    breakdown = {k: v for k, v in peak["cats"].items() if v}
    # Categories are rounded separately when extrapolated: let them sum to the peak.
    drift = peak["total"] - sum(breakdown.values())
    if drift and breakdown:
        top = max(breakdown, key=breakdown.get)
        breakdown[top] += drift
    end_fwd = dict(trace.boundaries.get("backward", {}))
    end_fwd.pop("Total", None)

    mem = cfg.memory
    features = {
        "ac": cfg.activation_checkpoint.mode,
        "save_attention": cfg.activation_checkpoint.save_attention,
        "tiled_mlp": mem.tiled_mlp,
        "tiled_loss": mem.tiled_loss,
        "offload": mem.offload_activations,
        "offload_dir": step.offload_dir or None,
        "offload_params": mem.offload_params,
        "float8": cfg.float8.recipe_name if cfg.float8.enable else None,
        "float8_all_gather": cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather,
        "param_dtype": cfg.training.mixed_precision_param,
        "adamw_foreach": step.foreach,
    }
    notes = list(step.notes) + list(trace_notes)
    trace_info = {**trace_info, "loops": "edges" if trace.edges else "all", "ops": trace.ops}
    if trace.edges:
        notes.append(
            "loops over the sequence (MLP tiles, loss and RMSNorm chunks) traced at their first and "
            "last two pieces: the others repeat their memory (--loops all traces every one)"
        )
    elif step.edges:
        notes.append("every MLP tile traced: transformers records each tile's router logits for the router loss")
    if device == "cuda":
        notes.append(
            "allocated-tensor bytes: the CUDA caching allocator (fragmentation, reserved "
            "blocks), the CUDA context and NCCL buffers come on top; keep a few GiB of headroom"
        )
    if mem.offload_params and device == "cuda":
        notes.append(
            "memory.offload_params: parameter shards, gradient shards and AdamW state counted as "
            "host memory, and gradient clipping and the AdamW step as host work; the device keeps "
            "the gathered parameters in use and the H2D copies of the shards being gathered"
        )
    notes.append("packed documents not traced (one causal document per row): the kernel planned for them keeps "
                 "the same memory when its class is O(S) (cu_seqlens, a block mask)")
    host_bytes, disk = trace.host_peak, {}
    if step.offload_dir:
        disk = disk_split(trace)
        host_bytes = disk["host_bytes"]
        disk["step_time"] = _step_time(step, trace.layer_offload)
    return MemoryPlan(
        flavor=cfg.model.hf_path or cfg.model.flavor,
        world_size=step.world_size,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        sp=dims.sp,
        tp=dims.tp,
        seq_len=step.seq_len,
        rows=step.micro,
        local_tokens=step.micro * step.seq_len // dims.sp,
        vocab_size=step.vocab,
        n_layers=step.n_layers,
        device=device,
        features=features,
        peak_bytes=peak["total"],
        peak_phase=peak_phase,
        breakdown=breakdown,
        kinds={k: v for k, v in peak["kinds"].items() if v},
        phase_peaks={ph: p["total"] for ph, p in trace.phase_peaks.items()},
        end_of_forward=end_fwd,
        host_bytes=host_bytes,
        disk_bytes=disk.get("disk_bytes", 0),
        staging_bytes=disk.get("staging_bytes", 0),
        step_time=disk.get("step_time"),
        trace=trace_info,
        notes=notes,
        target=step.target.describe(),
        attention=_planned_attention(step),
    )


def _step_time(step: _Step, layer_bytes: int) -> dict:
    """The MODELLED step time of ``step`` with its layer inputs on the disk (:mod:`.disk`)."""
    from ..trainer.config import model_args

    cfg = step.cfg
    return modelled_step_time(
        model_args(cfg, step.vocab), step.dims, seq_len=step.seq_len, rows=step.rows, micro=step.micro,
        vocab=step.vocab, layer_bytes=layer_bytes, save_attention=cfg.activation_checkpoint.save_attention,
        tiled_loss=cfg.memory.tiled_loss, rates=step.rates)


def _planned_attention(step: _Step) -> list[dict]:
    """The attention kernels the plan is for, one entry per (kernel, case): what the
    target machine runs, why, the memory it keeps, and its calls in a traced step."""
    return [{"kernel": c.backend, "case": c.case, "why": c.why, "memory": c.memory,
             "calls": calls, "layers_traced": step.attention_layers}
            for c, calls in sorted(step.attention.items(), key=lambda kv: -kv[1])]


def plan_memory(
    cfg,
    world_size: int | None = None,
    seq_len: int | None = None,
    *,
    rows: int | None = None,
    device: str = "cuda",
    layers: str = "auto",
    foreach: bool | None = None,
    loops: str = "edges",
    target=None,
    disk_gbps: float | None = None,
    achieved_tflops=None,
) -> MemoryPlan:
    """Trace one training step of ``cfg`` on rank 0 of ``world_size`` fake ranks.

    Args:
        cfg: a :class:`~ulysses_dtensor.trainer.config.JobConfig`.
        world_size: ranks (default: what the config's parallel degrees make,
            with ``dp_shard=-1`` counted as 1).
        seq_len: tokens per sequence (default: the config's longest stage).
        rows: sequences per dp rank in the step (default: the config's global
            batch at that length / dp). ``training.micro_batch_size`` rows go
            through each forward; at most two micro-batches are traced (the
            second one already holds the first one's gradients, as every later
            one does).
        device: ``"cuda"`` plans for GPUs (AdamW foreach as torch picks on CUDA,
            FlashAttention-2 backward workspace added from the traced shapes);
            ``"cpu"`` plans for this machine (no foreach, no workspace).
        layers: ``"full"`` traces every layer; ``"extrapolate"`` traces 4, 5
            and 6 layers and extrapolates linearly in the layer count (a full
            trace if the three are not on a line); ``"auto"`` picks the one
            that costs less to trace.
        foreach: AdamW's foreach flag (default: torch's choice on ``device``).
        loops: ``"edges"`` traces the first and last two pieces of every loop
            over the sequence (MLP tiles, loss chunks, RMSNorm chunks), which
            gives the same memory at a cost independent of the length
            (:func:`~ulysses_dtensor.memory.tiling.edge_pieces_only`); ``"all"``
            traces every piece.
        target: the :class:`~ulysses_dtensor.attention.Capabilities` of the machine
            planned for: each attention call is planned with the kernel it runs
            there for the call's case (``auto``'s row of the kernel table, or the
            named backend, refused as a ConfigError where it cannot run), which
            decides whether it keeps O(S) or a dense (S, S) mask / scores. Default
            (:func:`~ulysses_dtensor.attention.planning.default_target`): this
            machine's GPU, else an H100 with this torch; the CPU for ``device="cpu"``.
        disk_gbps, achieved_tflops: with ``memory.offload_dir`` (the disk tier), what
            the plan's MODELLED step time assumes: the disk's bandwidth per GPU (GB/s,
            default :data:`~.disk.DISK_GBPS`) and the achieved rate (TFLOP/s: one number,
            or attention and matmul; default :data:`~.disk.ATTENTION_TFLOPS`,
            :data:`~.disk.MATMUL_TFLOPS`). The offloaded bytes are then the disk's
            (``disk_bytes``) and the host holds the staging area (``staging_bytes``,
            :data:`~.disk.STAGING_LAYERS` layers' worth) and the parameter state.

    The process must not have a process group (the planner makes a fake one).
    Raises :class:`~ulysses_dtensor.trainer.config.ConfigError` for a bad config.
    """
    if loops not in ("edges", "all"):
        raise ValueError(f"loops={loops!r} must be 'edges' or 'all'")
    step = _prepare(cfg, world_size, seq_len, rows=rows, device=device, foreach=foreach, edges=loops == "edges",
                    target=target, rates=Rates.of(achieved_tflops, disk_gbps))
    return _assemble(step, *_combine(step, {}, _layers_to_trace(step, layers)))
