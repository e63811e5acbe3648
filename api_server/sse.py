"""Response bodies: JSON through msgspec (faster than json for the per-token chunks) and
server-sent events as OpenAI streams them (`data: {...}\\n\\n`, then `data: [DONE]\\n\\n`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.responses import Response

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def json_response(
    body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(_encode(body), status, headers, media_type="application/json")


def event(body: Any) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + _encode(body) + b"\n\n"
