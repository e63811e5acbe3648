"""The Python client of a prefill daemon's socket, at its natural import path (`pdkv.client`).

The request loop itself lives in `common.client`, below both of its users: this CLI and the HTTP
API (`api_server`), which must not import the application above it.
"""

from common.client import (
    Connection,
    Finish,
    RequestFailed,
    Result,
    Tokens,
    generate,
    status,
    stream,
)

__all__ = [
    "Connection",
    "Finish",
    "RequestFailed",
    "Result",
    "Tokens",
    "generate",
    "status",
    "stream",
]
