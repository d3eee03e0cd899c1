"""Chat templates, offline: find one next to a tokenizer, render ``messages``, and
find which characters of the rendered text the assistant wrote.

Where the template comes from: the directory of the ``tokenizer.json`` (a model
directory as ``save_pretrained`` writes it): ``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{name, template}`` of which ``default`` is used). ``bos_token`` /
``eos_token`` come from ``tokenizer_config.json`` (templates print them).

Rendering uses ``jinja2``'s sandbox with the settings and helpers chat
templates are written for (``trim_blocks``, ``lstrip_blocks``, ``tojson``,
``raise_exception``, ``strftime_now``), as ``transformers``'
``apply_chat_template`` does, so the text is the one a model was trained on.

Assistant spans: the assistant's turn ``i`` is what rendering ``messages[:i+1]``
adds to rendering ``messages[:i]`` with the generation prompt (the role header
belongs to the prompt). That needs no markers in the template; it needs the
template to render a conversation's prefix as a prefix of the conversation,
which is checked for every turn (a template that rewrites earlier turns is
refused, naming the record). Trailing whitespace after the end-of-turn token
is not a target.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

from .errors import DataError

__all__ = ["ChatTemplate", "find_chat_template", "BASE_ROLES"]

BASE_ROLES = ("system", "user", "assistant")
_SENTINEL = "\u2063tool-output-probe\u2063"


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} as older tokenizer configs write it
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A jinja chat template with the special tokens it prints."""

    def __init__(self, template: str, *, source: str, bos_token: str | None = None,
                 eos_token: str | None = None):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # pragma: no cover - jinja2 ships with torch
            raise DataError("chat templates need the 'jinja2' package: pip install 'ulysses-dtensor[sft]'") from None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"the chat template of {source} does not parse (line {e.lineno}: {e.message})") from None
        self._error = jinja2.exceptions.TemplateError
        self.source = source
        self.text = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.sha256 = hashlib.sha256(template.encode()).hexdigest()
        self._roles: tuple[str, ...] | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "") -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         tools=None, documents=None)
        except self._error as e:
            raise DataError(f"{where or 'a conversation'}: the chat template of {self.source} refused it ({e})") from None

    @property
    def roles(self) -> tuple[str, ...]:
        """system, user, assistant, and tool if the template renders a tool message's content."""
        if self._roles is None:
            probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                     {"role": "tool", "content": _SENTINEL}]
            try:
                takes_tool = _SENTINEL in self._template.render(messages=probe, add_generation_prompt=False,
                                                                bos_token="", eos_token="", tools=None)
            except Exception:  # noqa: BLE001 - any failure means: no tool role
                takes_tool = False
            self._roles = BASE_ROLES + (("tool",) if takes_tool else ())
        return self._roles

    def assistant_spans(self, messages: list[dict], turns, where: str) -> tuple[str, list[tuple[int, int]]]:
        """``(rendered text, [(start, end) character span of each turn in turns])``."""
        full = self.render(messages, where=where)
        spans = []
        for i in turns:
            before = self.render(messages[:i], add_generation_prompt=True, where=where)
            through = self.render(messages[:i + 1], where=where)
            if not (through.startswith(before) and full.startswith(through)):
                raise DataError(
                    f"{where}: the chat template of {self.source} does not render this conversation's "
                    f"first {i + 1} messages as the start of the whole (it rewrites earlier turns), so the "
                    f"assistant tokens of messages[{i}] cannot be located; use a template that renders "
                    f"turns append-only")
            end = len(through.rstrip())
            spans.append((len(before), max(end, len(before))))
        return full, spans


def find_chat_template(tokenizer_spec: str, *, key: str = "data.tokenizer") -> ChatTemplate:
    """The chat template shipped beside the tokenizer ``tokenizer_spec`` (DataError if none)."""
    where = ("chat_template.jinja or tokenizer_config.json (key chat_template) in the directory of the "
             "tokenizer.json")
    if tokenizer_spec == "byte":
        raise DataError(f"{key}='byte' has no chat template; 'messages' records are rendered with the "
                        f"template of an HF tokenizer: give the tokenizer.json of a model directory "
                        f"holding {where}")
    folder = Path(tokenizer_spec).parent
    config_path = folder / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{config_path} is not valid JSON ({e.msg})") from None
    specials = dict(bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token")))
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return ChatTemplate(jinja_path.read_text(), source=str(jinja_path), **specials)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise DataError(f"{key}={tokenizer_spec!r}: no chat template in {folder} (looked for {jinja_path.name} "
                        f"and the chat_template key of {config_path.name}); 'messages' records need one: "
                        f"add the model's chat_template.jinja there, or use data.format='prompt_completion' "
                        f"with string prompts")
    return ChatTemplate(template, source=str(config_path), **specials)
