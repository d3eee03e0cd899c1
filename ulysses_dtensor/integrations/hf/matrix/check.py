"""Does a transformers family run under Ulysses as it runs alone? Measured on a tiny model.

One comparison, used by the family matrix (every family, in CI) and by the check
at start for a family the matrix has not measured (:mod:`~ulysses_dtensor.integrations.hf.families`): a tiny
model is built twice from one seed; transformers' own copy, unsharded, runs a
packed batch one document at a time (so nothing can cross a document, whatever
its own masking does); the other copy goes through
:func:`~.hf.parallelize_hf_model` (passed in by the caller) on the mesh and runs the same global batch
sharded. fp32, packed documents, a length sp does not divide (every rank pads),
one ignored target per row; the loss plus, for an MoE family with transformers'
load-balancing loss, ``router_aux_loss_coef x`` that loss. Passing means the loss
within :data:`LOSS_RTOL` and EVERY parameter's gradient within
:data:`GRAD_RTOL` (relative error of the norm).

The reference is the same on every rank (same seed, same batch), so callers
with many families compute each once and share it (:func:`reference` and
:func:`run_sharded` are separate for that).
"""

from __future__ import annotations

import copy
import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from ulysses_dtensor.parallel.comm_stats import CollectiveCounter
from ulysses_dtensor.parallel.loss import (
    IGNORE_INDEX,
    count_valid_tokens,
    global_loss,
    sp_cross_entropy,
)

__all__ = [
    "GRAD_RTOL",
    "LOSS_RTOL",
    "Parity",
    "compare",
    "measure",
    "packed_batch",
    "reference",
    "router_loss",
    "run_sharded",
]

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
# Gradients smaller than this fraction of the model's largest are compared at that scale.
GRAD_FLOOR = 1e-3
# Document starts of the rows of a packed batch (cycled over rows): restarts mid-row,
# the shortest document (5 tokens) longer than the matrix's window of 4.
DOC_STARTS = ((0, 11, 23), (0, 5, 17))


@dataclass
class Parity:
    """One family on one mesh against its unsharded self."""

    loss_rel: float
    grad_rel: float
    worst: str  # the parameter with the largest gradient error
    forward: dict = field(default_factory=dict)  # collectives of one forward, by op
    patterns: list = field(default_factory=list)  # what the layers passed to attention
    router: bool = False  # the router load-balancing loss was part of the loss

    @property
    def ok(self) -> bool:
        return self.loss_rel <= LOSS_RTOL and self.grad_rel <= GRAD_RTOL

    def summary(self) -> str:
        return (f"loss rel. err. {self.loss_rel:.1e} (<= {LOSS_RTOL:g}), worst gradient rel. err. "
                f"{self.grad_rel:.1e} (<= {GRAD_RTOL:g}, {self.worst})")


def packed_batch(rows: int, seq: int, vocab: int, seed: int = 7) -> dict[str, Tensor]:
    """``rows`` rows of ``seq`` tokens, packed documents (:data:`DOC_STARTS`), position ids
    restarting per document, labels = inputs with one ignored target per row."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.zeros(rows, seq, dtype=torch.long)
    for r in range(rows):
        starts = [s for s in DOC_STARTS[r % len(DOC_STARTS)] if s < seq]
        for a, b in zip(starts, starts[1:] + [seq]):
            pos[r, a:b] = torch.arange(b - a)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, 3] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _documents(batch) -> list[tuple[int, int, int]]:
    out = []
    for r, row in enumerate(batch["position_ids"].tolist()):
        starts = [t for t, p in enumerate(row) if p == 0] + [len(row)]
        out += [(r, a, b) for a, b in zip(starts, starts[1:])]
    return out


def _transformers_class(model: nn.Module) -> type:
    return next(c for c in type(model).__mro__ if c.__module__.startswith("transformers.models."))


def router_loss(model: nn.Module) -> Callable | None:
    """transformers' own load-balancing loss of the model's family when the model computes one
    (``router_aux_loss_coef``, ``num_experts``, ``num_experts_per_tok`` and the module's
    ``load_balancing_loss_func``), else None."""
    if not all(hasattr(model, a) for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")):
        return None
    if not getattr(model.config.get_text_config(), "router_aux_loss_coef", None):
        return None
    return getattr(importlib.import_module(_transformers_class(model).__module__), "load_balancing_loss_func", None)


def reference(model: nn.Module, batch: dict, router: bool) -> tuple[float, dict[str, Tensor], bool]:
    """transformers' unsharded model, each document alone: the token-mean loss (+ the router
    loss over every document's router logits, as one unsharded forward), every gradient, and
    whether the router loss was part of it (``router``, unless the model returns no router
    logits: a dense configuration of an MoE-capable family)."""
    docs = _documents(batch)
    device = next(model.parameters()).device
    total, logits_per_doc = 0.0, []
    for r, a, b in docs:
        kwargs = {"output_router_logits": True} if router else {}
        out = model(input_ids=batch["input_ids"][r:r + 1, a:b].to(device), use_cache=False, **kwargs)
        target = batch["labels"][r, a + 1:b].to(device)
        total = total + F.cross_entropy(out.logits[0, :-1].float(), target, ignore_index=IGNORE_INDEX,
                                        reduction="sum")
        router = router and bool(getattr(out, "router_logits", None))
        if router:
            logits_per_doc.append(out.router_logits)
    count = sum(int((batch["labels"][r, a + 1:b] != IGNORE_INDEX).sum()) for r, a, b in docs)
    loss = total / count
    if router:
        per_layer = tuple(torch.cat(layer) for layer in zip(*logits_per_doc))
        aux = router_loss(model)(per_layer, model.num_experts, model.num_experts_per_tok)
        loss = loss + model.router_aux_loss_coef * aux
    loss.backward()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()).cpu()
             for n, p in model.named_parameters()}
    return loss.item(), grads, router


def run_sharded(model: nn.Module, pmesh, batch: dict, router: bool, ref_grads: dict, *,
                parallelize: Callable, **options) -> tuple[float, dict, dict, list]:
    """``model`` through ``parallelize(model, pmesh, **options)`` (the integration's
    :func:`~.hf.parallelize_hf_model`, passed in: it calls this check itself), this rank's share of
    ``batch`` (rows split over dp, sequence over sp): (global loss, per parameter the squared
    norm of (gradient - reference gradient) over all its shards (None: no gradient), collectives
    of the forward, patterns the layers passed). Each rank compares its own shard with the
    same slice of the reference and one all-reduce sums them: no gradient is gathered."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from ..attention_function import recording_patterns
    from ..model_inputs import shard_hf_batch

    parallelize(model, pmesh, **options)
    rows = batch["input_ids"].shape[0] // pmesh.dims.dp
    mine = slice(pmesh.dp_rank * rows, (pmesh.dp_rank + 1) * rows)
    device = next(model.parameters()).device
    inputs, labels = shard_hf_batch({k: v[mine].to(device) for k, v in batch.items()}, pmesh.sp)
    n = count_valid_tokens(labels, pmesh.loss)
    kwargs = {"output_router_logits": True} if router else {}
    with CollectiveCounter() as fwd, recording_patterns() as seen:
        out = model(**inputs, **kwargs)
    loss = sp_cross_entropy(out.logits, labels, num_valid_tokens=n)
    if router:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    loss.backward()
    names, sums, missing = [], [], []
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        want = ref_grads.get(name)
        if p.grad is None or want is None:
            missing.append(name)
            continue
        shape, offset = compute_local_shape_and_global_offset(want.shape, p.grad.device_mesh, p.grad.placements)
        want = want[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(device)
        names.append(name)
        sums.append((p.grad.to_local().float() - want.float()).pow(2).sum())
    diffs = torch.stack(sums) if sums else torch.zeros(0, device=device)
    if pmesh.fsdp.size() > 1 and sums:  # shards over dp_shard x sp (HSDP replicas hold the same)
        diffs = funcol.wait_tensor(funcol.all_reduce(diffs, "sum", pmesh.fsdp.get_group()))
    squared: dict = {name: d for name, d in zip(names, diffs.cpu().tolist())}
    squared.update({name: None for name in missing})
    return global_loss(loss.detach(), pmesh.loss).item(), squared, fwd.counts(), sorted(seen)


def compare(loss: float, squared: dict, ref_loss: float, ref_grads: dict) -> tuple[float, float, str]:
    """(loss rel. err., worst gradient rel. err., its parameter) from :func:`run_sharded`'s
    squared differences. A parameter missing on either side, or without a gradient where
    the reference has one, counts as error 1; NaN as infinite.

    A gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of
    every score of a row) is rounding noise in both runs; its error is taken relative to
    :data:`GRAD_FLOOR` times the largest gradient norm of the model, not to the noise."""
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    if loss_rel != loss_rel:
        loss_rel = float("inf")
    floor = GRAD_FLOOR * max([g.norm().item() for g in ref_grads.values()] + [0.0])
    worst, worst_name = 0.0, ""
    for name in sorted(set(ref_grads) | set(squared)):
        want, diff = ref_grads.get(name), squared.get(name, float("nan"))
        if want is None:
            rel = 1.0
        elif diff is None:
            rel = 1.0 if bool(want.any()) else 0.0
        elif diff != diff:
            rel = float("inf")
        else:
            rel = math.sqrt(diff) / max(want.norm().item(), floor, 1e-30)
        if rel > worst:
            worst, worst_name = rel, name
    return loss_rel, worst, worst_name


def measure(build: Callable[[], nn.Module], pmesh, *, parallelize: Callable, rows: int | None = None,
            seq: int = 29, device: torch.device | str = "cpu", **options) -> Parity:
    """Build the tiny model, run it unsharded (each document alone) and through
    ``parallelize(..., **options)`` on ``pmesh``; compare. ``rows`` defaults to
    one per data-parallel rank; ``seq`` should be one sp does not divide."""
    rows = rows or max(2, pmesh.dims.dp)
    ref_model = build().to(device)
    model = copy.deepcopy(ref_model)
    batch = packed_batch(rows, seq, ref_model.config.get_text_config().vocab_size)
    ref_loss, ref_grads, router = reference(ref_model, batch, router_loss(ref_model) is not None)
    loss, squared, counts, patterns = run_sharded(model, pmesh, batch, router, ref_grads,
                                                  parallelize=parallelize, **options)
    return Parity(*compare(loss, squared, ref_loss, ref_grads), counts, patterns, router)


def _fake_group(pmesh) -> bool:
    import torch.distributed as dist

    return dist.get_backend(pmesh.loss.get_group()) == "fake"


def verify_at_start(model: nn.Module, pmesh, model_type: str, why: str, *, parallelize: Callable, **options):
    """The check at start of a family the matrix has not measured: a tiny model of ``model``'s
    own (text) config class, shrunk from ``model``'s config, measured as in the matrix on
    ``pmesh``'s own ranks and device, through ``parallelize`` (the caller itself).
    Returns the :class:`~ulysses_dtensor.integrations.hf.matrix.results.FamilyStatus`
    (``verified at start``); raises ValueError with the measured difference, or when no tiny
    model of the class can be built."""
    from transformers import AutoModelForCausalLM

    from .results import FamilyStatus
    from .tiny_configs import OVERRIDES, shrink_config, tiny_model

    name = type(model).__name__
    if _fake_group(pmesh):  # memory planning on fake ranks: nothing to measure
        return FamilyStatus(model_type, "unverified", f"{why}; not checked on a fake process group")
    text = model.config.get_text_config()
    tiny, error = None, None
    for overrides in ({}, getattr(OVERRIDES.get(text.model_type), "values", {})):
        try:
            config = shrink_config(text, **overrides)
            AutoModelForCausalLM._model_mapping[type(config)]  # a causal LM class for it
            tiny = config
            break
        except Exception as e:  # noqa: BLE001 - reported below
            error = e
    if tiny is None:
        raise ValueError(
            f"{name} (model_type={model_type!r}): {why}, and no tiny model of {type(text).__name__} could be built "
            f"to check it at start ({type(error).__name__}: {error}); allow_untested=True runs it unchecked")
    device = torch.device(pmesh.mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 here
    try:
        sp = pmesh.dims.sp
        parity = measure(lambda: tiny_model(tiny), pmesh, parallelize=parallelize,
                         seq=29 if sp < 29 else 2 * sp + 1, device=device, allow_untested=True, **options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} (model_type={model_type!r}): {why}; checked at start, refused: {e}") from None
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if not parity.ok:
        raise ValueError(
            f"{name} (model_type={model_type!r}): {why}; checked at start on this mesh, a tiny "
            f"{type(tiny).__name__} model under Ulysses SP differs from transformers' own: {parity.summary()}. "
            "allow_untested=True runs it anyway")
    return FamilyStatus(model_type, "verified", f"verified at start ({why}): {parity.summary()}")
