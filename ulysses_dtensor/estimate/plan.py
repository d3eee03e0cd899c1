"""The plan: what one traced step's peak memory is made of, and how it prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..attention.kernel_table import MEMORY
from .disk import STAGING_LAYERS, format_step_time

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
    "offload_staging": "offload_params: device copy of a shard group (from shapes)",
}
KIND_LABELS = {
    "logits": "output head: logits, loss and their grads",
    "mlp": "MLP (SwiGLU hidden states)",
    "norm": "RMSNorm (float32 upcasts)",
    "attn_proj": "attention projections + rope (q, k, v, o)",
    "a2a": "Ulysses all-to-all buffers (+ packing copies)",
    "ring": "ring attention: k/v blocks in flight, fp32 merge, dq/dk/dv accumulators",
    "attention": "attention kernel (out, logsumexp, dq/dk/dv)",
    "embedding": "embedding",
    "block": "in a block, no sub-module (mostly backward temps)",
    "other": "outside the model (loss sum, clipping, offload copies, ...)",
}
_ACTIVATION_CATEGORIES = ("Activation", "Temp")
PHASES = ("setup", "reference", "old_policy", "forward", "backward", "clip", "optimizer", "zero_grad")  # GRPO: 2 more


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
    host_bytes: int  # peak bytes held on the host (offloaded block inputs, offloaded parameter state)
    trace: dict  # how the figure was made: layers traced, extrapolated, seconds
    notes: list = field(default_factory=list)
    tp: int = 1
    target: str = ""  # the machine whose attention kernels were planned (Capabilities.describe())
    attention: list = field(default_factory=list)  # the kernels planned: kernel, case, why, memory, calls
    # With memory.offload_dir (the disk tier): the offloaded bytes on the disk, and of host_bytes
    # the pinned staging area (disk.STAGING_LAYERS layers' worth); 0 without it.
    disk_bytes: int = 0
    staging_bytes: int = 0
    step_time: dict | None = None  # the MODELLED step time with the disk traffic (disk.modelled_step_time)

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
        mesh = f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} sp={self.sp}" + (
            f" tp={self.tp}" if self.tp > 1 else "")
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
        if self.attention:
            lines.append(f"  attention planned as {self.target} runs it:")
            for a in self.attention:
                lines.append(f"    {a['kernel']} for {a['case']} ({a['why']}): keeps {MEMORY[a['memory']]}")
        lines.append(f"  saved activations when backward starts{'':19s}{g(self.saved_activation_bytes)}")
        if self.disk_bytes:
            lines.append(f"  {'disk (memory.offload_dir): the offloaded tensors':57s}{g(self.disk_bytes)}")
            staging = f"host: pinned staging area, {STAGING_LAYERS} layers of them"
            lines.append(f"  {staging:57s}{g(self.staging_bytes)}")
            lines.append(f"  {'host in all (staging, parameter state, host AdamW)':57s}{g(self.host_bytes)}")
        elif self.host_bytes:
            lines.append(f"  host (pinned CPU) memory for offloaded tensors{'':11s}{g(self.host_bytes)}")
        if self.step_time:
            lines += format_step_time(self.step_time)
        t = self.trace
        how = (
            f"extrapolated linearly in the layer count from full-step traces of "
            f"{t['layers_traced']} layers"
            if t["extrapolated"]
            else f"one full-step trace of all {self.n_layers} layers"
        )
        if t.get("loops") == "edges":
            how += ", each loop over the sequence at its edge pieces"
        lines.append(f"  made by: {how}, {t['seconds']:.1f} s")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)
