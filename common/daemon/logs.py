"""structlog set-up for both daemons and the CLI.

Console rendering on a terminal, JSON lines otherwise or when asked (`--log-format json`). Request
lines carry `request_id` because callers bind it (`log.bind(request_id=...)`); nothing here prints.

No peer sizes the log: every string field of every line is cut to MAX_FIELD_CHARS (a traceback to
MAX_EXCEPTION_CHARS) before it is rendered, so a 3 MB fingerprint or error message from a peer
costs a few hundred bytes of log, whichever log call it reaches.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["auto", "console", "json"]

#: Longest string field in a log line (peer-supplied text included); longer ones are cut.
MAX_FIELD_CHARS = 300
#: Longest rendered traceback in a log line.
MAX_EXCEPTION_CHARS = 8000


def clip(text: str, limit: int = MAX_FIELD_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was when it is cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text)} chars]"


def clip_fields(_logger: object, _method: str, event: dict) -> dict:  # type: ignore[type-arg]
    """structlog processor: every str/bytes field bounded (see MAX_FIELD_CHARS)."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = clip(value, MAX_EXCEPTION_CHARS if key == "exception" else MAX_FIELD_CHARS)
        elif isinstance(value, bytes | bytearray):
            event[key] = clip(repr(bytes(value[: MAX_FIELD_CHARS + 1])))
    return event


def configure(fmt: LogFormat = "auto", level: str = "INFO", *, stream=None) -> None:  # type: ignore[no-untyped-def]
    """Configure structlog once per process; `stream` defaults to stderr."""
    stream = stream or sys.stderr
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer: structlog.typing.Processor
    if use_console:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            clip_fields,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        # one write() per line (print() makes two: the line, then "\n"), so that processes
        # sharing a log file (an API's workers) never interleave inside a line
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=True,  # loggers bind on first use, after this ran
    )
