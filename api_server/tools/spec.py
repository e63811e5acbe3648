"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and what they ask
of the generation: the constraint a grammar enforces (`required`, a named function) or the
parser that reads calls out of free text (`auto`).

`tool_choice` (OpenAI's default: `auto` with tools, `none` without):
- `none`: the tools are rendered into the prompt as the template shows them, nothing is parsed
  (vLLM's default; OpenAI's model also still sees them);
- `auto`: the model may call; its text is read by the checkpoint's parser (api_server.tools.parsers);
- `required`: one call (several with `parallel_tool_calls`), a grammar forces a JSON array of
  `{"name", "parameters"}` over the tools' schemas (vLLM's form);
- `{"type": "function", "function": {"name": N}}`: a grammar forces N's arguments object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from api_server.errors import bad_field
from common.sampling_params import StructuredOutput

#: OpenAI's rule for a function's name.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}\Z")
#: Most tools one request may offer.
MAX_TOOLS = 128
_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # a JSON schema of an object
    raw: dict[str, Any]  # the request's entry, as the chat template sees it


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools. `choice`: none, auto, required or named; `function`:
    the named function."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` variable of the chat template (None when no tool is offered)."""
        return [t.raw for t in self.tools] or None

    @property
    def parses(self) -> bool:
        """True when the answer is read for calls (every choice but none)."""
        return bool(self.tools) and self.choice != "none"

    def structured(self) -> StructuredOutput | None:
        """The constraint a grammar enforces: the named function's arguments, or for required
        an array of 1 (or with parallel_tool_calls, 1 or more) {name, parameters} calls."""
        if self.choice == "named":
            (tool,) = [t for t in self.tools if t.name == self.function]
            return StructuredOutput("json_schema", json.dumps(tool.parameters))
        if self.choice != "required":
            return None
        each = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "parameters": t.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": each}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema))


def tool_request(
    tools: list[Any] | None, tool_choice: str | dict[str, Any] | None, parallel: bool | None
) -> ToolRequest:
    """The checked ToolRequest of a request's fields; ApiError 400 naming the field at fault."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    checked = tuple(_tool(t, i) for i, t in enumerate(tools or ()))
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        raise bad_field("tools", "two tools have the same function name")
    par = True if parallel is None else parallel
    if tool_choice is None:
        return ToolRequest(checked, "auto" if checked else "none", parallel=par)
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise bad_field(
                "tool_choice",
                f"tool_choice must be none, auto, required or a function, got {tool_choice!r}",
            )
        if tool_choice != "none" and not checked:
            raise bad_field("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return ToolRequest(checked, tool_choice, parallel=par)
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_field(
            "tool_choice",
            'tool_choice must be none, auto, required or {"type": "function", "function": '
            '{"name": ...}}',
        )
    if name not in names:
        raise bad_field(
            "tool_choice", f"tool_choice names the function {name!r}, which no tool offers"
        )
    return ToolRequest(checked, "named", name, parallel=par)


def _tool(entry: Any, i: int) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(entry, dict) or entry.get("type") != "function":
        raise bad_field(param, 'each tool must be {"type": "function", "function": {...}}')
    fn = entry.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_field(f"{param}.function", "a tool's function needs a name")
    if not _NAME.match(fn["name"]):
        raise bad_field(
            f"{param}.function.name",
            f"a function name is 1 to 64 of a-z, A-Z, 0-9, _ and -, got {fn['name']!r}",
        )
    if not isinstance(fn.get("description", ""), str):
        raise bad_field(f"{param}.function.description", "a description must be a string")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    _check_schema(parameters, f"{param}.function.parameters")
    return Tool(fn["name"], parameters, entry)


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise bad_field(param, "parameters must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise bad_field(param, f"parameters must describe an object, not {schema.get('type')!r}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_field(param, f"parameters is not a valid JSON schema: {exc.message}") from None
