"""Memory planner: the per-rank peak memory of one training step, traced, not guessed.

    python -m ulysses_dtensor.estimate --config train_configs/llama3_8b_1m.toml --world-size 8
    python -m ulysses_dtensor.estimate --config ... --world-size 8 --max-seq-len --budget-gib 80

How the figure is made
----------------------
One process plays rank 0 of a world of ``N`` ranks: a ``fake`` process group
stands in for the other ranks (collectives return tensors of the right shape
and move nothing), and ``FakeTensorMode`` gives every tensor a shape, dtype and
device but no storage. Inside it the planner runs the trainer's own code:
:func:`~ulysses_dtensor.trainer.loop.build_model` (meta build, Ulysses, AC,
tiling, offload, FSDP2), the trainer's AdamW, and the trainer's step
(:func:`~ulysses_dtensor.trainer.step.train_step`: forward with labels,
backward, clip, optimizer step, zero grad) on a batch of this rank's shape.
PyTorch's ``FSDPMemTracker`` (a dispatch mode) sees every tensor the step
creates and frees, and keeps the bytes alive by category; the peak is the high
water mark of that running sum. So the plan follows the code as it changes;
there is no formula of the model in here.

It is the figure ``torch.cuda.max_memory_allocated()`` reports for a step
(bytes of live tensors, optimizer state already created), NOT what
``nvidia-smi`` shows: the CUDA caching allocator's reserved-but-free blocks
(fragmentation), the CUDA context, NCCL's buffers and kernel workspaces that
never become tensors all come on top. Keep a headroom (``--headroom-gib``).

Attribution
-----------
By tracker category (sums to the peak): parameters (sharded masters / gathered
for compute), gradients (sharded / unsharded before reduce-scatter), optimizer
state (plus the step's temporaries while it runs), activations (saved for
backward, and recomputed ones), backward temporaries (activation gradients),
FSDP all-gather and reduce-scatter buffers, inputs. A second, cross-cutting
view of the activation and temporary bytes by what made them: logits
(``(tokens, vocab)``-shaped tensors), MLP hidden states (``(tokens, ffn_dim)``),
attention kernel outputs (SDPA out + logsumexp), Ulysses all-to-all outputs,
other. Offloaded block inputs land on the ``meta`` device (free on the traced
device) and are reported as host memory.

What the trace cannot see, and the planner adds from the traced shapes when
planning for CUDA (``device="cuda"``, labelled as such): the workspace the
FlashAttention-2 backward kernel allocates internally (an fp32 dq accumulator
and, under GQA, dk/dv expanded to all query heads).

Speed
-----
Tracing costs about a quarter of a millisecond per dispatched op. An untiled
8B step traces in ~15 s, 70B in about a minute; tiling multiplies the ops (an
8B step at 3.7M tokens on 8 ranks runs ~400 MLP tiles per block and ~3500
loss chunks). ``layers="extrapolate"`` traces 4-, 5- and 6-block versions of
the model instead, checks that the 5-block peaks lie on the line through the
other two (else it traces every block), and extrapolates every phase's peak,
category and kind linearly in the block count (exact where tested: see tests
and benchmarks/RESULTS.md);
``"auto"`` (the default) picks whichever dispatches fewer ops, and the output
says which was done. A search (``--max-seq-len``) interpolates on the planned
peaks (memory grows about linearly with the length) and then re-plans the
boundary with full traces if it was found on extrapolated plans.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "MemoryPlan",
    "SeqLenSearch",
    "plan_memory",
    "find_max_seq_len",
    "main",
    "GIB",
]

GIB = 1 << 30

# Tracker categories (_FSDPRefType values) -> what the planner prints.
CATEGORY_LABELS = {
    "Sharded Param": "parameters, sharded (FSDP masters)",
    "Unsharded Param": "parameters, gathered for compute",
    "Buffer": "buffers",
    "Sharded Grad": "gradients, sharded",
    "Unsharded Grad": "gradients, unsharded (before reduce-scatter)",
    "OptState": "optimizer state (+ step temporaries)",
    "Activation": "activations saved for backward (+ recompute)",
    "Temp": "backward temporaries (activation grads, ...)",
    "All Gather": "FSDP all-gather buffers",
    "Reduce Scatter": "FSDP reduce-scatter buffers",
    "Inputs": "inputs (ids, labels, positions)",
    "attn_workspace": "attention backward workspace (FA2, untraced: from shapes)",
}
KIND_LABELS = {
    "logits": "output head: logits, loss and their grads",
    "mlp": "MLP (SwiGLU hidden states)",
    "norm": "RMSNorm (float32 upcasts)",
    "attn_proj": "attention projections + rope (q, k, v, o)",
    "a2a": "Ulysses all-to-all buffers (+ packing copies)",
    "attention": "attention kernel (out, logsumexp, dq/dk/dv)",
    "embedding": "embedding",
    "block": "in a block, no sub-module (mostly backward temps)",
    "other": "outside the model (loss sum, clipping, offload copies, ...)",
}
_ACTIVATION_CATEGORIES = ("Activation", "Temp")
PHASES = ("setup", "forward", "backward", "clip", "optimizer", "zero_grad")

# Backends that run on CUDA only (or, on CPU, forward only): traced as SDPA,
# whose CPU flash kernel keeps O(seq) memory like the GPU kernels do.
_TRACE_AS_SDPA = {"varlen", "flash_attn", "flex"}


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #


@dataclass
class MemoryPlan:
    """Per-rank peak memory of one training step (bytes of live tensors)."""

    flavor: str
    world_size: int
    dp_replicate: int
    dp_shard: int
    sp: int
    seq_len: int
    rows: int  # sequences per forward on one dp rank (micro-batch)
    local_tokens: int  # tokens per forward on this rank = rows * seq_len / sp
    vocab_size: int
    n_layers: int
    device: str  # what the plan is for: "cuda" (adds FA2 workspace) or "cpu"
    features: dict
    peak_bytes: int
    peak_phase: str
    breakdown: dict  # category -> bytes at the peak (sums to peak_bytes)
    kinds: dict  # activation+temp bytes at the peak by kind
    phase_peaks: dict  # phase -> peak bytes in that phase
    end_of_forward: dict  # category -> bytes as backward starts
    host_bytes: int  # peak bytes held on the host (offloaded block inputs)
    trace: dict  # how the figure was made: layers traced, extrapolated, seconds
    notes: list = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    @property
    def saved_activation_bytes(self) -> int:
        """Activation bytes alive when backward starts (what AC/offload/tiling shrink)."""
        return self.end_of_forward.get("Activation", 0)

    @property
    def state_bytes(self) -> int:
        """Parameters (sharded) + sharded gradients + optimizer state at the peak."""
        b = self.breakdown
        return b.get("Sharded Param", 0) + b.get("Sharded Grad", 0) + b.get("OptState", 0)

    def fits(self, budget_gib: float, headroom_gib: float) -> bool:
        return self.peak_bytes <= (budget_gib - headroom_gib) * GIB

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["peak_gib"] = round(self.peak_gib, 3)
        return d

    def format(self) -> str:
        def g(b):
            return f"{b / GIB:9.3f} GiB"

        lines = []
        mesh = f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} sp={self.sp}"
        feats = ", ".join(f"{k}={v}" for k, v in self.features.items())
        lines.append(
            f"PLANNED per-rank peak memory of one training step: {self.flavor} "
            f"({self.n_layers} layers, vocab {self.vocab_size}), world {self.world_size} "
            f"({mesh}), seq_len {self.seq_len:,} x {self.rows} row(s) per forward "
            f"-> {self.local_tokens:,} tokens per rank"
        )
        lines.append(f"  {feats}")
        lines.append(
            f"  peak {g(self.peak_bytes)}  (in {self.peak_phase}; allocated-tensor bytes, "
            f"what torch.cuda.max_memory_allocated reports)"
        )
        lines.append("  at the peak, by category:")
        for cat, b in sorted(self.breakdown.items(), key=lambda kv: -kv[1]):
            if b:
                lines.append(f"    {CATEGORY_LABELS.get(cat, cat):58s}{g(b)}")
        if any(self.kinds.values()):
            lines.append("  activations + temporaries at the peak, by kind of tensor:")
            for kind, b in sorted(self.kinds.items(), key=lambda kv: -kv[1]):
                if b:
                    lines.append(f"    {KIND_LABELS.get(kind, kind):58s}{g(b)}")
        lines.append("  peak by phase of the step:")
        for ph in PHASES:
            if ph in self.phase_peaks:
                lines.append(f"    {ph:58s}{g(self.phase_peaks[ph])}")
        lines.append(f"  saved activations when backward starts{'':19s}{g(self.saved_activation_bytes)}")
        if self.host_bytes:
            lines.append(f"  host (pinned CPU) memory for offloaded block inputs{'':6s}{g(self.host_bytes)}")
        t = self.trace
        how = (
            f"extrapolated linearly in the layer count from full-step traces of "
            f"{t['layers_traced']} layers"
            if t["extrapolated"]
            else f"one full-step trace of all {self.n_layers} layers"
        )
        lines.append(f"  made by: {how}, {t['seconds']:.1f} s")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- #
# The tracker
# --------------------------------------------------------------------------- #


def _fa2_backward_workspace(q: torch.Tensor, k: torch.Tensor) -> int:
    """Bytes FlashAttention-2's backward allocates inside the kernel call.

    ``q, k`` in SDPA layout (B, H, S, D). From flash_api.cpp (mha_bwd): an
    fp32 ``dq_accum`` of (B, round128(S), H, round32(D)), an fp32 ``softmax_d``
    of (B, H, round128(S)), and under GQA ``dk_expanded``/``dv_expanded`` of
    (B, S_k, H, D) in the input dtype.
    """
    b, h, s, d = q.shape
    s_k, h_k = k.shape[2], k.shape[1]
    s_r = -(-s // 128) * 128
    d_r = -(-d // 32) * 32 if d <= 192 else 256
    ws = b * s_r * h * d_r * 4 + b * h * s_r * 4
    if h_k != h:
        ws += 2 * b * s_k * h * d * q.element_size()
    return ws


def _make_tracker_cls():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, _UpdateType

    sdpa_bwd = set()
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_flash_attention_backward",
    ):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            sdpa_bwd.add(op.default)

    class StepTracker(FSDPMemTracker):
        """FSDPMemTracker + per-phase peaks + a by-kind view + untraced kernel workspace."""

        def __init__(self, mod, optm, *, classify, device, gpu_workspace):
            super().__init__(mod, optm)
            self.phase = "setup"
            self.phase_peaks: dict[str, dict] = {}
            self.boundaries: dict[str, dict] = {}
            self.host_peak = 0
            self._dev = device
            self._classify = classify
            self._gpu_workspace = gpu_workspace
            self._func = None
            self._pending_kind = None
            self._kinds: dict = defaultdict(int)  # (device, reftype, kind) -> bytes

        # -- phases ---------------------------------------------------------
        def set_phase(self, name: str) -> None:
            snap = self._cats()
            prev = self.boundaries.get(name)
            if prev is None or snap.get(_TOTAL_KEY, 0) > prev.get(_TOTAL_KEY, 0):
                self.boundaries[name] = snap
            self.phase = name

        def _cats(self) -> dict:
            snap = self._curr_mem_snap.get(self._dev, {})
            return {getattr(k, "value", k): v for k, v in snap.items()}

        def _kinds_now(self) -> dict:
            out: dict = defaultdict(int)
            for (dev, reftype, kind), b in self._kinds.items():
                if dev == self._dev and getattr(reftype, "value", reftype) in _ACTIVATION_CATEGORIES:
                    out[kind or "other"] += b
            return dict(out)

        def _record(self, total: int, extra: dict | None = None) -> None:
            cur = self.phase_peaks.get(self.phase)
            if cur is not None and total <= cur["total"]:
                return
            cats = self._cats()
            cats.pop(_TOTAL_KEY, None)
            for k, v in (extra or {}).items():
                cats[k] = cats.get(k, 0) + v
            self.phase_peaks[self.phase] = {"total": total, "cats": cats, "kinds": self._kinds_now()}

        # -- tracker overrides ---------------------------------------------
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._func = func
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and self._gpu_workspace and func in sdpa_bwd:
                ws = _fa2_backward_workspace(args[1], args[2])
                level = self._curr_mem_snap.get(self._dev, {}).get(_TOTAL_KEY, 0)
                self._record(level + ws, {"attn_workspace": ws})
            return out

        def _track(self, reftype, t):
            self._pending_kind = self._classify(self._func, t, self._mod_tracker.parents)
            try:
                super()._track(reftype, t)
            finally:
                self._pending_kind = None

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if u_type == _UpdateType.ADD:
                winfo.kind = self._pending_kind
                self._kinds[(winfo.device, winfo.reftype, winfo.kind)] += winfo.mem_consumed
            elif u_type == _UpdateType.DEL:
                self._kinds[(winfo.device, winfo.reftype, getattr(winfo, "kind", None))] -= winfo.mem_consumed
            elif u_type == _UpdateType.REF:
                kind = getattr(winfo, "kind", None)
                self._kinds[(winfo.device, old_reftype, kind)] -= winfo.mem_consumed
                self._kinds[(winfo.device, winfo.reftype, kind)] += winfo.mem_consumed
            elif u_type == _UpdateType.SIZE:
                key = (winfo.device, winfo.reftype, getattr(winfo, "kind", None))
                self._kinds[key] += winfo.mem_consumed - old_mem_consumed

        def _update_peak_stats(self, peak_state) -> None:
            # Global and per-phase peaks only: the per-module snapshots of the
            # base class cost a deep copy per module per op.
            for dev, snap in self._curr_mem_snap.items():
                total = snap[_TOTAL_KEY]
                if dev == self._dev:
                    self._record(total)
                elif dev.type == "meta":
                    self.host_peak = max(self.host_peak, total)

    return StepTracker


# Module names (components of a parameter FQN) -> kind, innermost first wins.
_MODULE_KINDS = {
    "inner": "a2a",  # the LocalAttention that Ulysses wraps: exchange + packing copies
    "feed_forward": "mlp",
    "attention_norm": "norm",
    "ffn_norm": "norm",
    "norm": "norm",
    "attention": "attn_proj",
    "output": "logits",
    "tok_embeddings": "embedding",
}


def _classifier(vocab: int, ffn: int, dim: int):
    """(op, output tensor, active module FQNs) -> kind of the tensor, for the by-kind view.

    The attention kernel and the all-to-all are recognised by op; everything
    else by the innermost active module of the model (forward, recompute, or
    the backward of that module); outside any module by shape.
    """

    def classify(func, t: torch.Tensor, parents) -> str:
        name = getattr(func, "__name__", str(func))
        if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
            return "attention"
        if "all_to_all" in name:
            return "a2a"
        best, depth = None, -1
        for fqn in parents:
            d = fqn.count(".")
            if d > depth:
                best, depth = fqn, d
        if best is not None and best != "Global":
            parts = best.split(".")
            for part in reversed(parts):
                kind = _MODULE_KINDS.get(part)
                if kind is not None:
                    return kind
            if "layers" in parts:
                return "block"
        if t.dim() >= 2 and not (t.dim() == 2 and t.shape[0] == dim):
            if t.shape[-1] == vocab:
                return "logits"
            if t.shape[-1] == ffn:
                return "mlp"
        return "other"

    return classify


# --------------------------------------------------------------------------- #
# Tracing one step
# --------------------------------------------------------------------------- #


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
def _no_weight_init():
    """Weight values do not matter for memory, and the init needs real data."""
    from .models.llama import Llama

    original = Llama.init_weights
    Llama.init_weights = lambda self, seed=0: None
    try:
        yield
    finally:
        Llama.init_weights = original


@dataclass
class _Trace:
    n_layers: int
    phase_peaks: dict
    boundaries: dict
    host_peak: int
    seconds: float


def _vocab_size(cfg) -> int:
    from .data import build_tokenizer
    from .trainer.loop import resolve_vocab_size

    return resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer).vocab_size)


def _trace_step(cfg, world_size: int, *, rows: int, micro: int, device: str, foreach: bool) -> _Trace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .loss import count_valid_tokens
    from .trainer.config import model_args, validate_config
    from .trainer.loop import build_model
    from .trainer.step import build_optimizer, train_step

    dims = validate_config(cfg, world_size)
    vocab = _vocab_size(cfg)
    args = model_args(cfg, vocab)
    seq_len = cfg.training.seq_len
    s_local = seq_len // dims.sp
    t0 = time.perf_counter()
    with _fake_world(world_size):
        pmesh = dims.build_mesh("cpu")  # before fake mode: flattening reads real tensors
        with FakeTensorMode(allow_non_fake_inputs=True), _private_sharding_prop_fake_mode():
            with _no_weight_init():
                model = build_model(cfg, pmesh, vocab, torch.device("cpu"))
            offloader = getattr(model, "offloader", None)
            if offloader is not None and device == "cuda":
                # Host copies on "meta": free on the traced device, counted as host memory.
                # (Planning for CPU keeps the trainer's CPU path: a copy in the same memory.)
                offloader.host_device = torch.device("meta")
            optimizer = build_optimizer(cfg, model, foreach=foreach)
            # Steady state: the optimizer state exists before the traced step.
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            batch = {
                "input_ids": torch.zeros(rows, s_local, dtype=torch.long),
                "labels": torch.zeros(rows, s_local, dtype=torch.long),
                "position_ids": torch.arange(s_local).repeat(rows, 1),
                "document_ids": None,
            }
            n_valid = count_valid_tokens(batch["labels"], pmesh.loss)
            tracker = _make_tracker_cls()(
                model,
                optimizer,
                classify=_classifier(vocab, args.ffn_dim, args.dim),
                device=torch.device("cpu"),
                gpu_workspace=device == "cuda",
            )
            tracker.track_inputs((batch["input_ids"], batch["labels"], batch["position_ids"]))
            with tracker:
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
    return _Trace(
        n_layers=args.n_layers,
        phase_peaks=tracker.phase_peaks,
        boundaries=tracker.boundaries,
        host_peak=tracker.host_peak,
        seconds=time.perf_counter() - t0,
    )


def _lin_dict(a: dict, b: dict, w: float) -> dict:
    keys = set(a) | set(b)
    return {k: max(0, round(a.get(k, 0) + (b.get(k, 0) - a.get(k, 0)) * w)) for k in keys}


def _extrapolate(t1: _Trace, t2: _Trace, n_layers: int) -> _Trace:
    """Each phase's peak, categories and kinds: linear in the layer count."""
    w = (n_layers - t1.n_layers) / (t2.n_layers - t1.n_layers)
    phases = {}
    for ph in set(t1.phase_peaks) & set(t2.phase_peaks):
        p1, p2 = t1.phase_peaks[ph], t2.phase_peaks[ph]
        phases[ph] = {
            "total": round(p1["total"] + (p2["total"] - p1["total"]) * w),
            "cats": _lin_dict(p1["cats"], p2["cats"], w),
            "kinds": _lin_dict(p1["kinds"], p2["kinds"], w),
        }
    bounds = {
        ph: _lin_dict(t1.boundaries[ph], t2.boundaries[ph], w)
        for ph in set(t1.boundaries) & set(t2.boundaries)
    }
    host = round(t1.host_peak + (t2.host_peak - t1.host_peak) * w)
    return _Trace(n_layers, phases, bounds, max(0, host), t1.seconds + t2.seconds)


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


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
    from .tiling import auto_num_tiles

    mem = cfg.memory
    per_layer = 200
    if mem.tiled_mlp:
        per_layer += 40 * (mem.mlp_tiles or auto_num_tiles(s_local, args.ffn_dim, args.dim))
    loss = 10 * ((mem.loss_chunks or auto_num_tiles(s_local, args.vocab_size, args.dim)) if mem.tiled_loss else 5)
    full = args.n_layers * per_layer + loss
    extrapolated = sum(counts) * per_layer + len(counts) * loss
    return "extrapolate" if args.n_layers > counts[-1] and extrapolated < 0.7 * full else "full"


def _default_world_size(cfg) -> int:
    p = cfg.parallelism
    return p.dp_replicate * p.sp * (p.dp_shard if p.dp_shard > 0 else 1)


def _prepared_config(cfg, seq_len, rows, notes):
    """A copy of cfg for one traced step of ``seq_len`` and ``rows`` sequences per dp rank."""
    cfg = copy.deepcopy(cfg)
    schedule = cfg.context_schedule()
    if seq_len is None:
        seq_len = schedule.max_seq_len
    batch = max(1, schedule.batch_for(seq_len))
    if cfg.model.attn_backend in _TRACE_AS_SDPA:
        notes.append(
            f"attention traced with 'sdpa' (CPU flash kernel, O(seq) memory) in place of "
            f"{cfg.model.attn_backend!r}, which needs CUDA"
        )
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
    from .mesh import ParallelDims
    from .trainer.config import model_args, validate_config

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
            dp = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size).dp
        except ValueError:
            dp = 1  # validate_config below raises the ConfigError
        cfg.training.global_batch_size = rows * dp
    else:
        cfg.training.global_batch_size = batch
    dims = validate_config(cfg, world_size)
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
    from .models.llama import FLAVORS

    flavor_vocab = FLAVORS[cfg.model.flavor].vocab_size
    if vocab != flavor_vocab:
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
        "tiled_mlp": mem.tiled_mlp,
        "tiled_loss": mem.tiled_loss,
        "offload": mem.offload_activations,
        "param_dtype": cfg.training.mixed_precision_param,
        "adamw_foreach": foreach,
    }
    if device == "cuda":
        notes.append(
            "allocated-tensor bytes: the CUDA caching allocator (fragmentation, reserved "
            "blocks), the CUDA context and NCCL buffers come on top; keep a few GiB of headroom"
        )
    notes.append("packed-document masking not modelled: traced as one causal document per row")
    return MemoryPlan(
        flavor=cfg.model.flavor,
        world_size=world_size,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        sp=dims.sp,
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


@dataclass
class SeqLenSearch:
    """Result of :func:`find_max_seq_len`."""

    max_seq_len: int  # 0 if even one unit does not fit
    unit: int  # granularity of the search in tokens (granularity * sp)
    budget_gib: float
    headroom_gib: float
    best: MemoryPlan | None  # plan at max_seq_len (full trace when confirmed)
    next_up: MemoryPlan | None  # plan at max_seq_len + unit (does not fit)
    plans: list = field(default_factory=list)  # (seq_len, peak_bytes, extrapolated) tried
    confirmed: bool = False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "max_seq_len": self.max_seq_len,
            "unit": self.unit,
            "budget_gib": self.budget_gib,
            "headroom_gib": self.headroom_gib,
            "confirmed_by_full_trace": self.confirmed,
            "seconds": round(self.seconds, 1),
            "tried": self.plans,
            "best": self.best.to_dict() if self.best else None,
            "next_up": self.next_up.to_dict() if self.next_up else None,
        }


def find_max_seq_len(
    cfg,
    world_size: int | None = None,
    *,
    budget_gib: float = 80.0,
    headroom_gib: float = 6.0,
    granularity: int = 1024,
    rows: int = 1,
    device: str = "cuda",
    layers: str = "auto",
    confirm: bool = True,
    foreach: bool | None = None,
    max_units: int = 1 << 16,
    log=None,
) -> SeqLenSearch:
    """Longest ``seq_len`` (a multiple of ``granularity * sp``) whose planned peak fits.

    Fits means ``peak <= budget_gib - headroom_gib``. ``rows`` sequences per dp
    rank (default one). The search brackets the answer between a length that
    fits and the next multiple up that does not, by interpolation on the
    planned peaks (memory grows about linearly with the length), falling back
    to bisection; every point is a traced plan (``layers`` as in
    :func:`plan_memory`). With ``confirm``, boundary plans that were
    extrapolated are redone with full traces and the bracket is fixed up.
    """
    from .mesh import ParallelDims
    from .trainer.config import validate_config

    if world_size is None:
        world_size = _default_world_size(cfg)
    par = cfg.parallelism
    try:
        sp = ParallelDims(par.dp_replicate, par.dp_shard, par.sp, world_size=world_size).sp
    except ValueError:
        validate_config(cfg, world_size)  # raises the ConfigError
        raise
    unit = granularity * sp
    limit = (budget_gib - headroom_gib) * GIB
    t0 = time.perf_counter()
    tried: list = []
    cache: dict[tuple[int, str], MemoryPlan] = {}

    def get(k: int, how: str) -> MemoryPlan:
        if (k, how) not in cache:
            p = plan_memory(cfg, world_size, k * unit, rows=rows, device=device, layers=how, foreach=foreach)
            cache[(k, how)] = p
            tried.append((k * unit, p.peak_bytes, p.trace["extrapolated"]))
            if log is not None:
                made = "extrapolated" if p.trace["extrapolated"] else "full trace"
                log(f"  seq_len {k * unit:>12,}: {p.peak_gib:8.2f} GiB ({made}, {p.trace['seconds']:.0f} s)")
        return cache[(k, how)]

    def search(how: str, lo: int = 0, hi: int | None = None) -> int:
        """Largest k with a fitting plan, given lo fits (or is 0) and hi does not (or None)."""
        peaks: dict[int, int] = {}

        def fits(k: int) -> bool:
            peaks[k] = get(k, how).peak_bytes
            return peaks[k] <= limit

        if lo == 0 and hi is None:
            if not fits(1):
                return 0
            lo = 1
        last_width = None
        while hi is None or hi - lo > 1:
            fit_ks = sorted(k for k in peaks if peaks[k] <= limit)
            confident = True
            if hi is None:
                kb = fit_ks[-1]
                # Slope over a wide span: the largest fitting point at most half of kb.
                below = [k for k in fit_ks if k <= kb // 2] or fit_ks[:-1]
                ka = below[-1] if below else None
                if ka is not None and peaks[kb] > peaks[ka]:
                    slope = (peaks[kb] - peaks[ka]) / (kb - ka)
                    pred = int(kb + (limit - peaks[kb]) / slope)
                    k = max(pred, kb + 1)
                    if k > 8 * kb:  # too far to trust: grow geometrically
                        k, confident = 8 * kb, False
                else:
                    k, confident = 4 * lo, False
                if k > max_units:
                    if lo >= max_units or fits(max_units):
                        return max_units
                    hi = max_units
                    continue
            else:
                width = hi - lo
                if lo in peaks and hi in peaks and peaks[hi] > peaks[lo] and (
                    last_width is None or width <= last_width // 2 or width <= 4
                ):
                    k = lo + int((limit - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo]))
                    k = min(max(k, lo + 1), hi - 1)
                else:
                    k, confident = (lo + hi) // 2, False
                last_width = width
            ok = fits(k)
            # Peak per unit of length near k, from the nearest other planned point.
            others = [j for j in peaks if j != k]
            near = min(others, key=lambda j: abs(j - k)) if others else None
            per_unit = abs(peaks[k] - peaks[near]) / abs(k - near) if near is not None else 0.0
            # Within a unit and a half of the limit: the neighbour is likely the boundary.
            close = confident and per_unit > 0 and abs(limit - peaks[k]) < 1.5 * per_unit
            if ok:
                lo = k
                if close and (hi is None or k + 1 < hi) and k + 1 <= max_units and not fits(k + 1):
                    hi = k + 1
            else:
                hi = k
                if close and k - 1 > lo and fits(k - 1):
                    lo = k - 1
        return lo

    k = search(layers)
    confirmed = all(not get(j, layers).trace["extrapolated"] for j in (k, k + 1) if j >= 1)
    how = layers
    if confirm and not confirmed:
        # Extrapolation is exact to a fraction of a percent: walk, don't search.
        how = "full"
        while k >= 1 and get(k, "full").peak_bytes > limit:
            k -= 1
        while k + 1 <= max_units and get(k + 1, "full").peak_bytes <= limit:
            k += 1
        confirmed = True
    best = get(k, how) if k >= 1 else None
    next_up = get(k + 1, how)
    return SeqLenSearch(
        max_seq_len=k * unit,
        unit=unit,
        budget_gib=budget_gib,
        headroom_gib=headroom_gib,
        best=best,
        next_up=next_up,
        plans=tried,
        confirmed=confirmed,
        seconds=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #

_EPILOG = """\
Every other --section.key value is a config override, as for the trainer
(e.g. --parallelism.sp 8 --memory.tiled_loss true --model.vocab_size 128256).

The figure is allocated-tensor bytes (torch.cuda.max_memory_allocated), not
nvidia-smi: keep --headroom-gib for the caching allocator, CUDA context and NCCL.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ulysses_dtensor.estimate",
        description="Per-rank peak memory of one training step, traced on fake tensors.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--config", help="trainer TOML config")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to simulate (default: dp_replicate*dp_shard*sp of the config, dp_shard=-1 as 1)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the config's longest stage)")
    p.add_argument("--rows", type=int, default=None,
                   help="sequences per dp rank in the step (default: from the config; 1 with --max-seq-len)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="plan for GPUs (default) or CPU")
    p.add_argument("--layers", choices=("full", "extrapolate", "auto"), default=None,
                   help="full trace, or 4/5/6-layer traces extrapolated linearly in the layer count; "
                        "auto (default): whichever traces fewer ops")
    p.add_argument("--foreach", choices=("true", "false"), default=None, help="AdamW foreach (default: torch's choice)")
    p.add_argument("--max-seq-len", action="store_true", help="search the longest sequence that fits the budget")
    p.add_argument("--budget-gib", type=float, default=80.0, help="device memory in GiB (default 80)")
    p.add_argument("--headroom-gib", type=float, default=6.0,
                   help="kept free for allocator fragmentation, CUDA context, NCCL (default 6)")
    p.add_argument("--granularity", type=int, default=1024, help="search step in tokens per sp rank (default 1024)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    from .trainer.config import ConfigError, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns, rest = parser.parse_known_args(argv)
    try:
        cfg = load_config(rest + (["--config", ns.config] if ns.config else []))
        foreach = None if ns.foreach is None else ns.foreach == "true"
        if ns.max_seq_len:
            log = None if ns.json else (lambda s: print(s, file=sys.stderr, flush=True))
            res = find_max_seq_len(
                cfg, ns.world_size, budget_gib=ns.budget_gib, headroom_gib=ns.headroom_gib,
                granularity=ns.granularity, rows=ns.rows or 1, device=ns.device,
                layers=ns.layers or "auto", foreach=foreach, log=log,
            )
            if ns.json:
                print(json.dumps(res.to_dict()))
                return 0
            limit = ns.budget_gib - ns.headroom_gib
            print(
                f"PLANNED longest sequence that fits {ns.budget_gib:g} GiB - {ns.headroom_gib:g} GiB "
                f"headroom = {limit:g} GiB of allocated tensors per rank: {res.max_seq_len:,} tokens "
                f"(search step {res.unit:,} tokens; "
                f"{'boundary planned with full traces' if res.confirmed else 'boundary planned on extrapolated traces'}; "
                f"{res.seconds:.0f} s)"
            )
            if res.best is not None:
                print(res.best.format())
            if res.next_up is not None:
                print(f"next step up, {res.next_up.seq_len:,} tokens: {res.next_up.peak_gib:.2f} GiB > {limit:g} GiB")
            return 0
        plan = plan_memory(
            cfg, ns.world_size, ns.seq_len, rows=ns.rows, device=ns.device,
            layers=ns.layers or "auto", foreach=foreach,
        )
        print(json.dumps(plan.to_dict()) if ns.json else plan.format())
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
