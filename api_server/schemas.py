"""OpenAI request bodies, decoded and checked: every refusal is a 400 that names the field.

Fields that do not change the output (`user`, `store`, `metadata`, ...) are accepted and
ignored. Fields that would change it in a way pdkv does not implement are refused unless they
hold their neutral value: `best_of` > 1, `suffix`, a `logit_bias`. `response_format` (text,
json_object, json_schema), vLLM's `structured_outputs` object and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` constrain the output
(api_server/structured.py). Tools (`tools`, `tool_choice`,
`parallel_tool_calls`, `tool` messages and assistant `tool_calls`) are decoded here and checked by
api_server.tools. Implemented: `n` (up to MAX_N choices per prompt), `logprobs`
(completions: an int, the top alternatives; chat: a bool with `top_logprobs`), `echo`,
`presence_penalty`, `frequency_penalty`, `seed`. `top_k`, `ignore_eos`, `repetition_penalty`,
`min_tokens` and `stop_token_ids` are extra fields, as vLLM accepts them (the openai client passes
them with `extra_body`). Chat roles are system, user and assistant, and developer (OpenAI's newer
name for system, rendered as system), and tool for a call's result.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from api_server.errors import ApiError, bad_field, unsupported
from api_server.structured import structured_of
from common.sampling_params import SamplingParams, SamplingParamsError

MAX_STOP_STRINGS = 4
#: Most choices per prompt (`n`).
MAX_N = 16
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "developer": "system",
    "tool": "tool",
}


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
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    # structured output, vLLM's extra fields (api_server/structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's calls (api_server.tools.history)
    tool_call_id: str | None = None  # a tool message's: the call it answers


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None  # tools: checked by api_server.tools.spec
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused
    function_call: str | dict[str, Any] | None = None
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
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_field("n", f"n must be an integer in [1, {MAX_N}], got {req.n}")
    unsupported_fields = {
        "logit_bias": req.logit_bias,
        "suffix": getattr(req, "suffix", None),
        "best_of": getattr(req, "best_of", None) not in (None, 1),
        "functions": getattr(req, "functions", None),
        "function_call": getattr(req, "function_call", None),
    }
    for name, value in unsupported_fields.items():
        if value not in (None, False, [], {}):
            raise unsupported(name, f"{name} is not supported by pdkv")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise bad_field("top_logprobs", "top_logprobs needs logprobs: true")


def _logprobs(req: _Request) -> tuple[int | None, int | None, str]:
    """(logprobs k of the generated tokens, of the prompt tokens, the field that set k)."""
    if isinstance(req, ChatRequest):
        if not req.logprobs:
            return None, None, "logprobs"
        return req.top_logprobs or 0, None, "top_logprobs"
    assert isinstance(req, CompletionRequest)
    k = req.logprobs
    # echo with max_tokens 0 needs the prompt's tokens, which come with its logprobs
    prompt_k = (
        k if req.echo and k is not None else (0 if req.echo and req.max_tokens == 0 else None)
    )
    return k, prompt_k, "logprobs"


def sampling(req: _Request, *, max_tokens: int | None, default_max: int) -> SamplingParams:
    """The daemon's SamplingParams for `req` (OpenAI's default temperature is 1)."""
    k, prompt_k, k_field = _logprobs(req)
    try:
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            logprobs=k,
            prompt_logprobs=prompt_k,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            structured=structured_of(req),
        ).validate()
    except SamplingParamsError as exc:
        field = str(exc).split(" ", 1)[0]
        if field == "max_tokens" and isinstance(req, ChatRequest) and req.max_tokens is None:
            field = "max_completion_tokens"
        message = str(exc)
        if field in ("logprobs", "prompt_logprobs"):
            field, message = k_field, k_field + message[len(field) :]
        raise bad_field(field, message) from None


def seeded(params: SamplingParams, choice: int) -> SamplingParams:
    """The parameters of choice `choice` of n: with a seed, choice i draws with seed + i (so
    choices differ and each is reproducible); without one, each gets its own from the daemon."""
    if choice == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + choice)


def stop_strings(req: _Request) -> list[str]:
    """`stop` as a list of non-empty strings (at most MAX_STOP_STRINGS)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_field("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    return [s for s in stops if s]


def message_role(msg: ChatMessage, index: int) -> str:
    """The role a template sees: system, user, assistant or tool (developer is system)."""
    if msg.role in _ROLES:
        return _ROLES[msg.role]
    if msg.role == "function":
        why = "function messages (OpenAI's deprecated form) are not supported: use tool messages"
    else:
        why = (
            f"role {msg.role!r} is not one pdkv knows: use system, user, assistant, developer "
            "or tool"
        )
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
