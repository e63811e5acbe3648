"""Over 10,000 bad bad_frames on real sockets against running daemons, from many connections at once.

Afterwards both daemons are alive, no block is leaked, their fd counts are back where they were
and a valid request still equals the single-process reference. Seeded: a failure replays.
"""

from __future__ import annotations

import array
import asyncio
import os
import random
import socket
from collections.abc import Iterator

import msgspec
import pytest

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from common.protocol import PROTOCOL_VERSION, Error, Hello, Register, decode, encode
from tests.support import bad_frames
from tests.support.daemons import FaultPair, all_free, new_pair
from tests.support.fakes import FakePrefill
from tests.support.wait import poll

SEED = 20261130
CONCURRENCY = 12
EOF_TIMEOUT = 10.0  # a daemon that does not close a connection we closed is a bug


@pytest.fixture(scope="module")
def fpair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultPair]:
    pair = new_pair(tmp_path_factory, "fuzz")
    pair.start_both()
    yield pair
    pair.kill_all()


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return load_model(None)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Fuzzer:
    """Writes frame lists on fresh connections; counts bad_frames written and connections closed."""

    def __init__(self, pair: FaultPair, fake: FakePrefill) -> None:
        self.pair = pair
        self.fake = fake
        self.frames = 0
        self.connections = 0
        self.hung: list[str] = []
        self.sem = asyncio.Semaphore(CONCURRENCY)

    async def session(
        self, path: str, chunks: list[bytes], *, fds: list[int] | None = None, what: str = ""
    ) -> bytes:
        """Connect, write `chunks` (fds with the first), half-close, read to EOF (bounded)."""
        loop = asyncio.get_running_loop()
        async with self.sem:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            got = bytearray()
            try:
                await loop.sock_connect(sock, path)
                for i, chunk in enumerate(chunks):
                    if i == 0 and fds:
                        sock.sendmsg(
                            [chunk], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                        )
                    else:
                        await loop.sock_sendall(sock, chunk)
                    self.frames += 1
                sock.shutdown(socket.SHUT_WR)
                async with asyncio.timeout(EOF_TIMEOUT):
                    while data := await loop.sock_recv(sock, 65536):
                        got += data
            except TimeoutError:
                self.hung.append(what)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon closed first: fine
            finally:
                sock.close()
                for fd in fds or []:
                    os.close(fd)
                self.connections += 1
            return bytes(got)

    def hello(self) -> bytes:
        return encode(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                fingerprint=self.fake.fingerprint,
                backend="shm",
                pid=os.getpid(),
                name="fuzz",
            )
        )

    def register(self) -> bytes:
        fds = self.fake.region.fds()
        return encode(
            Register.build(self.fake.layout.to_wire(), [self.fake.region.desc], [len(fds)], [])
        )

    async def linked(self, rng: random.Random, n: int) -> None:
        """A real HELLO + REGISTER (memfd attached), then `n` bad_frames of bad meaning, then garbage."""
        path = self.pair.link_socket
        async with self.sem:
            loop = asyncio.get_running_loop()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, path)
                await loop.sock_sendall(sock, self.hello())
                await _read_frame(loop, sock)
                fd = os.dup(self.fake.region.fds()[0])
                try:
                    sock.sendmsg(
                        [self.register()],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                    )
                finally:
                    os.close(fd)
                await _read_frame(loop, sock)
                self.frames += 2
                body = bad_frames.link_after_handshake(rng, n, self.fake.layout.num_blocks)
                body.append(bad_frames.terminal(rng, link=True))
                for chunk in body:
                    await loop.sock_sendall(sock, chunk)
                    self.frames += 1
                sock.shutdown(socket.SHUT_WR)
                async with asyncio.timeout(EOF_TIMEOUT):
                    while await loop.sock_recv(sock, 65536):
                        pass
            except TimeoutError:
                self.hung.append("linked")
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                sock.close()
                self.connections += 1


async def _read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    buf = b""
    async with asyncio.timeout(EOF_TIMEOUT):
        while len(buf) < 20 or len(buf) < 20 + sum(bad_frames.HDR.unpack(buf[:20])[3:]):
            data = await loop.sock_recv(sock, 65536)
            if not data:
                raise ConnectionResetError("closed during the handshake")
            buf += data
    return buf


def _fd_pair() -> list[int]:
    r, w = os.pipe()
    return [r, w]


async def _fuzz(fz: Fuzzer) -> None:
    rng = random.Random(SEED)
    cs, ls = fz.pair.client_socket, fz.pair.link_socket
    jobs = []
    for i in range(2600):  # client socket: one bad frame ends the connection
        pre = [bad_frames.encode(bad_frames.Status())] if i % 5 == 0 else []
        fds = _fd_pair() if i % 17 == 0 else None
        jobs.append(fz.session(cs, [*pre, bad_frames.terminal(rng, link=False)], fds=fds, what="c"))
    for _ in range(100):  # client socket: answered, and the connection stays open
        body = [*bad_frames.client_keepalive(rng, 30), bad_frames.terminal(rng, link=False)]
        jobs.append(fz.session(cs, body, what="client-keepalive"))
    for i in range(2400):  # link socket before or during the handshake
        r = i % 6
        if r == 0:  # valid HELLO, then a bad frame
            chunks = [fz.hello(), bad_frames.terminal(rng, link=True)]
        elif r == 1:  # out-of-order: HANDOFF or REGISTER before HELLO, REGISTER twice
            chunks = [bad_frames.encode(bad_frames._handoff(rng))] if i % 2 else [fz.register()] * 2
        else:
            chunks = [bad_frames.terminal(rng, link=True)]
        fds = _fd_pair() if i % 13 == 0 else None
        jobs.append(fz.session(ls, chunks, fds=fds, what="l"))
    for _ in range(160):
        jobs.append(fz.linked(rng, 15))
    random.Random(SEED + 1).shuffle(jobs)
    await asyncio.gather(*jobs)


def test_10000_bad_frames_leave_both_daemons_healthy(fpair: FaultPair, tiny) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    warm = asyncio.run(client.generate(fpair.client_socket, prompt_tokens=prompt, sampling=params))
    assert warm.tokens == reference.generate(model, prompt, params, block_size=16)
    pids = {r: d.proc.pid for r, d in fpair.daemons.items()}
    fds_before = {r: fd_count(p) for r, p in pids.items()}

    fz = Fuzzer(fpair, FakePrefill(model))
    try:
        asyncio.run(_fuzz(fz))
    finally:
        fz.fake.close()
    assert fz.frames >= 10_000, fz.frames
    assert not fz.hung, f"{len(fz.hung)} connections never closed by the daemon: {fz.hung[:5]}"
    for role, d in fpair.daemons.items():
        assert d.proc.poll() is None, f"{role} died:\n{d.log_text()[-3000:]}"
    poll(
        lambda: all_free(fpair.client_socket) and all_free(fpair.link_socket),
        what="both pools free after the fuzz",
    )
    poll(
        lambda: all(fd_count(p) <= fds_before[r] for r, p in pids.items()),
        what=f"fd counts back to {fds_before}",
        timeout=15,
    )
    res = asyncio.run(client.generate(fpair.client_socket, prompt_tokens=prompt, sampling=params))
    assert res.tokens == warm.tokens
    for d in fpair.daemons.values():
        assert "Traceback" not in d.log_text(), d.log_text()[-3000:]


def _register_with(fake: FakePrefill, **region_over: object) -> bytes:
    fds = fake.region.fds()
    reg = Register.build(fake.layout.to_wire(), [fake.region.desc], [len(fds)], [])
    region = msgspec.structs.replace(reg.regions[0], **region_over)
    return encode(msgspec.structs.replace(reg, regions=[region]))


async def _refused_register(path: str, hello: bytes, register: bytes, fd: int) -> bytes:
    """HELLO, then a REGISTER the decode must refuse, with `fd` attached; returns its answer."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, path)
        await loop.sock_sendall(sock, hello)
        await _read_frame(loop, sock)
        sock.sendmsg([register], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        return await _read_frame(loop, sock)
    except ConnectionResetError:
        return b""  # closed without an answer
    finally:
        sock.close()
        os.close(fd)


@pytest.mark.parametrize(
    ("case", "over"),
    [("unknown kind", {"kind": "bogus"}), ("fd too small", {}), ("unsealed memfd", {})],
)
def test_register_that_cannot_be_opened_is_refused_without_leaking(
    fpair: FaultPair, tiny, case, over
) -> None:  # type: ignore[no-untyped-def]
    fake = FakePrefill(tiny[0])
    pid = fpair.daemons["decode"].proc.pid
    before = fd_count(pid)
    try:
        hello = Fuzzer(fpair, fake).hello()
        if case == "fd too small":
            fd = os.memfd_create("small")
        elif case == "unsealed memfd":  # the right size, but a shrink could crash the decode
            fd = os.memfd_create("unsealed")
            os.ftruncate(fd, os.fstat(fake.region.fds()[0]).st_size)
        else:
            fd = os.dup(fake.region.fds()[0])
        answer = asyncio.run(
            _refused_register(fpair.link_socket, hello, _register_with(fake, **over), fd)
        )
    finally:
        fake.close()
    poll(lambda: fd_count(pid) <= before, what=f"decode fd count back to {before}", timeout=5)
    assert answer, f"{case}: the decode closed the link without an ERROR frame"
    msg = decode(answer)
    assert isinstance(msg, Error) and msg.code in ("BAD_REQUEST", "INCOMPATIBLE"), msg
