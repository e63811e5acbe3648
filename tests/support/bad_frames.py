"""Seeded generators of bad frames for the client socket (prefill) and the link socket (decode).

Each generator returns a list of byte strings to write on one connection; `fds` marks the ones
that carry a file descriptor. Kinds: random bytes, valid frames with mutated bytes, wrong magic,
version or type, oversized length fields, truncated frames, out-of-order messages, JSON of the
wrong shape or invalid UTF-8, and (where the daemon keeps reading) valid frames of bad meaning.
"""

from __future__ import annotations

import random
import struct

from common.model.sampling import SamplingParams
from common.protocol import (
    MAX_META_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Error,
    ErrorCode,
    Generate,
    Handoff,
    Hello,
    Ping,
    Pong,
    Register,
    Release,
    Status,
    Tokens,
    encode,
)

HDR = struct.Struct("!4sHHIII")


def raw(
    mtype: int,
    meta: bytes,
    *,
    magic: bytes = b"PDKV",
    version: int = 1,
    lens: tuple[int, int, int] | None = None,
    tail: bytes = b"",
) -> bytes:
    m, a, b = lens or (len(meta), 0, 0)
    return HDR.pack(magic, version, mtype, m, a, b) + meta + tail


def mutate(rng: random.Random, frame: bytes) -> bytes:
    buf = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(buf))
        buf[i] = rng.randrange(256)
    return bytes(buf)


def _gen(rng: random.Random, **over: object) -> bytes:
    fields: dict = {"sampling": SamplingParams(max_tokens=2), "prompt_tokens": [1, 2, 3], **over}
    return encode(Generate(**fields))


def _handoff(rng: random.Random) -> Handoff:
    return Handoff(
        request_id=f"h{rng.randrange(10**6)}",
        block_ids=[0],
        num_tokens=3,
        prompt_tokens=[1, 2, 3],
        first_token=4,
        sampling=SamplingParams(max_tokens=2),
    )


def terminal(rng: random.Random, link: bool) -> bytes:
    """One frame (or fragment) after which the daemon closes the connection."""
    kind = rng.randrange(11)
    base = (
        _gen(rng)
        if not link
        else encode(
            Hello(protocol_version=PROTOCOL_VERSION, fingerprint="0" * 16, backend="shm", pid=1)
        )
    )
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:
        return mutate(rng, base)
    if kind == 2:
        return raw(21, b"{}", magic=rng.choice([b"PDKW", b"\0\0\0\0", b"pdkv", b"GET "]))
    if kind == 3:
        return raw(21, b"{}", version=rng.choice([0, 2, 3, 255, 65535]))
    if kind == 4:
        return raw(rng.choice([0, 13, 19, 23, 99, 65535]), b"{}")
    if kind == 5:  # oversized length fields
        lens = rng.choice(
            [(MAX_META_BYTES + 1, 0, 0), (2, 2**20, 0), (2, 0, 2**20), (2**32 - 1, 0, 0), (2, 8, 0)]
        )
        return raw(rng.choice([20, 21, 3]), b"{}", lens=lens)
    if kind == 6:  # truncated, then close
        return base[: rng.randrange(1, len(base))]
    if kind == 7:  # out of order
        msgs = [
            Release(request_id="x"),
            Tokens(request_id="x", tokens=[1]),
            Pong(seq=1),
            Register(layout={}, regions=[]),
        ]
        msgs += (
            [Hello(protocol_version=PROTOCOL_VERSION, fingerprint="f", backend="shm", pid=1)]
            if not link
            else [
                _handoff(rng),
                Abort(request_id="x"),
                Generate(sampling=SamplingParams(), prompt="x"),
            ]
        )
        return encode(rng.choice(msgs))
    if kind == 8:  # JSON of the wrong shape
        metas = [
            b'{"sampling": 5, "prompt": "x"}',
            b'{"prompt": ["x"], "sampling": {}}',
            b'{"sampling": {}, "prompt": "x", "evil": 1}',
            b"[]",
            b"null",
            b'"s"',
            b'{"sampling": {"max_tokens": "2"}, "prompt": "x"}',
            b"{" * 50,
        ]
        mtype = 1 if link else 20
        if link:
            metas += [b'{"protocol_version": "1", "fingerprint": 1, "backend": "shm", "pid": 1}']
        return raw(mtype, rng.choice(metas))
    if kind == 9:  # invalid UTF-8 inside JSON strings
        return raw(1 if link else 20, b'{"sampling": {}, "prompt": "\xff\xfe\xc3("}')
    return raw(2 if link else 10, b'{"code": "NOPE", "message": 3}')  # a bad ERROR


def client_keepalive(rng: random.Random, n: int) -> list[bytes]:
    """Frames of bad meaning the prefill answers and keeps reading after."""
    out = []
    for _ in range(n):
        k = rng.randrange(8)
        if k == 0:
            out.append(
                _gen(
                    rng,
                    request_id=f"k{rng.randrange(10**9)}",
                    sampling=SamplingParams(max_tokens=rng.choice([0, -5])),
                )
            )
        elif k == 1:
            out.append(encode(Generate(sampling=SamplingParams(temperature=-1.0), prompt="x")))
        elif k == 2:
            out.append(encode(Generate(sampling=SamplingParams(top_p=0.0), prompt="x")))
        elif k == 3:
            out.append(encode(Generate(sampling=SamplingParams(), prompt_tokens=[])))
        elif k == 4:
            out.append(encode(Generate(sampling=SamplingParams(), prompt_tokens=[10**6])))
        elif k == 5:
            out.append(encode(Generate(sampling=SamplingParams(), prompt="x", prompt_tokens=[1])))
        elif k == 6:
            out.append(encode(Abort(request_id=f"nope{rng.randrange(10**6)}")))
        else:
            out.append(encode(Status()))
    return out


def link_after_handshake(rng: random.Random, n: int, pool_blocks: int) -> list[bytes]:
    """Frames of bad meaning the decode answers and keeps reading after (on an established link)."""
    out = []
    for _ in range(n):
        k = rng.randrange(9)
        h = _handoff(rng)
        if k == 0:
            h = Handoff(**{**_fields(h), "block_ids": [pool_blocks + rng.randrange(100)]})
        elif k == 1:
            h = Handoff(**{**_fields(h), "block_ids": [0, 0]})
        elif k == 2:
            h = Handoff(**{**_fields(h), "num_tokens": 40})
        elif k == 3:
            h = Handoff(**{**_fields(h), "first_token": 10**6})
        elif k == 4:
            h = Handoff(**{**_fields(h), "sampling": SamplingParams(max_tokens=0)})
        elif k == 5:
            h = Handoff(**{**_fields(h), "event_slot": 3})
        elif k == 6:
            out.append(encode(Abort(request_id=f"nope{rng.randrange(10**6)}")))
            continue
        elif k == 7:
            out.append(encode(Ping(seq=rng.randrange(10**6))))
            continue
        else:
            out.append(encode(Error(code=ErrorCode.INTERNAL, message="fuzz")))
            continue
        out.append(encode(h))
    return out


def _fields(h: Handoff) -> dict:
    return {f: getattr(h, f) for f in h.__struct_fields__}
