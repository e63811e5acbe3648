"""A chat's messages as the chat template sees them, tool calls and their results included.

An assistant message's `tool_calls` reach the template as transformers' templates expect them:
`{"id", "type": "function", "function": {"name", "arguments"}}` with the arguments an object
(OpenAI sends them as a JSON string; Qwen's and Llama's templates `tojson` them). A `tool`
message must answer a call made earlier in the chat (its `tool_call_id`); it carries that call's
function `name` too, which some templates show.
"""

from __future__ import annotations

import json
from typing import Any

from api_server.errors import bad_field
from api_server.schemas import ChatMessage, message_role, message_text


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The template's `messages` for a request's; ApiError 400 naming the message at fault."""
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # id → function name, of every call so far
    for i, m in enumerate(messages):
        role = message_role(m, i)
        msg: dict[str, Any] = {"role": role, "content": message_text(m, i)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise bad_field(f"messages[{i}].tool_calls", "only assistant messages make calls")
            msg["tool_calls"] = [
                _call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)
            ]
            calls |= {c["id"]: c["function"]["name"] for c in msg["tool_calls"]}
        if role == "tool":
            if m.tool_call_id not in calls:
                raise bad_field(
                    f"messages[{i}].tool_call_id",
                    f"tool message {i} answers the call {m.tool_call_id!r}, which no earlier "
                    "assistant message made",
                )
            msg["tool_call_id"] = m.tool_call_id
            msg.setdefault("name", calls[m.tool_call_id])
        out.append(msg)
    return out


def has_calls(messages: list[dict[str, Any]]) -> bool:
    """True when the chat holds tool calls or their results."""
    return any("tool_calls" in m or m["role"] == "tool" for m in messages)


def _call(call: Any, param: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_field(
            param, 'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}'
        )
    if not isinstance(call.get("id"), str):
        raise bad_field(f"{param}.id", "a tool call needs its id")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        raise bad_field(f"{param}.function.arguments", "arguments must be a JSON object's text")
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments},
    }
