"""OpenAI request bodies, decoded and checked: every refusal is a 400 that names the field.

Fields the API does not implement but a client may send with their neutral value (`user`,
penalties of 0, ...) are ignored; those whose meaning it cannot honour (`n` > 1, `logprobs`,
`echo`, `best_of` > 1, `suffix`, `tools`) are refused. `top_k` and `ignore_eos` are extra fields
(the openai client passes them with `extra_body`).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from api_server.errors import ApiError, bad_field
from common.sampling_params import SamplingParams, SamplingParamsError

MAX_STOP_STRINGS = 4
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


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


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int]
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


def _param_of(message: str) -> str:
    """The field a msgspec error names: `$.a.b` in its path, plus a missing field's name."""
    path = _PATH.search(message)
    missing = _MISSING.search(message)
    parts = [m.group(1) for m in (path, missing) if m is not None and m.group(1)]
    return ".".join(parts)


def _refuse_unsupported(req: _Request) -> None:
    if req.n is not None and req.n != 1:
        raise bad_field("n", f"n must be 1 (one choice per request), got {req.n}")
    unsupported = {
        "echo": getattr(req, "echo", False),
        "logprobs": getattr(req, "logprobs", None),
        "top_logprobs": getattr(req, "top_logprobs", None),
        "suffix": getattr(req, "suffix", None),
        "tools": getattr(req, "tools", None),
        "best_of": getattr(req, "best_of", None) not in (None, 1),
    }
    for name, value in unsupported.items():
        if value not in (None, False, []):
            raise bad_field(name, f"{name} is not supported by pdkv")


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


def prompt_of(req: CompletionRequest) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids): `prompt` is a string, a list of one string, or ids."""
    p = req.prompt
    if isinstance(p, str):
        return p, None
    if len(p) == 1 and isinstance(p[0], str):
        return p[0], None
    if p and all(isinstance(t, int) and 0 <= t < 2**31 for t in p):
        return None, p  # type: ignore[return-value]
    raise bad_field(
        "prompt",
        "prompt must be a string, a list of one string, or a non-empty list of token ids "
        "(one prompt per request)",
    )


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
