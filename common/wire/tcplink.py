"""Links across hosts: `tcp://HOST:PORT` addresses, their sockets, and the key both ends prove.

Contract:
- `parse_tcp(url)` → (host, port), ValueError naming the expected form otherwise.
- `load_link_key(path)` reads the shared secret: a regular file, mode 0600 or stricter (no group
  or other bits), at least MIN_KEY_BYTES bytes after stripping whitespace; PdkvError otherwise.
- `tcp_settings(address, key_file, option)` is the startup check of a TCP link's address and
  key: the address parses, a key file is given and loads; PdkvError with what to do otherwise.
  (Whether the transport that moves the KV over such a link can run is the transport's own
  check: `common.transfer.registry.transport("tcp").check()`; this module is the wire layer
  and knows no transport.)
- The handshake (docs/protocol.md, "Links across hosts"): the prefill's HELLO carries its nonce,
  HELLO_OK the decode's nonce and `proof(key, "decode", ...)`, the prefill's REGISTER
  `proof(key, "prefill", ...)`. Each side checks the other's with `proof_ok` (constant time) and
  sends nothing about its pool before the other end proved the key.
- `listen_tcp` / `connect_tcp` give non-blocking sockets tuned by `tune`: no Nagle, keepalive and
  TCP_USER_TIMEOUT bounded by the heartbeat timeout, so a peer host that vanished without a FIN
  fails writes as well as the heartbeat.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from common.errors import PdkvError

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096
NONCE_BYTES = 32
_CONTEXT = b"pdkv-link-v3"


@dataclass(frozen=True)
class TcpSettings:
    host: str
    port: int
    key: bytes


def parse_tcp(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` (IPv6 as `tcp://[::1]:PORT`) → (host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path:
        raise ValueError(f"expected tcp://ADDRESS:PORT, got {url!r}")
    return parts.hostname, port


def load_link_key(path: Path) -> bytes:
    """The shared secret in `path` (see the module docstring for what is refused)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PdkvError(f"cannot read the link key file {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise PdkvError(f"the link key file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise PdkvError(
            f"the link key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: it must be "
            f"readable by its owner only (chmod 600 {path})"
        )
    if st.st_size > MAX_KEY_BYTES:
        raise PdkvError(f"the link key file {path} is over {MAX_KEY_BYTES} bytes")
    key = path.read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise PdkvError(
            f"the link key in {path} is {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "(e.g. `openssl rand -hex 32 > key; chmod 600 key`)"
        )
    return key


def tcp_settings(address: str, key_file: Path | None, option: str) -> TcpSettings:
    """Startup check of a TCP link option (`option` is its name, for the message)."""
    try:
        host, port = parse_tcp(address)
    except ValueError as exc:
        raise PdkvError(f"{option}: {exc}") from exc
    if key_file is None:
        raise PdkvError(
            f"{option} {address} needs --link-key-file: a TCP link is never unauthenticated"
        )
    return TcpSettings(host, port, load_link_key(key_file))


def new_nonce() -> str:
    return os.urandom(NONCE_BYTES).hex()


def proof(key: bytes, role: str, prefill_nonce: str, decode_nonce: str) -> str:
    """HMAC-SHA256 by `role` ("prefill" or "decode") over both nonces, hex."""
    msg = b"|".join((_CONTEXT, role.encode(), prefill_nonce.encode(), decode_nonce.encode()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def proof_ok(key: bytes, role: str, prefill_nonce: str, decode_nonce: str, got: str) -> bool:
    """Whether `got` is `role`'s proof; compared in constant time."""
    want = proof(key, role, prefill_nonce, decode_nonce)
    return hmac.compare_digest(want.encode(), got.encode("utf-8", "replace"))


def tune(sock: socket.socket, timeout_s: float) -> None:
    """No Nagle; keepalive probes and TCP_USER_TIMEOUT within `timeout_s` (at least 1 s)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    secs = max(1, int(timeout_s))
    for name, value in (("TCP_KEEPIDLE", secs), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout_s * 1000))


def listen_tcp(host: str, port: int, backlog: int = 64) -> socket.socket:
    """A non-blocking listening socket on exactly (host, port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise PdkvError(f"cannot listen on tcp://{host}:{port}: {exc.strerror or exc}") from exc
    return sock


async def connect_tcp(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connected, tuned, non-blocking socket to (host, port)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, addr)
        tune(sock, timeout_s)
    except BaseException:
        sock.close()
        raise
    return sock


def is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6)


__all__ = [
    "TcpSettings",
    "connect_tcp",
    "is_tcp",
    "listen_tcp",
    "load_link_key",
    "new_nonce",
    "parse_tcp",
    "proof",
    "proof_ok",
    "tcp_settings",
    "tune",
]
