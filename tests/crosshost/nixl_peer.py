"""A prefill-side NixlProducer in its own process, driven over a multiprocessing pipe: the other
end of the NIXL sides' tests (two real agents in two processes, CPU pools)."""

from __future__ import annotations

import asyncio
from multiprocessing.connection import Connection

import torch

from common.allocator import BlockAllocator
from common.kvpool import KVPool, PoolLayout
from common.protocol import Message, Registered, decode, encode
from common.transfer.nixl_sides import NixlProducer

LAYOUT = PoolLayout(
    num_blocks=24, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"
)


def pattern(layout: PoolLayout, seed: int) -> torch.Tensor:
    """The prefill pool's contents: every element distinct, a function of `seed`."""
    n = layout.nbytes // layout.torch_dtype.itemsize
    return (torch.arange(n, dtype=torch.float32) + seed * 1e6).reshape(layout.shape)


def serve(conn: Connection, transfer: str, seed: int) -> None:
    """Answer the parent: "register" → REGISTER frame, ("registered", frame) → connect,
    ("push", frame) → the WRITE (PUSH_FAILED frames come back), "stop"."""
    asyncio.run(_serve(conn, transfer, seed))


async def _serve(conn: Connection, transfer: str, seed: int) -> None:
    loop = asyncio.get_running_loop()
    pool = KVPool.create(LAYOUT)
    pool.tensor.copy_(pattern(LAYOUT, seed))
    producer = NixlProducer(pool, BlockAllocator(LAYOUT.num_blocks), transfer=transfer, loop=loop)

    def reply(msg: Message) -> None:
        conn.send(("frame", encode(msg)))

    try:
        while True:
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                return
            if cmd == "register":
                conn.send(("frame", encode(producer.register()[0])))
            elif cmd == "registered":
                msg = decode(arg)
                assert isinstance(msg, Registered)
                producer.connected(msg)
                conn.send(("ok", None))
            elif cmd == "push":
                producer.push(decode(arg), reply)  # type: ignore[arg-type]
    finally:
        producer.close()
