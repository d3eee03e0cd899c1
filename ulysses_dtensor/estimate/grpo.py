"""The planner's GRPO mode: the per-rank peak memory of one step of ``UlyssesGRPOTrainer``.

    python -m ulysses_dtensor.estimate --grpo --model.hf_path ... --max-seq-len   # prompt + completion

A GRPO step differs from a pretraining step in what it holds and runs, and the trace
follows :mod:`ulysses_dtensor.integrations.trl` where it does:

* a **reference model**, sharded like the policy and frozen: its parameter shards
  live through the step (with LoRA there is none: the reference is the policy with
  its adapter off);
* at rollout time, **forwards without gradient**: the reference's (phase
  ``reference``) and, with ``num_iterations > 1``, the policy's own (``old_policy``),
  each computing per-token log-probabilities with the head in chunks;
* the policy's forward computes **per-token log-probabilities and entropies**
  (``token_values``, the head in chunks recomputed in backward) instead of a cross
  entropy, gathers them to whole sequences (a few floats a token) and backpropagates
  a loss of them; then clipping and AdamW, as in training.

``seq_len`` is the prompt and its completion together (one row per micro-batch;
more rollouts are more micro-batches: the same peak). Generation is not planned: it
runs on an unsharded copy of the policy with its KV cache, or in vLLM on other GPUs.
Only transformers' models (``model.implementation = "transformers"``) run under
the GRPO trainer, so only they are planned.

The plan and the search are the planner's own (:func:`~.planner.plan_memory`'s
extrapolation in the layer count and loops at their edge pieces;
:func:`~.search.find_max_seq_len`), given this step to trace.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from ..parallel.fsdp_reset import reset_fsdp
from .disk import Rates
from .planner import _assemble, _combine, _layers_to_trace, _prepare, _Step
from .trace import (
    _fake_world,
    _meshes_outside_fake_mode,
    _private_sharding_prop_fake_mode,
    _Trace,
    _vocab_size,
    edge_loops,
    steady_optimizer,
    step_tracker,
    trace_of,
    traced_model,
)

__all__ = ["GRPOStep", "grpo_plan", "prepare_grpo"]


@dataclass
class GRPOStep(_Step):
    """A GRPO step to plan: :class:`~.planner._Step` with what GRPO adds."""

    reference: bool = True  # beta > 0 (with LoRA: the policy with its adapter off)
    old_policy: bool = False  # num_iterations > 1

    def _trace_cfg(self, cfg) -> _Trace:
        return _trace_grpo_step(cfg, self.world_size, rows=self.traced_rows, micro=self.micro, device=self.device,
                                foreach=self.foreach, edges=self.edges, target=self.target,
                                reference=self.reference, old_policy=self.old_policy)


def prepare_grpo(cfg, world_size, seq_len, *, reference: bool = True, old_policy: bool = False, **kwargs) -> GRPOStep:
    """:func:`~.planner._prepare` for a GRPO step (``reference``: beta > 0; ``old_policy``:
    num_iterations > 1); ConfigError for a model the GRPO trainer does not run."""
    from ..trainer.config import ConfigError
    from ..trainer.hf_model import uses_transformers

    if not uses_transformers(cfg):
        raise ConfigError("the GRPO step is planned for transformers' models (UlyssesGRPOTrainer trains them): set "
                          "model.hf_path and model.implementation = 'transformers'")
    step = _prepare(cfg, world_size, seq_len, **kwargs)
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(_Step)}
    grpo = GRPOStep(**fields, reference=reference, old_policy=old_policy)
    lora = cfg.lora.rank > 0
    what = ("the reference = the policy with its adapter off" if lora else
            "the reference model sharded like the policy (fp32 shards, as TRL loads it in the policy's dtype)")
    grpo.notes.insert(0, "GRPO step (UlyssesGRPOTrainer): " + (
        f"{what}, its forward at rollout time; " if reference else "no reference (beta = 0); ")
        + ("the old policy's forward at rollout time (num_iterations > 1); " if old_policy else "")
        + "the policy's per-token log-probabilities and entropies, the head in chunks; seq_len = prompt + "
          "completion; generation not planned (an unsharded copy of the policy and its KV cache, or vLLM)")
    return grpo


def grpo_plan(cfg, world_size=None, seq_len=None, *, rows=None, device="cuda", layers="auto", foreach=None,
              loops="edges", target=None, reference=True, old_policy=False, disk_gbps=None, achieved_tflops=None):
    """:func:`~.planner.plan_memory` of a GRPO step (see the module doc)."""
    step = prepare_grpo(cfg, world_size, seq_len, reference=reference, old_policy=old_policy, rows=rows,
                        device=device, foreach=foreach, edges=loops == "edges", target=target,
                        rates=Rates.of(achieved_tflops, disk_gbps))
    return _assemble(step, *_combine(step, {}, _layers_to_trace(step, layers)))


def _reference_config(cfg):
    """The reference model's build: frozen, forward only (no checkpointing, nothing offloaded)."""
    ref = copy.deepcopy(cfg)
    ref.activation_checkpoint.mode = "none"
    ref.activation_checkpoint.save_attention = False
    ref.memory.offload_activations = False
    return ref


def _token_values(model, sp_mesh, batch: dict, fields: tuple, chunks, vocab: int, router: bool):
    """What the GRPO trainer computes of a model (:class:`~ulysses_dtensor.integrations.trl.sp_logprobs.SPLogProbs`):
    per-token values gathered to whole sequences, and the router loss share (or None)."""
    from ..parallel.sequence_values import sp_gather_tokens
    from ..memory.token_logprobs import chunked_token_stats

    labels = batch["labels"]

    def values(hidden, head):
        return chunked_token_stats(hidden, head, labels, fields, chunks=chunks, vocab=vocab)

    local, share = model(batch["input_ids"], position_ids=batch["position_ids"], token_values=values,
                         router_aux=router)
    stacked = torch.stack([local[f].float() for f in fields], dim=-1)
    return sp_gather_tokens(stacked, sp_mesh, None), share


def _trace_grpo_step(cfg, world_size: int, *, rows: int, micro: int, device: str, foreach: bool, edges: bool,
                     target, reference: bool, old_policy: bool) -> _Trace:
    """One GRPO step on rank 0 of a fake world (as :func:`~.trace._trace_step` a training step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..attention.planning import PlannedKernelError, planning_for
    from ..models.llama_parallelize import clip_grad_norm_
    from ..trainer.config import ConfigError, model_args, validate_config
    from ..trainer.step import build_optimizer

    dims = validate_config(cfg, world_size, weights=False)
    vocab = _vocab_size(cfg)
    args = model_args(cfg, vocab)
    if cfg.model.n_layers:
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    s_local = cfg.training.seq_len // dims.sp
    mem = cfg.memory
    chunks = (mem.loss_chunks or None) if mem.tiled_loss else 1
    t0 = time.perf_counter()
    try:
        with _fake_world(world_size), planning_for(target) as attention:
            pmesh = dims.build_mesh("cpu")
            with FakeTensorMode(allow_non_fake_inputs=True), _private_sharding_prop_fake_mode(), \
                    _meshes_outside_fake_mode():
                model = traced_model(cfg, pmesh, vocab, args, device)
                ref = None
                if reference and cfg.lora.rank == 0:
                    ref = traced_model(_reference_config(cfg), pmesh, vocab, args, device).requires_grad_(False)
                router = getattr(model, "_router_aux", None) is not None
                if router:
                    edges = False  # transformers records each MoE tile's router logits through hooks
                optimizer = steady_optimizer(build_optimizer(cfg, model, foreach=foreach), model)
                params = [p for p in model.parameters() if p.requires_grad]
                batch = {"input_ids": torch.zeros(rows, s_local, dtype=torch.long),
                         "labels": torch.zeros(rows, s_local, dtype=torch.long),
                         "position_ids": torch.arange(s_local).repeat(rows, 1)}
                # The tracker follows one FSDP tree (the policy); what the reference runs is
                # allocated under it and counted, its shards (made before) are added below. FSDP2
                # re-creates a tree's shards at its first forward: done here, out of the tracker's sight.
                ref_shards = 0
                if ref is not None:
                    ref._get_fsdp_state()._lazy_init()
                    ref_shards = sum(_local_bytes(t) for t in (*ref.parameters(), *ref.buffers()))
                tracker = step_tracker(model, optimizer, cfg, args, vocab, dims, device)
                tracker.track_inputs((batch["input_ids"], batch["labels"], batch["position_ids"]))
                with tracker, edge_loops(edges):
                    _grpo_step(model, ref, pmesh.sp, optimizer, params, batch, micro, reference, old_policy, chunks,
                               vocab, router, cfg, tracker.set_phase, clip_grad_norm_)
                del model, ref, optimizer, params, batch
    except PlannedKernelError as e:
        raise ConfigError(f"model.attn_backend={cfg.model.attn_backend!r}: {e}") from None
    trace = trace_of(tracker, args.n_layers, time.perf_counter() - t0, edges, attention)
    return _with_reference_shards(trace, ref_shards, on_host=mem.offload_params and device == "cuda")


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _with_reference_shards(trace: _Trace, nbytes: int, *, on_host: bool) -> _Trace:
    """``trace`` with the reference model's parameter shards held through every phase:
    on the device as sharded parameters, or with ``offload_params`` in host memory."""
    if not nbytes:
        return trace
    if on_host:
        trace.host_phase_peaks = {ph: b + nbytes for ph, b in trace.host_phase_peaks.items()}
        trace.host_peak += nbytes
        trace.host_fixed += nbytes
        return trace
    for peak in trace.phase_peaks.values():
        peak["total"] += nbytes
        peak["cats"]["Sharded Param"] = peak["cats"].get("Sharded Param", 0) + nbytes
    for cats in trace.boundaries.values():
        for key in ("Total", "Sharded Param"):
            cats[key] = cats.get(key, 0) + nbytes
    return trace


def _grpo_step(model, ref, sp_mesh, optimizer, params, batch, micro, reference, old_policy, chunks, vocab, router,
               cfg, phase, clip):
    """Rollout-time forwards without gradient, then the policy's forward and backward per
    micro-batch, clipping and AdamW: what UlyssesGRPOTrainer runs, in its order."""
    n = batch["input_ids"].shape[0]
    pieces = [{k: v[i:i + micro] for k, v in batch.items()} for i in range(0, n, micro)]
    with torch.no_grad():
        for piece in pieces:
            if reference:
                phase("reference")
                _token_values(ref if ref is not None else model, sp_mesh, piece, ("log_probs",), chunks, vocab, False)
                reset_fsdp(ref if ref is not None else model)
            if old_policy:
                phase("old_policy")
                _token_values(model, sp_mesh, piece, ("log_probs",), chunks, vocab, False)
                reset_fsdp(model)
    for piece in pieces:
        phase("forward")
        whole, share = _token_values(model, sp_mesh, piece, ("log_probs", "entropy"), chunks, vocab, router)
        loss = whole.sum() / max(1, whole.numel()) + (0.0 if share is None else share)
        phase("backward")
        loss.backward()
        del loss, whole
    phase("clip")
    clip(params, max_norm=cfg.training.max_norm or math.inf)
    phase("optimizer")
    optimizer.step()
    phase("zero_grad")
    optimizer.zero_grad(set_to_none=True)
