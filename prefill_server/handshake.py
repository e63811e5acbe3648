"""The prefill's side of a link's handshake, and what it needs at startup.

HELLO (our fingerprint; on a TCP link our nonce) → HELLO_OK (on a TCP link the decode's nonce
and key proof, checked here before the decode learns anything of our pool) → REGISTER (the
producer's payload; on a TCP link our proof) → REGISTERED, which the producer takes
(`connected`). The producer is the transport's of `--decode`'s link kind
(common.transfer.registry): nothing here names a transport.
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import structlog

from common.daemon.runtime import ModelRuntime
from common.errors import PdkvError, ProtocolError
from common.protocol import Error, ErrorCode, Hello, HelloOk, Registered, make_error
from common.transfer import Producer
from common.transfer.registry import TCP, ProducerSettings, link_kind, transport
from common.wire.channel import FrameChannel
from common.wire.tcplink import TcpSettings, new_nonce, proof, proof_ok, tcp_settings
from prefill_server.config import PrefillConfig

log = structlog.get_logger(__name__)


class LinkRefused(PdkvError):
    """The decode daemon refused our HELLO or REGISTER (e.g. INCOMPATIBLE)."""


def check_decode_option(cfg: PrefillConfig) -> dict[str, TcpSettings | None]:
    """Every --decode checked (PdkvError saying what to do): its address → its TCP settings
    (None for a Unix socket). One kind for all of them (one producer per process, with a peer
    per link), none twice."""
    addresses = cfg.decode_addresses
    seen: set[str] = set()
    for address in addresses:
        key = address if link_kind(address) == TCP else os.path.abspath(address)
        if key in seen:
            raise PdkvError(f"--decode {address} is given twice: name each decode daemon once")
        seen.add(key)
    kinds = {link_kind(a) for a in addresses}
    if len(kinds) > 1:
        raise PdkvError(
            "--decode mixes Unix sockets and tcp:// addresses: one prefill daemon's decodes are "
            "all on this host or all across hosts, as its KV producer is one transport's (an "
            "event ring and early handoffs on this host, NIXL across hosts); run a second "
            "prefill daemon for the others"
        )
    for kind in kinds:
        transport(kind)  # PdkvError naming the kinds there are
    if kinds == {TCP}:
        targets = {a: tcp_settings(a, cfg.link_key_file, "--decode") for a in addresses}
        transport(TCP).check()
        return targets
    return dict.fromkeys(addresses)


def make_producer(cfg: PrefillConfig, rt: ModelRuntime) -> Producer:
    """The producer of the transport the --decode links use (one kind: check_decode_option)."""
    settings = ProducerSettings(
        backend=rt.backend,
        event_slots=cfg.event_slots,
        transfer=cfg.transfer,
        mailbox=cfg.early_handoff and cfg.launch_early,
    )
    kind = transport(link_kind(cfg.decode_addresses[0]))
    if kind.kind == TCP and cfg.transfer == "pull":
        log.warning(
            "nixl_pull_is_slow_here",
            hint="the decode READs over NIXL: where UCX has no RDMA transport (it fell back to "
            "TCP) a READ ran at ~0.5 GB/s, a 2nd token 109 ms behind; --transfer push WRITEs "
            "at hundreds of GB/s there (docs/operations.md, 'Across hosts')",
        )
    return kind.producer(rt.pool, rt.allocator, settings, asyncio.get_running_loop())


async def handshake(
    channel: FrameChannel,
    hello: Hello,
    producer: Producer,
    tcp: TcpSettings | None,
    timeout: float,
) -> tuple[HelloOk, Registered]:
    """Run the handshake on a new connection: the decode's HELLO_OK and REGISTERED, for the
    producer's `connected` under the link's id (the caller names it). LinkRefused when the
    decode (or our check of it) refuses, ProtocolError on a wrong frame."""
    nonce = new_nonce() if tcp is not None else ""
    await channel.send(msgspec.structs.replace(hello, nonce=nonce))
    async with asyncio.timeout(timeout):
        ok = await channel.recv()
    if isinstance(ok, Error):
        if ok.code == ErrorCode.AUTH_FAILED:
            log.error("link_auth_failed", error=ok.message, by="decode")
        raise LinkRefused(f"decode refused the link ({ok.code}): {ok.message}")
    if not isinstance(ok, HelloOk):
        raise ProtocolError(f"expected HELLO_OK, got {ok.TYPE.name}")
    reg, fds = producer.register()
    if tcp is not None:
        await _check_decode_proof(channel, tcp, nonce, ok)
        reg = msgspec.structs.replace(reg, proof=proof(tcp.key, "prefill", nonce, ok.nonce))
    await channel.send(reg, fds)
    async with asyncio.timeout(timeout):
        done = await channel.recv()
    if isinstance(done, Error):
        raise LinkRefused(f"decode refused REGISTER ({done.code}): {done.message}")
    if not isinstance(done, Registered):
        raise ProtocolError(f"expected REGISTERED, got {done.TYPE.name}")
    return ok, done


async def _check_decode_proof(
    channel: FrameChannel, tcp: TcpSettings, nonce: str, ok: HelloOk
) -> None:
    """The decode must prove the key before it learns anything of our pool; if it cannot,
    tell it (ERROR AUTH_FAILED, so its log says why too) and refuse the link."""
    if proof_ok(tcp.key, "decode", nonce, ok.nonce, ok.proof):
        return
    why = "the decode's key proof is wrong: the two daemons' --link-key-file differ"
    log.error("link_auth_failed", error=why, by="prefill")
    await channel.send(make_error(ErrorCode.AUTH_FAILED, why))
    raise LinkRefused(why)


__all__ = [
    "LinkRefused",
    "check_decode_option",
    "handshake",
    "make_producer",
]
