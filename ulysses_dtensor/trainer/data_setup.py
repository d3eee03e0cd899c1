"""From a trainer config to the batches of each step: sources, checks, loader.

* :func:`build_training_data` (before any process group): the sources of
  ``data.path`` or ``data.sources`` (raw files, a prepared store or the
  built-in corpus) and the held-out documents of ``[eval]``.
* :meth:`TrainingData.verdict` (rank 0, shared by the loop): each source
  checked (files, store manifest, tokenizer, shard sizes) and big enough for
  its share of one step.
* :meth:`TrainingData.loader` (after the process group and the checkpoint):
  per source a token stream (raw text: its length index built once, shared
  out over the ranks; up-sampling), the mixture loader of this dp rank at the
  checkpointed position (``data.packing``: best-fit rows or the stream cut),
  read ahead by ``data.prefetch`` batches in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..data import (
    PackedLoader,
    Prefetcher,
    SourceSpec,
    StepLoader,
    TokenizedSource,
    TokenStream,
    Upsampled,
    as_token_docs,
    build_source,
)
from ..data.checks import DataError, check_corpus
from ..data.sft import long_samples
from ..data.sources import open_source
from ..data.token_docs import TokenDocs
from .config_schema import JobConfig
from .data_config import packing_of
from .eval_setup import held_out_error, split_for_eval
from .hf_start import tokenizer_spec

__all__ = ["TrainingData", "build_training_data"]


@dataclass
class TrainingData:
    cfg: JobConfig
    specs: list[SourceSpec]
    sources: list  # text DocumentSources or TokenDocs (stores, held-out splits of them)
    held_out: object | None
    preview: dict | None = None  # best-fit rows: padding of the first steps (set by loader())

    PREVIEW_STEPS = 10  # steps whose padding the banner reports

    # ------------------------------------------------------------ description
    def key(self, k: int) -> str:
        if self.cfg.data.sources:
            return f"data.sources[{k}].path={self.specs[k].path!r}"
        return (f"data.path={self.cfg.data.path!r}" if self.cfg.data.path
                else f"the built-in corpus (data.max_corpus_mb={self.cfg.data.max_corpus_mb:g})")

    def weights(self, stage: int) -> list[float]:
        return [s.weight_at(stage) for s in self.specs]

    def banner(self, schedule, taken: dict[str, int] | None = None) -> str:
        """The data lines of the start banner; ``taken``: tokens per source so far (a resume)."""
        def kind(src) -> str:
            return "token store" if isinstance(src, TokenDocs) else "raw text, tokenized at load"

        if not self.cfg.data.sources:
            src = self.sources[0]
            return (f"data {self.cfg.data.path or 'built-in stdlib corpus'} ({kind(src)}): "
                    f"{len(src)} documents; {schedule}" + self.sft_banner(schedule))
        n_stages = len(schedule.stages)
        lines = [f"data: mixture of {len(self.specs)} sources, each row from one source; {schedule}"]
        for k, (s, src) in enumerate(zip(self.specs, self.sources)):
            shares = "/".join(f"{100 * self.weights(i)[k] / sum(self.weights(i)):.0f}%" for i in range(n_stages))
            up = (f", documents > {s.upsample_min_tokens:,} tokens x{s.upsample_factor:g}"
                  if s.upsampled else "")
            lines.append(f"    {s.label}: {shares} of the rows{' per stage' if n_stages > 1 else ''}, "
                         f"{s.path} ({kind(src)}, {len(src)} documents{up})")
        lines[-1] += self.sft_banner(schedule)
        total = sum((taken or {}).values())
        if total:
            lines.append("    realised token shares so far: "
                         + ", ".join(f"{n} {t / total:.4f}" for n, t in taken.items()))
        return "\n".join(lines)

    def sft_banner(self, schedule) -> str:
        """For chat / prompt_completion data: what is trained on, and each stage's samples
        longer than a row (what packing does with them)."""
        fmt = self.cfg.data.format
        if fmt == "text":
            return ""
        what = "assistant turns" if fmt == "chat" else "completions"
        out = [f"\n    data.format={fmt}: loss on {what} only, token-weighted over the global batch"]
        lengths = sorted({st.seq_len for st in schedule.stages})
        fate = ("split across rows" if packing_of(self.cfg) == "stream"
                else {"split": "split into row-long pieces", "truncate": "truncated to the row",
                      "drop": "dropped", "error": "refused"}[self.cfg.data.overlong])
        for k, src in enumerate(self.sources):
            counts = [long_samples(src, n) for n in lengths]
            longest = counts[0][1]
            split = ", ".join(f"{c:,} > {n:,}" for (c, _), n in zip(counts, lengths))
            out.append(f"\n    {self.specs[k].label}: {len(src):,} samples, longest {longest:,} tokens; "
                       f"longer than a row ({fate}): {split}")
        return "".join(out)

    def packing_banner(self) -> str:
        """How rows are filled, and for best-fit rows the padding of the first steps."""
        d = self.cfg.data
        if packing_of(self.cfg) == "stream":
            return "packing stream: rows cut every seq_len tokens (no padding; samples cross row ends)"
        line = (f"packing bfd: whole samples best-fit into rows over windows of {d.packing_window:,} samples, "
                f"samples longer than a row: {d.overlong}")
        p = self.preview
        if p:
            line += f"; padding {100 * p['pad_share']:.2f}% of the tokens of the first {p['steps']} steps"
            if p["samples_dropped"] or p["samples_truncated"] or p["samples_split"]:
                line += (f" (in them {p['samples_dropped']:,} samples dropped, {p['samples_truncated']:,} "
                         f"truncated, {p['samples_split']:,} split)")
        return line

    def loading_banner(self) -> str:
        n = self.cfg.data.prefetch
        return (f"next {n} batch{'es' if n > 1 else ''} read in a background thread (data_wait_ms logged)"
                if n else "batches read on the training thread (data.prefetch=0)")

    # ------------------------------------------------------------ checks (rank 0)
    def verdict(self, tokenizer, schedule) -> str | None:
        """Why the data cannot train this schedule, or None (DataError messages)."""
        try:
            for k, src in enumerate(self.sources):
                if len(self.sources) == 1:
                    first = max(schedule.stages, key=lambda st: schedule.tokens(st.start_step))
                    need = schedule.tokens(first.start_step)
                    what = (f"one step of {schedule.batch_for(first.seq_len)} x {first.seq_len} tokens "
                            f"(stage from step {first.start_step})")
                else:  # its rows of the step that needs the most from it
                    need = 0
                    for i, st in enumerate(schedule.stages):
                        w = self.weights(i)
                        rows = max(1, -(-schedule.batch_for(st.seq_len) * w[k] // sum(w)))
                        need = max(need, int(rows) * st.seq_len)
                    what = f"its share of one step ({need:,} tokens)"
                check_corpus(src, tokenizer, need, described=f"{self.key(k)} with {what}")
            if packing_of(self.cfg) == "bfd" and self.cfg.data.overlong == "error":
                self._check_overlong(schedule)
        except DataError as e:
            return str(e)
        if self.cfg.eval.interval:
            longest = max(self.cfg.eval.lengths or [st.seq_len for st in schedule.stages])
            return held_out_error(self.held_out, tokenizer, self.cfg.eval.loss_rows, longest)
        return None

    def _check_overlong(self, schedule) -> None:
        """data.overlong='error': no tokenized sample longer than the shortest stage's rows
        (raw text is counted as the packer meets it)."""
        for k, src in enumerate(self.sources):
            if not isinstance(src, TokenDocs) or not len(src):
                continue
            for i, st in enumerate(schedule.stages):
                count, longest = long_samples(src, st.seq_len)
                if count:
                    raise DataError(
                        f"{self.key(k)}: {count:,} samples are longer than a row of {schedule.key(i)}={st.seq_len:,} "
                        f"tokens (stage from step {st.start_step}), the longest {longest:,} tokens, and "
                        f"data.overlong='error'; set data.overlong to 'truncate' (keep the prompt, cut the "
                        f"answer's end), 'split' or 'drop', or raise the sequence length")

    # ------------------------------------------------------------ the loader
    def streams(self, tokenizer) -> list[TokenStream]:
        """One token stream per source (collective over the world for raw text)."""
        out = []
        multi = len(self.specs) > 1
        for k, (spec, src) in enumerate(zip(self.specs, self.sources)):
            docs = as_token_docs(src, tokenizer)
            if isinstance(docs, TokenizedSource):
                _index_over_world(docs)
            if spec.upsampled:
                docs = Upsampled(docs, spec.upsample_min_tokens, spec.upsample_factor)
            seed = [self.cfg.job.seed, k] if multi else self.cfg.job.seed
            out.append(TokenStream(docs, seed=seed, shuffle=self.cfg.data.shuffle))
        return out

    def loader(self, tokenizer, dp_rank: int, dp_size: int, schedule, start_step: int,
               state: dict | None = None):
        """Batches for steps ``start_step + 1 ..``: ``batch_for(step)``, ``state_dict()``,
        ``tokens_seen``, ``source_tokens()``, ``wait_seconds``, ``close()``."""
        d = self.cfg.data
        loader = PackedLoader(self.streams(tokenizer), dp_rank=dp_rank, dp_size=dp_size,
                              weights=self.weights(0), names=[s.label for s in self.specs],
                              seed=self.cfg.job.seed, packing=packing_of(self.cfg), window=d.packing_window,
                              overlong=d.overlong)
        if state is not None:
            loader.load_state_dict(state)

        def plan(step: int):
            return (schedule.batch_size(step), schedule.seq_len(step),
                    self.weights(schedule.stage_index(step)))

        # The banner's padding figure: the next steps' rows from their lengths (before the
        # read-ahead thread shares the streams).
        steps = range(start_step + 1, min(self.cfg.training.steps, start_step + self.PREVIEW_STEPS) + 1)
        preview = loader.preview([plan(step) for step in steps]) if steps else None
        self.preview = {**preview, "steps": len(steps)} if preview else None

        if self.cfg.data.prefetch and start_step < self.cfg.training.steps:
            return Prefetcher(loader, plan, start_step + 1, self.cfg.training.steps, self.cfg.data.prefetch)
        return StepLoader(loader, plan)

    def step_metrics(self, loader) -> dict:
        """``data_wait_ms``, and with several sources each one's realised token share so far."""
        out = {"data_wait_ms": 1000.0 * loader.wait_seconds}
        stats = loader.batch_stats()  # best-fit rows: the step's padding, overlong samples handled so far
        if stats:
            out["pad_share"] = stats["pad_share"]
            kept = {"drop": "samples_dropped", "truncate": "samples_truncated", "split": "samples_split"}
            if self.cfg.data.overlong in kept:
                out[kept[self.cfg.data.overlong]] = stats[kept[self.cfg.data.overlong]]
        if len(self.specs) > 1:
            taken = loader.source_tokens()
            total = max(1, sum(taken.values()))
            out.update({f"data_share_{name}": t / total for name, t in taken.items()})
        return out


def _index_over_world(docs: TokenizedSource) -> None:
    """The length index of raw text, each rank counting 1/world of the documents."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        docs.build_index()
        return
    world = dist.get_world_size()

    def gather(mine):
        shares = [None] * world
        dist.all_gather_object(shares, mine)
        return shares

    docs.build_index(dist.get_rank(), world, gather)


def _open(cfg: JobConfig, key: str, path: str):
    """The documents of ``path`` as ``data.format`` reads them (:func:`~..data.sources.open_source`),
    its messages naming the config key (a source without documents, a store without a
    manifest or of another format, no chat template)."""
    d = cfg.data
    try:
        return open_source(path, d.format, tokenizer_spec(cfg), d.text_key, d.max_corpus_mb, key=key)
    except DataError as e:
        msg = str(e)
        if msg.startswith((f"{key}=", "data.tokenizer=")):  # already names its key
            raise DataError(msg) from None
        if msg.startswith(repr(path)):
            msg = msg[len(repr(path)):].lstrip()
            raise DataError(f"{key}={path!r} {msg}") from None
        raise DataError(f"{key}={path!r}: {msg}") from None


def build_training_data(cfg: JobConfig) -> TrainingData:
    """The sources and held-out documents of ``cfg`` (DataError / ConfigError)."""
    d = cfg.data
    if d.sources:
        sources = [_open(cfg, f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)]
        _, held_out = split_for_eval(cfg, sources[0])
        return TrainingData(cfg, list(d.sources), sources, held_out)
    source = _open(cfg, "data.path", d.path) if d.path else build_source("", max_corpus_mb=d.max_corpus_mb)
    # With eval.holdout_fraction training reads only the documents outside the split.
    source, held_out = split_for_eval(cfg, source)
    spec = SourceSpec(path=d.path or "builtin", weight=1.0, name="data")
    return TrainingData(cfg, [spec], [source], held_out)
