"""Supervised fine-tuning data: records rendered to tokens with per-token target flags.

``data.format`` (and ``prepare_data --format``) picks the renderer of each record:

=====================  ======================================================
``text``               ``record[text_key]``: every token a target (pretraining)
``chat``               ``messages``: a list of ``{role, content}`` (TRL's
                       conversational form), rendered with the chat template
                       beside the tokenizer (:mod:`.chat`); targets: the
                       assistant turns, through their end-of-turn token
``prompt_completion``  ``prompt`` + ``completion`` strings: ``[BOS] prompt
                       completion [EOS]``, targets: the completion and EOS;
                       or both lists of messages (rendered like ``chat``,
                       targets: the assistant turns of the completion)
=====================  ======================================================

A renderer maps ``(where, record)`` to ``(token ids, uint8 target flags)``;
every bad record raises one :class:`DataError` naming its file and line.
Prepared stores record the renderer in their manifest
(:func:`check_store_format` refuses a store of another format), raw files are
rendered at load by :class:`RenderedDocs`.

Rows. By default (``data.packing = "auto"``) SFT samples are best-fit packed whole
into rows (:mod:`.bestfit`): none is cut at a row end unless it alone is longer
than a row, and ``data.overlong`` says what happens then (refused, truncated to
the row, split into row-long pieces, dropped). With ``data.packing = "stream"``
they are packed end to end like documents (:mod:`.loader`): a sample crossing a
row end continues in the next row as a separate document. The trainer's banner
counts each stage's samples longer than a row.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .chat import ChatTemplate, find_chat_template
from .errors import DataError
from .prepare import Renderer, TextRenderer
from .readers import data_files, data_suffix, iter_file_records
from .token_docs import TokenizedSource

__all__ = ["FORMATS", "ChatRenderer", "PromptCompletionRenderer", "RenderedDocs", "build_renderer",
           "check_store_format", "long_samples"]

FORMATS = ("text", "chat", "prompt_completion")


def _keys(record: dict) -> str:
    return ", ".join(map(repr, list(record)[:8])) or "none"


class _Renderer(Renderer):
    """A renderer that may need the chat template beside the tokenizer."""

    def __init__(self, tokenizer_spec: str):
        super().__init__(tokenizer_spec)
        self._template: ChatTemplate | None = None

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = find_chat_template(self.tokenizer_spec)
        return self._template

    def _messages(self, value, where: str, field: str) -> list[dict]:
        roles = self.template.roles
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: {field!r} must be a non-empty list of {{role, content}} objects, "
                            f"got {json_kind(value)}")
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise DataError(f"{where}: {field}[{j}] must be an object with a 'role' string and a "
                                f"'content' string, got {m!r:.80}")
            if m["role"] not in roles:
                raise DataError(f"{where}: {field}[{j}].role={m['role']!r} is not a role the chat template "
                                f"of {self.template.source} takes; valid: {', '.join(roles)}")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: {field}[{j}].content must be a string, got {json_kind(m.get('content'))}")
        return value

    def _chat(self, messages: list[dict], turns: list[int], where: str):
        text, spans = self.template.assistant_spans(messages, turns, where)
        ids, starts = self.tokenizer.encode_offsets(text)
        targets = np.zeros(len(ids), dtype=np.uint8)
        for s, e in spans:
            targets[(starts >= s) & (starts < e)] = 1
        if not targets.any():
            raise DataError(f"{where}: its assistant turns render to no token (empty contents?): "
                            f"nothing to train on")
        return ids, targets


def json_kind(value) -> str:
    return "null" if value is None else f"a JSON {type(value).__name__}" if not isinstance(value, str) else repr(value[:40])


class ChatRenderer(_Renderer):
    """``messages`` -> the chat template's text; targets: the assistant turns."""

    name = "chat"
    columns = ["messages"]

    def __init__(self, tokenizer_spec: str):
        super().__init__(tokenizer_spec)
        _ = self.template  # no template: the one message now, before any record is read

    def settings(self) -> dict:
        return {"renderer": self.name, "chat_template_sha256": self.template.sha256}

    def render(self, where: str, record):
        if not isinstance(record, dict) or "messages" not in record:
            raise DataError(f"{where} has no 'messages' key (data.format='chat' reads a list of {{role, content}} "
                            f"objects); its keys: {_keys(record) if isinstance(record, dict) else 'none'}")
        messages = self._messages(record["messages"], where, "messages")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise DataError(f"{where}: 'messages' has no assistant turn (roles: "
                            f"{', '.join(m['role'] for m in messages)}): nothing to train on; every "
                            f"conversation needs at least one {{'role': 'assistant', ...}} message")
        return self._chat(messages, turns, where)


class PromptCompletionRenderer(_Renderer):
    """``prompt`` + ``completion``; targets: the completion (and EOS)."""

    name = "prompt_completion"
    columns = ["prompt", "completion"]

    def settings(self) -> dict:
        return {"renderer": self.name}

    def render(self, where: str, record):
        if not isinstance(record, dict) or "prompt" not in record:
            raise DataError(f"{where} has no 'prompt' key (data.format='prompt_completion' reads 'prompt' and "
                            f"'completion'); its keys: {_keys(record) if isinstance(record, dict) else 'none'}")
        prompt, completion = record["prompt"], record.get("completion")
        if completion is None or completion == "" or completion == []:
            raise DataError(f"{where} has a 'prompt' but no 'completion' ({json_kind(completion)}): nothing "
                            f"to train on; every record needs a non-empty completion (a string, or a list "
                            f"of messages with an assistant turn)")
        if isinstance(prompt, str) and isinstance(completion, str):
            tok = self.tokenizer
            head = tok.encode(prompt, bos=True, eos=False)
            tail = tok.encode(completion, bos=False, eos=True)
            targets = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
            return np.concatenate([head, tail]), targets
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = self._messages(prompt, where, "prompt") + self._messages(completion, where, "completion")
            turns = [i for i, m in enumerate(messages) if i >= len(prompt) and m["role"] == "assistant"]
            if not turns:
                raise DataError(f"{where}: 'completion' has no assistant message: nothing to train on")
            return self._chat(messages, turns, where)
        raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages, "
                        f"got {json_kind(prompt)} and {json_kind(completion)}")


def build_renderer(fmt: str, tokenizer_spec: str, text_key: str = "text"):
    """The renderer of ``data.format`` / ``--format`` (DataError without a chat template for chat)."""
    if fmt == "text":
        return TextRenderer(tokenizer_spec, text_key)
    if fmt == "chat":
        return ChatRenderer(tokenizer_spec)
    if fmt == "prompt_completion":
        return PromptCompletionRenderer(tokenizer_spec)
    raise DataError(f"format {fmt!r} is not a data format; valid: {', '.join(FORMATS)}")


def check_store_format(store, fmt: str, key: str) -> None:
    """``store`` was prepared with the renderer of ``fmt`` (DataError naming ``key`` if not)."""
    have = store.manifest.get("renderer", "text")
    if have != fmt:
        raise DataError(
            f"{key}={str(store.path)!r} is a token store prepared as {have!r} (renderer in its manifest.json), "
            f"and data.format={fmt!r}: set data.format={have!r}, or prepare the data again with "
            f"python -m ulysses_dtensor.prepare_data --format {fmt}")


class RenderedDocs(TokenizedSource):
    """Raw record files (``.jsonl[.gz|.zst]``, parquet, arrow) rendered at load.

    For small data: the records are read into memory once; rendering is
    on demand like :class:`TokenizedSource` (its length index: one rendering
    of every record, shared out over the ranks). Prepare a store for more.
    """

    has_targets = True

    def __init__(self, path: str, renderer):
        self.root = Path(path)
        self.renderer = renderer
        items = []
        for f in data_files(path):
            if data_suffix(f) == ".txt":
                raise DataError(f"{f}: a .txt file is one text document; data.format={renderer.name!r} reads "
                                f"records from .jsonl[.gz|.zst], .parquet or .arrow files")
            items.extend(iter_file_records(f, renderer.columns))
        if not items:
            raise DataError(f"{str(path)!r} holds no records")
        self.items = items
        digest = hashlib.sha256(repr(sorted(renderer.settings().items())).encode()).hexdigest()[:12]
        self._fingerprint = f"{renderer.name}:{self.root.name}:{len(items)}:{digest}"
        super().__init__(self, None)
        self._cached_targets: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def _render(self, i: int):
        if self._cached is None or self._cached[0] != i:
            ids, targets = self.renderer.render(*self.items[i])
            self._cached, self._cached_targets = (i, ids), (i, targets)
        return self._cached[1], self._cached_targets[1]

    def _encode(self, i: int) -> np.ndarray:
        return self._render(i)[0]

    def _count(self, i: int) -> int:
        return len(self._encode(i))

    def targets(self, i: int, start: int, stop: int):
        return self._render(int(i))[1][start:stop]

    def fingerprint(self) -> str:
        return self._fingerprint

    def doc_key(self, i: int) -> str:
        where = self.items[i][0]
        prefix = str(self.root) + "/"
        return where[len(prefix):] if where.startswith(prefix) else where


def long_samples(docs, seq_len: int) -> tuple[int, int]:
    """(samples longer than ``seq_len`` tokens, the longest sample's length) of tokenized ``docs``."""
    lengths = docs.lengths(0, len(docs))
    return int((lengths > seq_len).sum()), int(lengths.max()) if len(lengths) else 0
