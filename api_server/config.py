"""ApiConfig: everything `pdkv api start` takes, checked once at construction."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from common.rundir import StartupError

#: max_tokens of a request that sets none: OpenAI's default for /v1/completions, and for chat
#: (whose answers run longer) CHAT_DEFAULT_MAX_TOKENS; docs/operations.md documents both.
COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 256
#: The largest request body (413 beyond): a prompt of a quarter of a million tokens or more,
#: and half the daemons' frame bound (MAX_META_BYTES), which a GENERATE must fit in.
MAX_BODY_BYTES = 2 * 2**20
#: A body over the limit but under this is read to its end before the 413 (see app.read_body).
DISCARD_BYTES = 64 * 2**20


def is_loopback(host: str) -> bool:
    """True for localhost and every address in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, kw_only=True)
class ApiConfig:
    """How the API server listens and which daemons it fronts.

    Binding an address other than loopback needs `api_key` (StartupError otherwise): the daemons'
    sockets are protected by SO_PEERCRED, and the HTTP port must not open them to the network.
    """

    runtime_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    client_socket: Path | None = None
    link_socket: Path | None = None
    model: Path | None = None
    served_model_name: str | None = None
    request_timeout_s: float = 120.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.api_key is not None:  # a blank PDKV_API_KEY is no key
            object.__setattr__(self, "api_key", self.api_key.strip() or None)
        if not is_loopback(self.host) and not self.api_key:
            raise StartupError(
                f"--host {self.host} is not a loopback address: set --api-key (or PDKV_API_KEY) so "
                "that only clients holding the key can generate"
            )
        if self.model is not None and not self.model.is_dir():
            raise StartupError(f"--model {self.model} is not a directory")

    @property
    def prefill_path(self) -> Path:
        return self.client_socket or self.runtime_dir / "prefill.sock"

    @property
    def decode_path(self) -> Path:
        return self.link_socket or self.runtime_dir / "decode.sock"

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "api.pid"

    @property
    def urlfile(self) -> Path:
        """Where the running API writes its base URL (for `pdkv status`)."""
        return self.runtime_dir / "api.url"


def base_url(host: str, port: int) -> str:
    """http://HOST:PORT, an IPv6 address in brackets."""
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
