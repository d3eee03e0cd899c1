"""The evaluation itself: forward passes under the training mesh, one reduction.

For each eval length the work is a list of sequences of exactly that length:
``loss_rows`` rows of held-out documents (packed like training data, positions
restarting at each document) and one prompt per (retrieval task, depth,
sample). Data-parallel rank ``r`` takes items ``r, r + dp, ...`` (the list is
padded with repeats to a multiple of dp, so every rank runs the same number of
forward passes: FSDP and the all-to-alls are collective); the sp ranks of a
group share each item. Each item goes through :func:`~ulysses_dtensor.parallel.batch.shard_batch`
(labels shifted on the full sequence, then sliced; lengths that sp does not
divide are padded with ignored labels) and the model's ``hidden_states``, with
the attention backend, tiling, activation checkpointing, compile and FSDP of
the training model: evaluation at the trained length needs no more memory than
training at it (no gradients, no saved activations; logits exist a chunk at a
time).

Where the tokens are, the statistics are made: each rank adds its positions'
losses to the position buckets, and its answer positions' (argmax correct,
log-probability) to the per-sample sums. Every number lands in one float64
tensor that is all-reduced once over all ranks at the end of the run; the
results are therefore the same on any mesh.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..data import DocumentSource, TokenStream
from ..memory.tiling import auto_loss_chunks
from ..parallel import fsdp_reset
from ..parallel.batch import shard_batch
from ..parallel.loss import IGNORE_INDEX
from .position_loss import BucketSums, bucket_edges
from .scoring import token_stats
from .tasks import RETRIEVAL_TASKS, TASKS, SampleGenerator, depth_grid

__all__ = ["EvalSpec", "EvalResult", "Evaluator"]


@dataclass
class EvalSpec:
    """What to evaluate (the trainer's ``[eval]`` section)."""

    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    depths: int = 10
    samples: int = 1
    loss_rows: int = 4
    seed: int = 1234
    loss_chunks: int | None = None  # output projection chunks (None: from the shapes)

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"eval tasks {self.tasks} must be a non-empty subset of {', '.join(TASKS)}")
        for name in ("depths", "samples", "loss_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")

    @property
    def retrieval_tasks(self) -> list[str]:
        return [t for t in self.tasks if t in RETRIEVAL_TASKS]


@dataclass
class EvalResult:
    step: int
    rows: list[dict]
    seconds: float
    forward_passes: int  # per rank

    def of_kind(self, kind: str) -> list[dict]:
        return [r for r in self.rows if r["kind"] == kind]


@dataclass
class _Item:
    length: int
    kind: str  # "loss" or a retrieval task
    index: int  # loss row, or sample slot in the retrieval stats
    depth: float = 0.0
    sample: int = 0


class Evaluator:
    """Runs :class:`EvalSpec` on a (parallelized) Llama under its mesh.

    Args:
        model: a :class:`~ulysses_dtensor.models.llama.Llama`, plain or as
            ``parallelize_llama`` returns it.
        pmesh: its :class:`~ulysses_dtensor.parallel.mesh.ParallelMesh` (None: one process).
        tokenizer: the tokenizer the model was trained with.
        held_out: documents for the position-bucket loss (needed with task ``loss``).
    """

    def __init__(self, model: nn.Module, pmesh, tokenizer, spec: EvalSpec, device: torch.device,
                 held_out: DocumentSource | None = None):
        if "loss" in spec.tasks and held_out is None:
            raise ValueError("eval task 'loss' needs held-out documents (eval.data_path or "
                             "eval.holdout_fraction)")
        self.model = model
        self.pmesh = pmesh
        self.tokenizer = tokenizer
        self.spec = spec
        self.device = torch.device(device)
        self.held_out = held_out
        self.generator = SampleGenerator(tokenizer, spec.seed)

    # ------------------------------------------------------------ mesh
    @property
    def _dp(self) -> tuple[int, int]:
        if self.pmesh is None:
            return 0, 1
        return self.pmesh.dp_rank, self.pmesh.dims.dp

    def _sp(self) -> tuple[int, int, int]:
        """(sp rank, sp size, ring degree): ring > 1 lays the sequence out in mirrored chunks."""
        if self.pmesh is None:
            return 0, 1, 1
        return self.pmesh.sp_rank, self.pmesh.dims.sp, self.pmesh.dims.ring

    # ------------------------------------------------------------ work
    def _items(self, length: int, slot0: int) -> list[_Item]:
        items = [_Item(length, "loss", r) for r in range(self.spec.loss_rows)] if "loss" in self.spec.tasks else []
        slot = slot0
        for task in self.spec.retrieval_tasks:
            for depth in depth_grid(self.spec.depths):
                for s in range(self.spec.samples):
                    items.append(_Item(length, task, slot, depth, s))
                    slot += 1
        return items

    def _loss_rows(self, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The first ``loss_rows`` rows of ``length`` tokens of the held-out documents,
        in their listed order (the same rows at every evaluation), and their labels
        when the documents have target flags (SFT data: the loss is over the same
        target tokens as training's), else None."""
        stream = TokenStream(self.held_out, self.tokenizer, seed=self.spec.seed, shuffle=False)
        if stream.has_targets:
            rows = [stream.read(r * length, length) for r in range(self.spec.loss_rows)]
            labels = np.stack([np.where(t != 0, ids, IGNORE_INDEX) for ids, _, t in rows])
        else:
            rows, labels = [stream.take(length) for _ in range(self.spec.loss_rows)], None
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), labels

    def run(self, step: int, lengths: list[int]) -> EvalResult:
        """Evaluate at every length of ``lengths``; every rank returns the same result."""
        t0 = time.perf_counter()
        dp_rank, dp = self._dp
        edges = {L: bucket_edges(L) for L in lengths}
        buckets = {L: BucketSums(edges[L], self.device) for L in lengths}
        per_length = {L: self._items(L, 0) for L in lengths}
        n_slots = {L: sum(1 for it in per_length[L] if it.kind != "loss") for L in lengths}
        offsets, total = {}, 0
        for L in lengths:
            offsets[L], total = total, total + n_slots[L]
        # (correct answer tokens, summed log-probability) per sample
        answer_stats = torch.zeros(total, 2, dtype=torch.float64, device=self.device)

        passes = 0
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for L in lengths:
                    items = per_length[L]
                    loss_ids = self._loss_rows(L) if "loss" in self.spec.tasks else None
                    padded = items + [items[i % len(items)] for i in range(-len(items) % dp)]
                    for i in range(dp_rank, len(padded), dp):
                        item = padded[i]
                        counted = i < len(items)  # a padding repeat runs, but is not counted
                        if item.kind == "loss":
                            ids, pos, lab = (None if a is None else torch.from_numpy(a[item.index:item.index + 1])
                                             for a in loss_ids)
                            self._loss_pass(ids, pos, buckets[L] if counted else None, lab)
                        else:
                            sample = self.generator.sample(item.kind, L, item.depth, item.sample)
                            stats = self._answer_pass(sample)
                            if counted:
                                answer_stats[offsets[L] + item.index] += stats
                        passes += 1
        finally:
            self.model.train(was_training)
            fsdp_reset.reset_fsdp(self.model)  # no backward follows: FSDP2 as a step expects it

        packed = torch.cat([*(buckets[L].pack() for L in lengths), answer_stats.reshape(-1)])
        if self.pmesh is not None and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed, group=self.pmesh.loss.get_group())  # the one reduction
        rows = self._rows(step, lengths, packed, buckets, per_length, offsets)
        seconds = time.perf_counter() - t0
        rows.append({"kind": "eval", "step": step, "lengths": list(lengths), "tasks": list(self.spec.tasks),
                     "forward_passes_per_rank": passes, "seconds": seconds, **self._mesh_info()})
        return EvalResult(step, rows, seconds, passes)

    # ------------------------------------------------------------ passes
    def _hidden(self, ids: Tensor, pos: Tensor, labels: Tensor | None = None) -> tuple[Tensor, dict]:
        sp_rank, sp, ring = self._sp()
        batch = {"input_ids": ids, "position_ids": pos}
        if labels is not None:
            batch["labels"] = labels
        local = shard_batch(batch, sp_rank=sp_rank, sp_size=sp, ring=ring)
        local = {k: None if v is None else v.to(self.device) for k, v in local.items()}
        h = self.model.hidden_states(local["input_ids"], position_ids=local["position_ids"],
                                     document_ids=local["document_ids"])
        return h, local

    def _logits(self, h: Tensor) -> Tensor:
        return self.model.output(h).float()

    def _loss_pass(self, ids: Tensor, pos: Tensor, sums: BucketSums | None, labels: Tensor | None = None) -> None:
        h, local = self._hidden(ids, pos, labels)
        labels, positions = local["labels"][0], local["position_ids"][0]
        h = h[0]
        vocab = self.model.output.weight.shape[0]
        n = self.spec.loss_chunks or auto_loss_chunks(h.shape[0], vocab)
        for idx in torch.arange(h.shape[0], device=h.device).tensor_split(min(n, h.shape[0])):
            if idx.numel() == 0:
                continue
            lab = labels[idx]
            valid = lab != IGNORE_INDEX
            nll = F.cross_entropy(self._logits(h[idx]), lab, ignore_index=IGNORE_INDEX, reduction="none")
            if sums is not None:
                sums.add(nll[valid], positions[idx][valid])

    def _answer_pass(self, sample) -> Tensor:
        """(correct answer tokens, summed log-probability) over this rank's answer positions."""
        ids = torch.from_numpy(sample.tokens)[None]
        pos = torch.arange(sample.length)[None]
        h, local = self._hidden(ids, pos)
        # Label position t predicts token t + 1: the answer is predicted at
        # answer_start - 1 ... length - 2 (global positions; one document, so the
        # position ids are those positions, in whatever order the ring laid them out).
        glob = local["position_ids"][0]
        mine = (glob >= sample.answer_start - 1) & (glob <= sample.length - 2)
        # Every rank calls the output projection, with or without answer positions:
        # FSDP records each forward call, and ranks must make the same calls.
        correct, logprob = token_stats(self._logits(h[0][mine]), local["labels"][0][mine])
        return torch.stack([correct.sum().double(), logprob.sum()])

    # ------------------------------------------------------------ results
    def _mesh_info(self) -> dict:
        if self.pmesh is None:
            return {"mesh": {"dp_replicate": 1, "dp_shard": 1, "sp": 1, "ring": 1}}
        d = self.pmesh.dims
        return {"mesh": {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "sp": d.sp, "ring": d.ring}}

    def _rows(self, step, lengths, packed, buckets, per_length, offsets) -> list[dict]:
        rows: list[dict] = []
        at = 0
        for L in lengths:
            n = 2 * (len(buckets[L].edges) - 1)
            if "loss" in self.spec.tasks:
                per_bucket = buckets[L].rows(packed[at:at + n])
                tokens = sum(b["tokens"] for b in per_bucket)
                total = float(packed[at:at + n // 2].sum())
                rows += [{"kind": "position_loss", "step": step, "length": L, **b} for b in per_bucket]
                rows.append({"kind": "loss", "step": step, "length": L, "rows": self.spec.loss_rows,
                             "tokens": tokens, "loss": total / tokens if tokens else None})
            at += n
        stats = packed[at:].reshape(-1, 2)
        for L in lengths:
            by_cell: dict[tuple[str, float], list] = {}
            for it in per_length[L]:
                if it.kind == "loss":
                    continue
                sample = self.generator.sample(it.kind, L, it.depth, it.sample)
                correct_tokens, logprob = stats[offsets[L] + it.index].tolist()
                by_cell.setdefault((it.kind, it.depth), []).append(
                    (sample, int(round(correct_tokens)) == sample.answer_len, logprob / sample.answer_len))
            for task in self.spec.retrieval_tasks:
                cells = [(d, by_cell[(task, d)]) for d in depth_grid(self.spec.depths)]
                for depth, results in cells:
                    rows.append({
                        "kind": "retrieval", "step": step, "task": task, "length": L, "depth": depth,
                        "samples": len(results),
                        "accuracy": sum(ok for _, ok, _ in results) / len(results),
                        "mean_logprob": sum(lp for _, _, lp in results) / len(results),
                        "correct": [ok for _, ok, _ in results],
                        "needle_index": [s.needle_index for s, _, _ in results],
                        "answer": [s.answer for s, _, _ in results],
                        "answer_tokens": [s.answer_len for s, _, _ in results],
                    })
                flat = [r for _, res in cells for r in res]
                rows.append({"kind": "retrieval_mean", "step": step, "task": task, "length": L,
                             "samples": len(flat), "accuracy": sum(ok for _, ok, _ in flat) / len(flat),
                             "mean_logprob": sum(lp for _, _, lp in flat) / len(flat)})
        return rows


def spec_from(section, **overrides) -> EvalSpec:
    """An :class:`EvalSpec` from a config section with the same field names."""
    names = {f.name for f in dataclasses.fields(EvalSpec)}
    values = {k: getattr(section, k) for k in names if hasattr(section, k)}
    values.update(overrides)
    return EvalSpec(**values)
