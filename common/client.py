"""Client side of the daemons' sockets: generate, status. Used by the CLI, the demo and tests.

The client socket speaks the same frames as the link: GENERATE, then TOKENS… and FINISH (or ERROR)
for that request id; STATUS as the first frame of a connection is answered by STATUS_REPLY.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.channel import connect
from common.errors import PdkvError, ProtocolError
from common.protocol import Abort, Error, ErrorCode, Finish, Generate, Status, StatusReply, Tokens
from common.sampling_params import SamplingParams

__all__ = ["Finish", "RequestFailed", "Result", "Tokens", "generate", "status", "stream"]


class RequestFailed(PdkvError):
    """The daemon answered a request with ERROR; `code` is its ErrorCode."""

    def __init__(self, code: ErrorCode, message: str, request_id: str | None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.request_id = request_id


@dataclass
class Result:
    """A finished request as the client saw it."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None


async def stream(
    socket_path: str,
    *,
    prompt: str | None = None,
    prompt_tokens: list[int] | None = None,
    sampling: SamplingParams | None = None,
    request_id: str | None = None,
    timeout: float = 120.0,
    text_deltas: bool = True,
) -> AsyncIterator[Tokens | Finish]:
    """Send one GENERATE and yield its TOKENS then FINISH; RequestFailed on ERROR.

    With `text_deltas` (GENERATE's `stream`), each TOKENS carries its new text; without, TOKENS
    carry ids only and FINISH the whole text. Closing the generator early sends ABORT.
    """
    rid = request_id or uuid.uuid4().hex[:16]
    channel = await asyncio.wait_for(connect(socket_path), timeout)
    done = False
    try:
        await channel.send(
            Generate(
                sampling=sampling or SamplingParams(),
                prompt=prompt,
                prompt_tokens=prompt_tokens,
                request_id=rid,
                stream=text_deltas,
            )
        )
        while True:
            msg = await asyncio.wait_for(channel.recv(), timeout)
            if isinstance(msg, Error):
                done = True
                raise RequestFailed(msg.code, msg.message, msg.request_id)
            if not isinstance(msg, Tokens | Finish):
                raise ProtocolError(f"unexpected {msg.TYPE.name} on the client socket")
            if isinstance(msg, Finish):
                done = True
            yield msg
            if done:
                return
    finally:
        try:
            if not done and not channel.closed:
                with contextlib.suppress(OSError):
                    await channel.send(Abort(request_id=rid))
        finally:
            channel.close()  # also when the ABORT's send is cancelled: closing aborts too


async def generate(socket_path: str, **kwargs) -> Result:  # type: ignore[no-untyped-def]
    """Run one request to completion (see `stream` for the arguments); the text is sent whole
    at the end unless `text_deltas=True` is given."""
    kwargs.setdefault("text_deltas", False)
    result: Result | None = None
    async for msg in stream(socket_path, **kwargs):
        if result is None:
            result = Result(request_id=msg.request_id)
        if isinstance(msg, Tokens):
            result.tokens.extend(msg.tokens)
            result.text += msg.text
        else:
            result.text += msg.text
            result.finish = msg
    assert result is not None
    return result


async def status(socket_path: str, timeout: float = 2.0) -> StatusReply:
    """Ask a daemon (prefill client socket or decode link socket) for its status."""
    channel = await asyncio.wait_for(connect(socket_path), timeout)
    try:
        await channel.send(Status())
        reply = await asyncio.wait_for(channel.recv(), timeout)
    finally:
        channel.close()
    if not isinstance(reply, StatusReply):
        raise ProtocolError(f"expected STATUS_REPLY, got {reply.TYPE.name}")
    return reply
