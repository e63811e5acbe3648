"""structlog set-up for both daemons and the CLI.

Console rendering on a terminal, JSON lines otherwise or when asked (`--log-format json`). Request
lines carry `request_id` because callers bind it (`log.bind(request_id=...)`); nothing here prints.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["auto", "console", "json"]


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
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,  # loggers bind on first use, after this ran
    )
