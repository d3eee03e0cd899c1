"""The unsharded reference for packed rows: each document run alone through a
transformers model, next-token targets only inside documents."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[a, b) of each packed document of one row (a document starts where its position is 0)."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    starts = ([0] if not starts or starts[0] else []) + starts + [len(position_ids)]
    return list(zip(starts[:-1], starts[1:]))


def packed_documents_loss(model, batch: dict) -> torch.Tensor:
    """Token-mean cross-entropy over every row's documents, each forwarded alone."""
    total, count = 0.0, 0
    for ids, pos in zip(batch["input_ids"], batch["position_ids"]):
        for a, b in document_spans(pos):
            if b - a < 2:
                continue
            logits = model(ids[None, a:b], position_ids=pos[None, a:b]).logits[0]
            total = total + F.cross_entropy(logits[:-1].float(), ids[a + 1:b], reduction="sum")
            count += b - a - 1
    return total / count


def trainer_adamw(model, cfg, lr: float) -> torch.optim.AdamW:
    """AdamW with the trainer's settings of ``cfg`` (its optimizer section)."""
    opt = cfg.optimizer
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(opt.betas), eps=opt.eps,
                             weight_decay=opt.weight_decay)


def builtin_corpus_loader(cfg):
    """The trainer's global batches over the built-in corpus (byte tokenizer), and its schedule."""
    from ulysses_dtensor.data import PackedLoader, TokenStream, build_source, build_tokenizer

    stream = TokenStream(build_source("", cfg.data.text_key, cfg.data.max_corpus_mb), build_tokenizer("byte"),
                         seed=cfg.job.seed, shuffle=cfg.data.shuffle)
    return PackedLoader(stream), cfg.context_schedule()


def reference_step(model, adamw, batch: dict, max_norm: float) -> dict:
    """One training step as the trainer takes it: the packed-documents loss, backward,
    gradient clipping, AdamW. Returns the step's loss and gradient norm (before clipping)."""
    loss = packed_documents_loss(model, batch)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    adamw.step()
    adamw.zero_grad()
    return {"loss": loss.item(), "grad_norm": norm.item()}


def trainer_jobs(rank: int, world: int, jobs) -> None:
    """Rank task: trainer runs one after another, each ``(argv, seed)``; a ``seed``
    ``(src, dst)`` is a checkpoint folder rank 0 copies in before that run starts."""
    import shutil

    import torch.distributed as dist

    from ulysses_dtensor.trainer.config import load_config
    from ulysses_dtensor.trainer.loop import train

    for argv, seed in jobs:
        if seed is not None:
            if rank == 0:
                shutil.copytree(*seed)
            dist.barrier()
        train(load_config(argv))
