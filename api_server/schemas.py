"""OpenAI request bodies, decoded and checked: every refusal is a 400 that names the field.

Fields that do not change the output (`user`, `store`, `metadata`, ...) are accepted and
ignored. Fields that would change it in a way pdkv does not implement are refused unless they
hold their neutral value: `n` > 1, `best_of` > 1, `logprobs`, `top_logprobs`, `echo`, `suffix`,
non-zero `presence_penalty` / `frequency_penalty`, a `logit_bias`, a `response_format` other than
text, `tools` and tool messages. `top_k` and `ignore_eos` are extra fields (the openai client
passes them with `extra_body`). Chat roles are system, user and assistant, and developer (OpenAI's
newer name for system, rendered as system).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from api_server.errors import ApiError, bad_field, unsupported
from common.sampling_params import SamplingParams, SamplingParamsError

MAX_STOP_STRINGS = 4
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "developer": "system"}


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


RequestT = TypeVar("RequestT", CompletionRequest, ChatRequest)
_decoders: dict[type, msgspec.json.Decoder] = {
    cls: msgspec.json.Decoder(cls) for cls in (CompletionRequest, ChatRequest)
}


def decode(cls: type[RequestT], body: bytes) -> RequestT:
    """The request `body` as `cls`; ApiError 400 naming the field when it does not fit."""
    try:
        req = _decoders[cls].decode(body)
    except msgspec.ValidationError as exc:
        raise bad_field(_param_of(str(exc)), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    _refuse_unsupported(req)
    return req


def _param_of(message: str) -> str | None:
    """The field a msgspec error names: `$.a.b` in its path, plus a missing field's name; None
    when the body as a whole is at fault."""
    path = _PATH.search(message)
    missing = _MISSING.search(message)
    parts = [m.group(1) for m in (path, missing) if m is not None and m.group(1)]
    return ".".join(parts) or None


def _refuse_unsupported(req: _Request) -> None:
    if req.n is not None and req.n != 1:
        raise unsupported("n", f"n must be 1 (one choice per prompt), got {req.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise unsupported(name, f"{name} is not implemented by pdkv: leave it out or send 0")
    unsupported_fields = {
        "logit_bias": req.logit_bias,
        "echo": getattr(req, "echo", False),
        "logprobs": getattr(req, "logprobs", None),
        "top_logprobs": getattr(req, "top_logprobs", None),
        "suffix": getattr(req, "suffix", None),
        "tools": getattr(req, "tools", None),
        "best_of": getattr(req, "best_of", None) not in (None, 1),
    }
    for name, value in unsupported_fields.items():
        if value not in (None, False, [], {}):
            raise unsupported(name, f"{name} is not supported by pdkv")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.get("type") != "text":
        raise unsupported(
            "response_format",
            f"response_format {fmt.get('type')!r} is not supported by pdkv (only 'text')",
        )


def sampling(req: _Request, *, max_tokens: int | None, default_max: int) -> SamplingParams:
    """The daemon's SamplingParams for `req` (OpenAI's default temperature is 1)."""
    try:
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        ).validate()
    except SamplingParamsError as exc:
        field = str(exc).split(" ", 1)[0]
        if field == "max_tokens" and isinstance(req, ChatRequest) and req.max_tokens is None:
            field = "max_completion_tokens"
        raise bad_field(field, str(exc)) from None


def stop_strings(req: _Request) -> list[str]:
    """`stop` as a list of non-empty strings (at most MAX_STOP_STRINGS)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return [s for s in stops if s]


def message_role(msg: ChatMessage, index: int) -> str:
    """The role a template sees: system, user or assistant (developer is system)."""
    if msg.role in _ROLES:
        return _ROLES[msg.role]
    if msg.role in ("tool", "function"):
        why = f"{msg.role} messages need tools, which pdkv does not support"
    else:
        why = f"role {msg.role!r} is not one pdkv knows: use system, user, assistant or developer"
    raise unsupported(f"messages[{index}].role", why)


def message_text(msg: ChatMessage, index: int) -> str:
    """A message's content as one string: text parts are joined, other part types refused."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts = []
    for part in msg.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_field(
                f"messages[{index}].content",
                f"only text content parts are supported, got type {part.get('type')!r}",
            )
        texts.append(part["text"])
    return "".join(texts)
