"""Chat templates: the checkpoint's own, rendered and tokenized as transformers'
`apply_chat_template(..., tokenize=True)` does, or DEFAULT_TEMPLATE for checkpoints without one and
for the built-in tiny model.

The template comes from `chat_template.jinja` in the model directory, else `chat_template` in its
tokenizer_config.json (a string, or a list of named templates of which `default` is used). It is
rendered in jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`, the loop-controls
extension, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text, with
`messages`, `add_generation_prompt=True` and the tokenizer's special token strings (`bos_token`,
`eos_token`, ...) as variables — the names and settings transformers uses, so templates written
for it render the same text.

A checkpoint's own template is the whole prompt, special tokens included: its text is tokenized
here with the checkpoint's tokenizer.json *without* the tokenizer's special-token template, and the
daemons get the ids, exactly transformers' ids (a template that writes `bos_token` has its BOS, one
that does not has none, whatever the tokenizer would add). The default template's text goes to the
daemons as a prompt, which their tokenizer encodes as any prompt (BOS first where it adds one).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import PdkvError

#: For checkpoints without a template and the tiny model: each message as `<|role|>` on its own
#: line followed by its content and a newline; then `<|assistant|>` and a newline for the answer.
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(PdkvError):
    """The chat template cannot be read or fails to render these messages."""


class ChatTemplate:
    """A compiled chat template and the special-token strings it may use."""

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str] | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from exc
        self.special_tokens = dict(special_tokens or {})
        self.source = source
        self.is_default = source == DEFAULT_TEMPLATE
        self._tokenizer = None if self.is_default else tokenizer

    @classmethod
    def for_model(cls, model_dir: Path | None) -> ChatTemplate:
        """The template of the checkpoint in `model_dir`, or the default one."""
        if model_dir is None:
            return cls(DEFAULT_TEMPLATE)
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {k: v for k in _SPECIAL_TOKENS if (v := _token_text(config.get(k)))}
        tokenizer = _load_tokenizer(model_dir / "tokenizer.json")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(), special, tokenizer)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        return cls(source if isinstance(source, str) else DEFAULT_TEMPLATE, special, tokenizer)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The template's text for `messages` (and the functions `tools` offers), ready for the
        assistant's answer, as transformers' `apply_chat_template(tokenize=False,
        add_generation_prompt=True, tools=tools)` renders it."""
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=True, **self.special_tokens
            )
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed on these messages: {exc}") from exc

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str | None, list[int] | None]:
        """(prompt, prompt_tokens) for the daemons' GENERATE, exactly one of them set: the ids of
        the rendered text, tokenized without special tokens, for a checkpoint's template and
        tokenizer.json; the text itself for the default template or without tokenizer.json."""
        text = self.render(messages, tools)
        if self._tokenizer is None:
            return text, None
        return None, list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def _load_tokenizer(path: Path) -> Any | None:
    """The `tokenizers` Tokenizer of `path`, or None when there is no such file (the daemons then
    use their byte tokenizer). Not common.model's adapter: that package imports torch."""
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise TemplateError(f"cannot read tokenizer {path}: {exc}") from exc


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TemplateError(f"cannot parse {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}
