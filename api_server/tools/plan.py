"""What a chat request's tools mean for its prompt and its answer, decided before any forward:
whether the checkpoint's template can show them, the constraint to enforce, and how each
choice's text becomes tool calls.

A template "can render tools" when its text uses the `tools` variable, and tool calls in the
history when it uses `tool_calls` (the built-in tiny model's template and SmolLM2's do neither:
a request with tools is refused there, not silently stripped of them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from api_server.errors import ApiError, bad_field, unsupported
from api_server.tools.assembler import ToolAssembler, call_id, short_call_id
from api_server.tools.history import has_calls
from api_server.tools.parsers import PARSERS, Forced, Mistral, ToolParser, detect, parser_for
from api_server.tools.spec import ToolRequest
from common.sampling_params import SamplingParams, StructuredOutput


class Vocabulary(Protocol):
    """What a plan asks of the served model's tokenizer (api_server.tokens.PromptCounter)."""

    def has_token(self, text: str) -> bool: ...

    def special_ids(self, texts: tuple[str, ...]) -> dict[int, str]: ...


class _NoVocabulary:
    def has_token(self, text: str) -> bool:
        return False

    def special_ids(self, texts: tuple[str, ...]) -> dict[int, str]:
        return {}


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools: `template_tools` for the prompt, `structured` for the sampler, a
    factory of each choice's assembler (None: the text is all content), and `markers`: the
    special-token ids of the parser's format, which the answer's text must show
    (api_server.tools.marker_text; empty: the daemons' text will do)."""

    request: ToolRequest
    parser: Callable[[], ToolParser] | None = None
    new_id: Callable[[], str] = call_id
    markers: dict[int, str] = field(default_factory=dict)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.request.template_tools

    @property
    def structured(self) -> StructuredOutput | None:
        return self.request.structured()

    def assembler(self) -> ToolAssembler | None:
        if self.parser is None:
            return None
        max_calls = None if self.request.parallel else 1
        return ToolAssembler(self.parser(), max_calls=max_calls, new_id=self.new_id)


def plan(
    request: ToolRequest,
    messages: list[dict[str, Any]],
    template_source: str,
    configured_parser: str | None,
    vocabulary: Vocabulary | None = None,
) -> ToolPlan:
    """The plan of `request` for a chat of `messages` under the template `template_source`,
    with the API's --tool-parser and the served tokenizer's `vocabulary` (which form of a
    family's calls the checkpoint writes, and which of its markers are special tokens);
    ApiError 400 when the template cannot show what is asked or no parser can read an `auto`
    answer."""
    vocab = vocabulary or _NoVocabulary()
    if request.tools and "tools" not in template_source:
        raise unsupported(
            "tools",
            "this model's chat template does not render tools (it never uses the `tools` "
            "variable): serve a checkpoint whose template does (Qwen2.5, Llama 3.1, Mistral)",
        )
    if has_calls(messages) and "tool_calls" not in template_source:
        raise unsupported(
            "messages",
            "this model's chat template does not render tool calls or tool results (it never "
            "uses `tool_calls`)",
        )
    family = configured_parser or detect(template_source)
    new_id = short_call_id if family == Mistral.name else call_id
    if request.choice == "named":
        return ToolPlan(request, lambda: Forced(request.function), new_id)
    if request.choice == "required":
        return ToolPlan(request, Forced, new_id)
    if request.choice == "none":
        return ToolPlan(request)
    if family is None:
        raise ApiError(
            400,
            "tool_choice auto needs a tool parser and this model's chat template shows no format "
            f"pdkv knows: start the API with --tool-parser ({', '.join(PARSERS)}), or use "
            "tool_choice required or a named function",
            param="tool_choice",
            code="unsupported_parameter",
        )
    parser = parser_for(family, vocab.has_token, template_source)
    return ToolPlan(request, parser, new_id, vocab.special_ids(parser.specials))


def constrained(params: SamplingParams, tools: ToolPlan, field: str) -> SamplingParams:
    """`params` with the constraint of `tools` (required, named); 400 naming `field` (the
    request's field that set `params.structured`) when the request also asked for one, which
    would be a second constraint."""
    structured = tools.structured
    if structured is None:
        return params
    if params.structured is not None:
        raise bad_field(
            field, f"{field} cannot be combined with tool_choice required or a named function"
        )
    return msgspec.structs.replace(params, structured=structured)
