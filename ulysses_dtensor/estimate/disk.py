"""The disk tier in a plan: where the offloaded bytes go, what stays on the host, and a
MODELLED step time with the disk traffic in it.

With ``memory.offload_dir`` the offloaded layer inputs (and, under ``save_attention``, the
kept attention outputs) go to files on a local disk through a pinned staging area in host
memory of :data:`STAGING_LAYERS` layers' worth. The trace is the host-offload trace (the
offloader keeps its copies on "meta" and the planner counts them, whatever tier holds
them); this module re-reads what it counted:

* disk bytes: every offloaded byte held at once (the trace's "meta" peak);
* host bytes: the staging area plus what else lives on the host (the parameter, gradient
  and AdamW shards under ``offload_params``, and the host AdamW step's temporaries).

The step time is a model, not a measurement: each block's forward and backward FLOPs per
rank at an assumed achieved rate, against the time to write (forward) and read back
(backward) one layer's offloaded bytes at the disk's bandwidth. A layer's write overlaps
the next layer's forward, a layer's read the backward of the layer above (the staging area
holds one layer being written or read and one being filled or used); what a transfer takes
beyond that compute is exposed. Communication, the host AdamW step and the PCIe copies are
not in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Layers' worth of offloaded bytes in the pinned staging area: the disk tier's own rule.
from ..memory.disk_offload import STAGING_LAYERS
# Disk bandwidth per GPU assumed by default, GB/s (1e9 bytes), each way: a local NVMe
# drive's sustained sequential write is a few GB/s. Pass the figure measured on the machine.
DISK_GBPS = 3.0
# Achieved bf16 rates on Hopper assumed by default, TFLOP/s (DESIGN.md, "Speed on Hopper" and
# "Reference figures"): SDPA forward + backward ran 512-551 on an H200; a plain 8192^3
# matmul reaches about 790 on an H100.
ATTENTION_TFLOPS = 550.0
MATMUL_TFLOPS = 790.0


@dataclass(frozen=True)
class Rates:
    """What the MODELLED step time assumes: achieved TFLOP/s and disk GB/s per GPU."""

    attention_tflops: float = ATTENTION_TFLOPS
    matmul_tflops: float = MATMUL_TFLOPS
    disk_gbps: float = DISK_GBPS

    def __post_init__(self) -> None:
        for name in ("attention_tflops", "matmul_tflops", "disk_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number")

    @classmethod
    def of(cls, achieved_tflops=None, disk_gbps: float | None = None) -> Rates:
        """From the planner's arguments: ``achieved_tflops`` one rate for both, or
        (attention, matmul); None: the defaults."""
        attn, mm = ATTENTION_TFLOPS, MATMUL_TFLOPS
        if achieved_tflops is not None:
            rates = [achieved_tflops] if isinstance(achieved_tflops, (int, float)) else list(achieved_tflops)
            if len(rates) not in (1, 2):
                raise ValueError(f"achieved_tflops={achieved_tflops!r}: one rate, or attention and matmul rates")
            attn, mm = rates[0], rates[-1]
        return cls(attn, mm, DISK_GBPS if disk_gbps is None else disk_gbps)


def disk_split(trace) -> dict:
    """Host, staging and disk bytes of a traced step whose offloaded tensors go to the disk."""
    staging = STAGING_LAYERS * trace.layer_offload
    return {"disk_bytes": trace.disk_peak, "staging_bytes": staging, "host_bytes": trace.host_fixed + staging}


def _block_flops(args, seq_len: int, rows: int, dims) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of one block on one rank, averaged over the blocks.

    Dense closed form: the q, k, v, o projections and a SwiGLU MLP (MoE: the experts a token
    is routed to), 2 FLOPs per weight and token; attention 2 x heads x (qk + v width) per
    attended key, half the sequence on average when causal, a window's worth where it slides,
    none in layers without softmax attention. Divided by sp x tp (balanced: Ulysses splits the
    heads, ring the queries, tp both the heads and the weights).
    """
    hd = args.head_dim
    vd = getattr(args, "v_head_dim", hd)
    ffn = args.ffn_dim * (getattr(args, "experts_per_token", 0) or 1)
    weights = args.dim * (args.n_heads * hd + args.n_kv_heads * (hd + vd)) + args.n_heads * vd * args.dim
    weights += 3 * args.dim * ffn
    tokens = rows * seq_len
    matmul = 2.0 * weights * tokens
    windows = getattr(args, "attention_windows", ()) or (None,) * args.n_layers
    keys = 0.0  # attended keys summed over the queries, averaged over the blocks
    for w in windows:
        if w == -1:
            continue
        if w is None or w >= seq_len:
            keys += seq_len * (seq_len + 1) / 2
        else:
            keys += seq_len * w - w * (w - 1) / 2
    keys /= len(windows)
    attention = 2.0 * args.n_heads * (hd + vd) * keys * rows
    split = dims.sp * dims.tp
    return matmul / split, attention / split


def modelled_step_time(args, dims, *, seq_len: int, rows: int, micro: int, vocab: int, layer_bytes: int,
                       save_attention: bool, tiled_loss: bool, rates: Rates) -> dict:
    """The MODELLED step time of a step whose layer inputs go to the disk (module doc).

    ``rows`` sequences per dp rank in the step, ``micro`` per forward; ``layer_bytes`` one
    layer's offloaded bytes (written in forward, read in backward).
    """
    mm, attn = _block_flops(args, seq_len, micro, dims)
    rmm, rattn = rates.matmul_tflops * 1e12, rates.attention_tflops * 1e12
    fwd = mm / rmm + attn / rattn
    # Full AC: backward recomputes the block's forward (its attention too, unless kept by
    # save_attention), then twice the forward's FLOPs.
    bwd = 3 * mm / rmm + (2 + (not save_attention)) * attn / rattn
    transfer = layer_bytes / (rates.disk_gbps * 1e9)
    n, micro_batches = args.n_layers, -(-rows // micro)
    exposed_fwd = n * max(0.0, transfer - fwd) * micro_batches
    exposed_bwd = n * max(0.0, transfer - bwd) * micro_batches
    # The output head: logits forward, their two gradients, and with tiled_loss the logits
    # recomputed in backward.
    head = (6 + 2 * tiled_loss) * micro * seq_len / (dims.sp * dims.tp) * args.dim * vocab / rmm
    compute = (n * (fwd + bwd) + head) * micro_batches
    where = [ph for ph, s in (("forward", exposed_fwd), ("backward", exposed_bwd)) if s > 0]
    return {
        "label": "MODELLED",
        "assumes": (f"blocks' FLOPs per rank at {rates.attention_tflops:g} TFLOP/s (attention) and "
                    f"{rates.matmul_tflops:g} TFLOP/s (matmuls) achieved; the disk at {rates.disk_gbps:g} GB/s "
                    f"per GPU each way; a layer's write hidden behind the next layer's forward, its read behind "
                    f"the backward of the layer above; communication, the host AdamW step and PCIe copies not "
                    f"modelled"),
        "attention_tflops": rates.attention_tflops,
        "matmul_tflops": rates.matmul_tflops,
        "disk_gbps": rates.disk_gbps,
        "layer_bytes": layer_bytes,
        "forward_per_layer_s": fwd,
        "write_per_layer_s": transfer,
        "backward_per_layer_s": bwd,
        "read_per_layer_s": transfer,
        "disk_bytes_per_step": 2 * n * layer_bytes * micro_batches,  # each layer written once, read once
        "compute_s": compute,
        "exposed_forward_s": exposed_fwd,
        "exposed_backward_s": exposed_bwd,
        "exposed_s": exposed_fwd + exposed_bwd,
        "step_s": compute + exposed_fwd + exposed_bwd,
        "exposed_in": where,  # phases where the disk is not hidden behind compute ([]: hidden)
        # The slowest disk still hidden in both phases (GB/s): one layer's bytes in its forward.
        "hidden_down_to_gbps": layer_bytes / min(fwd, bwd) / 1e9 if fwd > 0 else math.inf,
    }


def _secs(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:,.1f} s"


def format_step_time(t: dict) -> list[str]:
    """The MODELLED step time as report lines."""
    gib = t["layer_bytes"] / (1 << 30)

    def state(transfer: float, compute: float) -> str:
        return "hidden" if transfer <= compute else f"{_secs(transfer - compute)} exposed"

    where = ", ".join(t["exposed_in"]) or "nowhere, hidden behind compute"
    return [
        f"  MODELLED step time with the disk tier (a model, not a measurement): {t['assumes']}",
        f"    per layer, forward: compute {_secs(t['forward_per_layer_s'])}, writing its {gib:.2f} GiB "
        f"{_secs(t['write_per_layer_s'])} ({state(t['write_per_layer_s'], t['forward_per_layer_s'])})",
        f"    per layer, backward: compute {_secs(t['backward_per_layer_s'])}, reading it back "
        f"{_secs(t['read_per_layer_s'])} ({state(t['read_per_layer_s'], t['backward_per_layer_s'])})",
        f"    per step: compute {_secs(t['compute_s'])} + exposed disk {_secs(t['exposed_s'])} (forward "
        f"{_secs(t['exposed_forward_s'])}, backward {_secs(t['exposed_backward_s'])}) = {_secs(t['step_s'])}; "
        f"the disk is exposed in: {where}",
        f"    the disk stays hidden down to {t['hidden_down_to_gbps']:.3g} GB/s per GPU",
    ]
