"""Planning: :func:`plan_memory`, one step's plan from one full trace or
three extrapolated ones."""

from __future__ import annotations

import copy

from .plan import MemoryPlan
from .trace import _extrapolate, _Trace, _trace_step, _vocab_size

# Backends that run on CUDA only (or, on CPU, forward only), and "auto", which
# picks one of them at run time: traced as SDPA, whose CPU flash kernel keeps
# O(seq) memory like the GPU kernels do.
_TRACE_AS_SDPA = {"varlen", "flash_attn", "flex", "auto"}


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


def _same_peaks(a: "_Trace", b: "_Trace", rel: float = 1e-3, abs_bytes: int = 1 << 20) -> bool:
    """Every phase's peak of ``a`` within ``rel`` (or 1 MiB) of ``b``'s."""
    if set(a.phase_peaks) != set(b.phase_peaks):
        return False
    for ph, pa in a.phase_peaks.items():
        pb = b.phase_peaks[ph]["total"]
        if abs(pa["total"] - pb) > max(abs_bytes, rel * pb):
            return False
    return True


def _cheaper_trace(cfg, args, s_local: int, counts: tuple[int, ...]) -> str:
    """'full' or 'extrapolate', whichever dispatches fewer ops (the cost of a trace).

    Rough relative costs, measured on Llama-3-8B traces: ~200 per untiled block,
    ~40 more per MLP tile (forward, recompute and backward of each tile), ~10
    per loss chunk; the extrapolated plan traces the loss once per trace.
    """
    from ..memory.tiling import auto_loss_chunks, auto_num_tiles

    mem = cfg.memory
    per_layer = 200
    if mem.tiled_mlp:
        per_layer += 40 * (mem.mlp_tiles or auto_num_tiles(s_local, args.ffn_dim, args.dim))
    loss = 10 * ((mem.loss_chunks or auto_loss_chunks(s_local, args.vocab_size)) if mem.tiled_loss else 5)
    full = args.n_layers * per_layer + loss
    extrapolated = sum(counts) * per_layer + len(counts) * loss
    return "extrapolate" if args.n_layers > counts[-1] and extrapolated < 0.7 * full else "full"


def _default_world_size(cfg) -> int:
    p = cfg.parallelism
    return p.dp_replicate * p.sp * p.tp * (p.dp_shard if p.dp_shard > 0 else 1)


def _prepared_config(cfg, seq_len, rows, notes):
    """A copy of cfg for one traced step of ``seq_len`` and ``rows`` sequences per dp rank."""
    cfg = copy.deepcopy(cfg)
    schedule = cfg.context_schedule()
    if seq_len is None:
        seq_len = schedule.max_seq_len
    batch = max(1, schedule.batch_for(seq_len))
    if cfg.model.attn_backend in _TRACE_AS_SDPA:
        what = (
            "'auto' (flash_attn or varlen on CUDA in 16-bit)"
            if cfg.model.attn_backend == "auto"
            else f"{cfg.model.attn_backend!r}, which needs CUDA"
        )
        notes.append(f"attention traced with 'sdpa' (CPU flash kernel, O(seq) memory) in place of {what}")
        cfg.model.attn_backend = "sdpa"
    if cfg.training.compile:
        notes.append(
            "traced eagerly: torch.compile (training.compile=true) fuses elementwise ops and "
            "usually needs somewhat less activation memory than this"
        )
        cfg.training.compile = False
    cfg.context.schedule = []
    cfg.context.constant_tokens_per_step = False
    cfg.training.seq_len = seq_len
    return cfg, seq_len, batch


def plan_memory(
    cfg,
    world_size: int | None = None,
    seq_len: int | None = None,
    *,
    rows: int | None = None,
    device: str = "cuda",
    layers: str = "auto",
    foreach: bool | None = None,
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
            with fewer ops to trace.
        foreach: AdamW's foreach flag (default: torch's choice on ``device``).

    The process must not have a process group (the planner makes a fake one).
    Raises :class:`~ulysses_dtensor.trainer.config.ConfigError` for a bad config.
    """
    from ..parallel.mesh import ParallelDims
    from ..trainer.config import model_args, validate_config

    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu'")
    if layers not in ("full", "extrapolate", "auto"):
        raise ValueError(f"layers={layers!r} must be 'full', 'extrapolate' or 'auto'")
    if world_size is None:
        world_size = _default_world_size(cfg)
    notes: list[str] = []
    cfg, seq_len, batch = _prepared_config(cfg, seq_len, rows, notes)
    if rows is not None:
        par = cfg.parallelism
        try:
            dp = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size, ring=par.ring, tp=par.tp).dp
        except ValueError:
            dp = 1  # validate_config below raises the ConfigError
        cfg.training.global_batch_size = rows * dp
    else:
        cfg.training.global_batch_size = batch
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
    from ..models.llama import FLAVORS

    flavor_vocab = FLAVORS[cfg.model.flavor].vocab_size
    if vocab != flavor_vocab and not cfg.model.hf_path:  # hf_path: the model's own vocabulary
        notes.append(
            f"vocab {vocab} from data.tokenizer={cfg.data.tokenizer!r}; the flavor's own "
            f"vocabulary is {flavor_vocab} (plan it with --model.vocab_size {flavor_vocab})"
        )

    l1, lm, l2 = _layer_counts(cfg)
    if layers == "auto":
        layers = _cheaper_trace(cfg, args, seq_len // dims.sp, (l1, lm, l2))
    trace = None
    if layers == "extrapolate" and args.n_layers > l2:
        traces = []
        for n in (l1, lm, l2):
            c = copy.deepcopy(cfg)
            c.model.n_layers = n
            traces.append(_trace_step(c, world_size, rows=traced_rows, micro=micro, device=device, foreach=foreach))
        spent = sum(t.seconds for t in traces)
        middle = _extrapolate(traces[0], traces[2], lm)
        if _same_peaks(middle, traces[1]):
            trace = _extrapolate(traces[0], traces[2], args.n_layers)
            trace.seconds = spent
            trace_info = {"layers_traced": [l1, lm, l2], "extrapolated": True, "seconds": spent}
            notes.append(
                f"extrapolated to {args.n_layers} layers from traces of {l1} and {l2} layers, after "
                f"checking that the {lm}-layer trace lies on that line (every phase's peak); "
                f"--layers full traces every layer"
            )
        else:
            notes.append(
                f"the {l1}/{lm}/{l2}-layer traces are not linear in the layer count: traced all "
                f"{args.n_layers} layers instead"
            )
    if trace is None:
        trace = _trace_step(cfg, world_size, rows=traced_rows, micro=micro, device=device, foreach=foreach)
        if layers == "extrapolate" and args.n_layers > l2:
            trace.seconds += spent
        trace_info = {"layers_traced": [args.n_layers], "extrapolated": False, "seconds": trace.seconds}

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
        "offload_params": mem.offload_params,
        "param_dtype": cfg.training.mixed_precision_param,
        "adamw_foreach": foreach,
    }
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
    notes.append("packed-document masking not modelled: traced as one causal document per row")
    return MemoryPlan(
        flavor=cfg.model.hf_path or cfg.model.flavor,
        world_size=world_size,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        sp=dims.sp,
        tp=dims.tp,
        seq_len=seq_len,
        rows=micro,
        local_tokens=micro * seq_len // dims.sp,
        vocab_size=vocab,
        n_layers=args.n_layers,
        device=device,
        features=features,
        peak_bytes=peak["total"],
        peak_phase=peak_phase,
        breakdown=breakdown,
        kinds={k: v for k, v in peak["kinds"].items() if v},
        phase_peaks={ph: p["total"] for ph, p in trace.phase_peaks.items()},
        end_of_forward=end_fwd,
        host_bytes=trace.host_peak,
        trace=trace_info,
        notes=notes,
    )
