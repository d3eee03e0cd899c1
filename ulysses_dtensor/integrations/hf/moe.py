"""MoE router load-balancing loss under sequence parallelism.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE, gpt-oss, ...)
is, over every routed token t of the forward call and every layer,

    aux = E * sum_e (C_e / R) * (P_e / R)

with C_e the top-k assignments to expert e, P_e the sum of the softmax router
probabilities of e, R the number of (token, layer) rows. Under SP a rank sees
S/sp tokens of its rows (and padding), so the model's own value is that of a
slice. C and R carry no gradient, so with C and R summed over every rank the
loss is linear in each rank's P:

    aux = sum_r share_r,   share_r = E * sum_e C_e * P_e^(r) / R^2

Each rank's ``share_r`` is to ``aux`` what ``sp_cross_entropy``'s share is to
the token mean: summed over ranks (as gradients are) it is the unsharded
model's value over the whole global batch, gradients included. Padding tokens
(``shard_hf_batch`` pads to a multiple of sp) are not routed tokens of the
unsharded model and are left out. One all-reduce of E + 1 floats per forward.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["install_router_aux_loss", "router_aux_loss_share"]


def router_aux_loss_share(
    router_logits: tuple[Tensor, ...],
    num_experts: int,
    top_k: int,
    mesh: DeviceMesh | None,
    valid: Tensor | None = None,
) -> Tensor:
    """This rank's share of the load-balancing loss of the whole global batch.

    router_logits: per layer, (local tokens, num_experts) as transformers returns
    them (``output_router_logits=True``), or per layer several consecutive runs
    of those rows (a tiled MoE block routes tile by tile, in row order); valid:
    (local tokens,) bool, False for padding; mesh: every rank that holds tokens
    of the batch (``pmesh.loss``; None: one process).
    """
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    weight = None if valid is None else valid.to(device=device, dtype=torch.float32)
    rows, offset = 0.0, 0  # offset: where in a layer's rows the next entry starts
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1).float()
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        n = probs.shape[0]
        if weight is None:
            w = torch.ones(n, device=device)
        else:
            if offset + n > weight.shape[0]:
                raise ValueError(f"router logits of {n} rows at row {offset} of a layer of {weight.shape[0]} "
                                 "rows: not the rows of this call")
            w = weight[offset : offset + n]
            offset = (offset + n) % weight.shape[0]
        counts = counts.index_add(0, chosen, w.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    stats = torch.cat([counts, torch.as_tensor(rows, dtype=torch.float32, device=device).view(1)]).detach()
    if mesh is not None and mesh.size() > 1:
        stats = funcol.wait_tensor(funcol.all_reduce(stats, "sum", mesh.get_group()))
    counts, rows = stats[:num_experts], stats[num_experts]
    return num_experts * (counts * probs_sum).sum() / (rows * rows)


def install_router_aux_loss(model: nn.Module, mesh: DeviceMesh, local_valid) -> bool:
    """Make ``output_router_logits=True`` calls return this rank's share as
    ``aux_loss`` (and fold it into ``loss`` where transformers did). Returns
    whether the model has a router loss to fix.

    local_valid: called per forward with the local logits' batch and sequence
    sizes, returns the (tokens,) validity mask or None.
    """
    if not all(hasattr(model, a) for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")):
        return False

    def hook(module, args, kwargs, out):
        local = getattr(out, "aux_loss", None)
        logits = getattr(out, "router_logits", None)
        if local is None or not logits:
            return out
        batch, seq = out.logits.shape[:2]
        share = router_aux_loss_share(
            tuple(logits), module.num_experts, module.num_experts_per_tok, mesh, local_valid(batch, seq)
        )
        if getattr(out, "loss", None) is not None:
            # transformers added coef * (this slice's own value); swap in the share.
            out.loss = out.loss + module.router_aux_loss_coef * (share - local)
        out.aux_loss = share
        return out

    model.register_forward_hook(hook, with_kwargs=True)
    return True
