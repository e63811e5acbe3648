"""The other ends of the NIXL sides' tests, each in its own process (two real agents in two
processes, CPU pools), driven over a multiprocessing pipe:

- `serve`: a prefill's NixlProducer. Its pool holds `pattern(seed)`; on REGISTERED it is
  connected as link LINK, with blocks 0..N-3 leased to LINK, block N-2 leased to another link
  and block N-1 free (what a PUSH may name and what it may not). "allocate", "lease", "flush"
  and "end" play one request of an early handoff on block N-1: its forward runs, its KV is
  written (KV_READY), its first token went to the client, it ended. "writes" answers how many
  WRITEs the producer has posted: the child takes commands and PUSH frames in order, so the
  answer covers every PUSH sent before it (a WRITE not posted by then was held, or refused with
  a PUSH_FAILED that comes back first).
- `serve_decode`: a decode's pool and NixlAgent, the target of a prefill's WRITEs.

`Link` is the decode's end of one link to a `serve` process: a NixlConsumer here, PUSH frames
relayed to the child and its PUSH_FAILED frames handed back to the consumer.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import torch

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.protocol import Message, Push, Register, Registered, decode, encode
from common.transfer.nixl_agent import NixlAgent
from common.transfer.nixl_sides import NixlConsumer, NixlProducer

LAYOUT = PoolLayout(
    num_blocks=24, num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"
)
LINK = "link-t"


def pattern(layout: PoolLayout, seed: int) -> torch.Tensor:
    """The prefill pool's contents: every element distinct, a function of `seed`."""
    n = layout.nbytes // layout.torch_dtype.itemsize
    return (torch.arange(n, dtype=torch.float32) + seed * 1e6).reshape(layout.shape)


def serve(conn: Connection, transfer: str, seed: int, layout: PoolLayout = LAYOUT) -> None:
    """Answer the parent: "register" → REGISTER frame, ("registered", frame) → connect,
    ("push", frame) → the WRITE (PUSH_FAILED frames come back), "stop"."""
    asyncio.run(_serve(conn, transfer, seed, layout))


async def _serve(conn: Connection, transfer: str, seed: int, layout: PoolLayout) -> None:
    loop = asyncio.get_running_loop()
    pool = KVPool.create(layout)
    pool.tensor.copy_(pattern(layout, seed))
    alloc = BlockAllocator(layout.num_blocks)
    producer = NixlProducer(pool, alloc, transfer=transfer, loop=loop)
    writes = 0
    transfer_now = producer.agent.transfer

    def counted(op: str, *args: Any) -> None:
        nonlocal writes
        writes += op == "WRITE"
        transfer_now(op, *args)

    producer.agent.transfer = counted  # type: ignore[method-assign]
    alloc.allocate("mine", layout.num_blocks - 2)
    producer.lease("mine", LINK, float("inf"))
    alloc.allocate("theirs", 1)
    producer.lease("theirs", "link-other", float("inf"))

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
                producer.connected(msg, LINK)
                conn.send(("ok", None))
            elif cmd == "push":
                assert producer.handle_frame(decode(arg), reply, LINK)
            elif cmd == "allocate":  # a request whose forward runs: its blocks, not leased
                conn.send(("ids", alloc.allocate(arg, 1)))
            elif cmd == "lease":  # its KV written: what KV_READY follows
                producer.lease(arg, LINK, float("inf"))
                conn.send(("ok", None))
            elif cmd == "flush":  # its first token went to the client
                producer.flush(arg)
                conn.send(("ok", None))
            elif cmd == "writes":  # the WRITEs posted so far
                conn.send(("ok", writes))
            elif cmd == "end":  # it ended: forgotten, its blocks ours again
                producer.forget(arg)
                alloc.free(arg)
                conn.send(("ok", None))
    finally:
        producer.close()


def serve_decode(conn: Connection, layout: PoolLayout) -> None:
    """A decode's pool (zeros) and agent: sends its REGISTERED, then answers ("add", region) →
    the prefill's agent loaded, ("blocks", ids) → their contents, "stop"."""
    asyncio.run(_serve_decode(conn, layout))


async def _serve_decode(conn: Connection, layout: PoolLayout) -> None:
    loop = asyncio.get_running_loop()
    pool = KVPool.create(layout)
    # awaits no notification, so nothing of ours would drive UCX: NIXL's thread does
    agent = NixlAgent("decode", pool.tensor, loop, passive=True)
    try:
        conn.send(encode(Registered(num_blocks=layout.num_blocks, nixl=agent.region("push"))))
        while True:
            cmd, arg = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                return
            if cmd == "add":
                agent.add_peer(arg)
                conn.send("ok")
            elif cmd == "blocks":
                conn.send(pool.tensor[arg].clone())
    finally:
        agent.close()


class Child:
    """A spawned `serve`/`serve_decode` process and its pipe."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.loop = asyncio.get_running_loop()

    async def recv(self) -> Any:
        return await self.loop.run_in_executor(None, self.conn.recv)

    def pause(self) -> None:
        """SIGSTOP: a host that hangs (its agent answers nothing until `resume`)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.conn.send(("stop", None))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Link:
    """The decode's end of one link: a NixlConsumer over a `serve` child's pool."""

    def __init__(self, child: Child, reg: Register, local: KVPool, agent: NixlAgent) -> None:
        self.child, self.reg = child, reg
        self.local, self.agent = local, agent
        self.loop = asyncio.get_running_loop()
        self.consumer = NixlConsumer.open(reg, local, agent, self.post)

    @classmethod
    async def connect(
        cls, transfer: str, seed: int, local: KVPool, agent: NixlAgent, layout: PoolLayout = LAYOUT
    ) -> Link:
        """Start a prefill process with pool `pattern(seed)`, then REGISTER / REGISTERED."""
        child = Child(serve, transfer, seed, layout)
        child.conn.send(("register", None))
        kind, frame = await child.recv()
        reg = decode(frame)
        assert kind == "frame" and isinstance(reg, Register) and reg.nixl is not None
        link = cls(child, reg, local, agent)
        child.conn.send(("registered", encode(link.consumer.registered())))
        assert (await child.recv())[0] == "ok"
        return link

    @property
    def proc(self) -> Any:
        return self.child.proc

    def post(self, msg: Message) -> None:
        assert isinstance(msg, Push)
        self.child.conn.send(("push", encode(msg)))

    async def recv(self) -> tuple[str, object]:
        return await self.child.recv()

    async def pull(self, src: list[int], dst: list[int]) -> BaseException | None:
        fut: asyncio.Future[BaseException | None] = self.loop.create_future()
        self.consumer.pull(src, dst, -1, fut.set_result)
        return await asyncio.wait_for(fut, 30)

    async def close(self) -> None:
        await self.consumer.drain()
        self.consumer.close()
        self.child.stop()
