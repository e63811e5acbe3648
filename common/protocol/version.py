"""Protocol version, its numbered history, and the compatibility fingerprint of the handshake."""

from __future__ import annotations

import hashlib
import json
from typing import Any

MAGIC = b"PDKV"

#: The version this build speaks. A peer with another version is refused at HELLO.
PROTOCOL_VERSION = 1

#: Every version ever shipped and what it changed. Append, never edit.
HISTORY: dict[int, str] = {
    1: "first version: HELLO..PONG on the link; GENERATE/STATUS on the client socket",
}

SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})


def fingerprint(*, model_id: str, layout: dict[str, Any], backend: str) -> str:
    """Compatibility hash compared at HELLO: model identity, pool layout less its size, backend.

    `layout` is PoolLayout.to_wire(); `num_blocks` is left out because the two daemons may size
    their pools differently — everything that shapes one block must match.
    """
    shape = {k: v for k, v in sorted(layout.items()) if k != "num_blocks"}
    canon = json.dumps({"model": model_id, "layout": shape, "backend": backend}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
