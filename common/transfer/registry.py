"""Transports by link kind: the one place a daemon gets its producer and its consumers from.

    transport = registry.transport(registry.link_kind(address))   # "unix" or "tcp"
    transport.check()                                               # at startup: installed?
    producer = transport.producer(pool, allocator, settings, loop)  # the prefill's, once
    side = transport.consumer_side(pool, loop)                      # the decode's, once
    consumer = side.open(register, take_fds, post)                  # per link, from REGISTER

A `Transport` builds a transport's producer and, once per daemon, its `ConsumerSide`: what every
link of that kind shares on the decode (the pull stream on CUDA, the NIXL agent registered over
the pool once), which opens a consumer per link. The daemons hold the interface's Producer and
Consumer and read their `caps`; they never name a transport class.

Adding a transport is one module with a Transport subclass and one `register(kind, module,
class)` line below. Modules are imported when their kind is first asked for, so NIXL is loaded
only by a daemon with a TCP link: a machine without the nixl wheel runs everything on the Unix
socket.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from common.errors import PdkvError
from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool
from common.protocol import Message, Register
from common.transfer.interface import Consumer, Producer

UNIX = "unix"
TCP = "tcp"
TakeFds = Callable[[int], list[int]]


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    """What a producer may be configured with; each transport reads what it uses."""

    backend: str | None = None  # IPC: the region backend (None: the device's default)
    event_slots: int = 0  # IPC on CUDA: the event ring's size
    transfer: str = "push"  # NIXL: "push" (the prefill WRITEs) or "pull" (the decode READs)
    mailbox: bool = False  # IPC on CUDA: a first-token mailbox for KV_LAUNCHED (v12)


class ConsumerSide(ABC):
    """One daemon's resources for the consumers of one transport, shared by its links."""

    #: for logs: what the side runs on (the agent's name, the pull stream)
    name: str = ""

    @abstractmethod
    def open(self, reg: Register, take_fds: TakeFds, post: Callable[[Message], None]) -> Consumer:
        """A consumer for the link whose REGISTER this is: TransferRefused with the ERROR to
        answer when it cannot be honoured. `take_fds(n)` gives the fds that came with the
        frame; `post` sends a frame to the peer (a transport with frames of its own)."""

    def close(self) -> None:
        """After every link of this kind ended; idempotent."""
        return None


class Transport(ABC):
    """A producer/consumer pair for one link kind."""

    kind: str
    #: both daemons run on one host (clocks and memory shared); False across hosts
    same_host: bool = True

    def check(self) -> None:
        """At startup, before any work: PdkvError saying what to install when the transport
        cannot run here."""
        return None

    @abstractmethod
    def producer(
        self,
        pool: KVPool,
        allocator: BlockAllocator,
        settings: ProducerSettings,
        loop: asyncio.AbstractEventLoop,
    ) -> Producer: ...

    @abstractmethod
    def consumer_side(self, pool: KVPool, loop: asyncio.AbstractEventLoop) -> ConsumerSide: ...


_registered: dict[str, tuple[str, str]] = {}
_loaded: dict[str, Transport] = {}


def register(kind: str, module: str, class_name: str) -> None:
    """Make `kind` links use `module`'s Transport subclass `class_name` (imported when first
    asked for)."""
    if kind in _registered and _registered[kind] != (module, class_name):
        raise PdkvError(f"link kind {kind!r} is registered already")
    _registered[kind] = (module, class_name)


def transport(kind: str) -> Transport:
    """The Transport of link kind `kind`; PdkvError naming the kinds there are."""
    if kind not in _loaded:
        try:
            module, class_name = _registered[kind]
        except KeyError:
            raise PdkvError(f"no transport for {kind!r} links (there are: {kinds()})") from None
        cls = getattr(importlib.import_module(module), class_name)
        if not (isinstance(cls, type) and issubclass(cls, Transport)) or cls.kind != kind:
            raise PdkvError(f"{module}.{class_name} is not a Transport for {kind!r} links")
        _loaded[kind] = cls()
    return _loaded[kind]


def kinds() -> list[str]:
    return sorted(_registered)


def link_kind(address: str | None) -> str:
    """The kind of a link to `address`: "unix" for a socket path (or None, the local socket),
    else the address's scheme (`tcp://HOST:PORT` → "tcp")."""
    if address is None or "://" not in address:
        return UNIX
    return urlsplit(address).scheme


register(UNIX, "common.transfer.unix_transport", "UnixTransport")
register(TCP, "common.transfer.nixl_transport", "NixlTransport")

__all__ = [
    "TCP",
    "UNIX",
    "ConsumerSide",
    "ProducerSettings",
    "TakeFds",
    "Transport",
    "kinds",
    "link_kind",
    "register",
    "transport",
]
