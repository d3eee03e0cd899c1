"""The memory tracker: FSDPMemTracker plus per-phase peaks, a by-kind view of
activations, and the FlashAttention-2 backward workspace the trace cannot see."""

from __future__ import annotations

from collections import defaultdict

import torch

from .plan import _ACTIVATION_CATEGORIES


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
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
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

    _DEVICE_OF = torch.ops.prim.device.default

    class StepTracker(FSDPMemTracker):
        """FSDPMemTracker + per-phase peaks + a by-kind view + untraced kernel workspace."""

        def __init__(self, mod, optm, *, classify, device, gpu_workspace, host_state=False, staging=0):
            """``host_state``: plan for FSDP2 CPU offload, where the parameter
            shards, gradient shards and optimizer state live in host memory and
            clipping + the optimizer step run on the host. The trace runs all of
            it on one fake device; these categories and phases are moved to the
            host side of the ledger at every update. ``staging``: bytes of the
            device copy of the largest shard group being gathered, which the
            one-device trace cannot see; added to every device peak."""
            super().__init__(mod, optm)
            self._staging = staging
            self._host_cats = _HOST_STATE_CATEGORIES if host_state else ()
            self._host_keys = [t for t in _FSDPRefType if t.value in self._host_cats]
            self._host_phases = _HOST_PHASES if host_state else ()
            self._meta_level = 0
            self.meta_peak = 0  # offloaded bytes held at once (on the host, or on the disk with offload_dir)
            self.offload_slots: dict = {}  # offloader handle -> bytes of its slot (see trace.traced_model)
            self._boundary_device_level = 0
            self.phase = "setup"
            self.phase_peaks: dict[str, dict] = {}
            self.boundaries: dict[str, dict] = {}
            self.host_peak = 0
            self.host_phase_peaks: dict[str, int] = {}  # phase -> host peak in that phase
            self.host_state_peak = 0  # the part of it that does not grow with the length (parameter state)
            self.ops = 0  # ops dispatched, but for device queries
            self._dev = device
            self._classify = classify
            self._gpu_workspace = gpu_workspace
            self._func = None
            self._pending = None
            self._kinds: dict = defaultdict(int)  # (device, reftype, kind) -> bytes

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
            # FSDP runs every group's post-backward after backward, also one whose module no
            # forward ran (a VL model's frozen vision tower); the base class's bookkeeping of
            # it exists only for modules that ran: such a group just runs its own.
            tracked = super()._fsdp_param_group_post_backward(fsdp_mod, orig_post_backward)

            def inner(*args, **kwargs):
                if fsdp_mod in self.memory_tracking:
                    return tracked(*args, **kwargs)
                return orig_post_backward(*args, **kwargs)

            return inner

        # -- phases ---------------------------------------------------------
        def set_phase(self, name: str) -> None:
            snap = self._cats()
            prev = self.boundaries.get(name)
            if prev is None or snap.get(_TOTAL_KEY, 0) > prev.get(_TOTAL_KEY, 0):
                self.boundaries[name] = snap
            self.phase = name
            if name in self._host_phases:
                # The device holds at most what it held as the host work began.
                self._boundary_device_level = self._device_level()
                self._record(self._boundary_device_level)  # host work copies nothing to the device

        def _cats(self) -> dict:
            snap = self._curr_mem_snap.get(self._dev, {})
            cats = {getattr(k, "value", k): v for k, v in snap.items()}
            for c in self._host_cats:
                if c in cats:
                    cats[_TOTAL_KEY] = cats.get(_TOTAL_KEY, 0) - cats.pop(c)
            return cats

        def _staging_cat(self) -> dict:
            return {"offload_staging": self._staging} if self._staging else {}

        def _host_state_level(self) -> int:
            if not self._host_cats:
                return 0
            snap = self._curr_mem_snap.get(self._dev, {})
            return sum(snap.get(k, 0) for k in self._host_keys)

        def _device_level(self) -> int:
            return self._curr_mem_snap.get(self._dev, {}).get(_TOTAL_KEY, 0) - self._host_state_level()

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
            if func is _DEVICE_OF:
                # Asked thousands of times per step (the autograd engine, F.linear):
                # returns no tensor, so nothing to track.
                return func(*args, **(kwargs or {}))
            self._func = func
            self.ops += 1
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and self._gpu_workspace and func in sdpa_bwd:
                ws = _fa2_backward_workspace(args[1], args[2])
                self._record(self._device_level() + ws + self._staging, {"attn_workspace": ws, **self._staging_cat()})
            return out

        def _track(self, reftype, t):
            self._pending = t  # classified only if it is a new storage (not a view)
            try:
                super()._track(reftype, t)
            finally:
                self._pending = None

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if u_type == _UpdateType.ADD:
                t = self._pending
                winfo.kind = None if t is None else self._classify(self._func, t, self._mod_tracker.parents)
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
                if dev == self._dev:
                    if self.phase in self._host_phases:
                        # Host work: what it allocates is host memory.
                        level = snap[_TOTAL_KEY] - self._boundary_device_level
                    else:
                        self._record(self._device_level() + self._staging, self._staging_cat())
                        level = self._host_state_level()
                    self._host(self._meta_level + level)
                    self.host_state_peak = max(self.host_state_peak, level)
                elif dev.type == "meta":
                    self._meta_level = snap[_TOTAL_KEY]
                    self.meta_peak = max(self.meta_peak, self._meta_level)
                    self._host(self._meta_level + self._host_state_level())

        def _host(self, level: int) -> None:
            if level > self.host_phase_peaks.get(self.phase, 0):
                self.host_phase_peaks[self.phase] = level
                self.host_peak = max(self.host_peak, level)

    return StepTracker


# Under FSDP2 CPU offload these tensors live in host memory, and the phases
# that only touch them (clipping, AdamW, zero_grad) run on the host.
_HOST_STATE_CATEGORIES = ("Sharded Param", "Sharded Grad", "OptState")
_HOST_PHASES = ("clip", "optimizer", "zero_grad")


# Module names (components of a parameter FQN) -> kind, innermost first wins: our
# Llama's, then transformers' spellings.
_MODULE_KINDS = {
    "inner": "a2a",  # the LocalAttention that Ulysses wraps: exchange + packing copies
    "feed_forward": "mlp",
    "attention_norm": "norm",
    "ffn_norm": "norm",
    "norm": "norm",
    "attention": "attn_proj",
    "output": "logits",
    "tok_embeddings": "embedding",
    "ulysses": "a2a",  # transformers' attention core under the exchange
    "mlp": "mlp",
    "block_sparse_moe": "mlp",
    "input_layernorm": "norm",
    "post_attention_layernorm": "norm",
    "pre_feedforward_layernorm": "norm",
    "post_feedforward_layernorm": "norm",
    "q_norm": "norm",
    "k_norm": "norm",
    "self_attn": "attn_proj",
    "linear_attn": "attn_proj",
    "lm_head": "logits",
    "embed_tokens": "embedding",
}


def _classifier(vocab: int, ffn: int, dim: int, ring: bool = False):
    """(op, output tensor, active module FQNs) -> kind of the tensor, for the by-kind view.

    The attention kernel and the all-to-all are recognised by op; everything
    else by the innermost active module of the model (forward, recompute, or
    the backward of that module); outside any module by shape. With ring
    attention (``ring``) the attention's inner module is the ring, and its
    transfers are the flat (1-D) all-to-all buffers.
    """

    def classify(func, t: torch.Tensor, parents) -> str:
        name = getattr(func, "__name__", str(func))
        if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
            return "attention"
        if "all_to_all" in name:
            return "ring" if ring and t.dim() == 1 else "a2a"
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
                    return "ring" if ring and kind == "a2a" else kind
            if "layers" in parts:
                return "block"
        if t.dim() >= 2 and not (t.dim() == 2 and t.shape[0] == dim):
            if t.shape[-1] == vocab:
                return "logits"
            if t.shape[-1] == ffn:
                return "mlp"
        return "other"

    return classify
