"""The direct relay (prefill_server/relay.py's Relay.direct) on the real pipeline and a real ClientWriter
on a Unix socket pair (tests.support.prefill_pipeline; the link is the one fake): while the
request's task waits for its inbox and the client keeps up, the decode's TOKENS go to the client
from the read callback; once the client falls behind they take the inbox and the task's waiting
send, and once it has caught up they go direct again, every frame in order, FINISH last."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from common import client
from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import (
    ConnectionClosed,
    Finish,
    Generate,
    Handoff,
    KvReady,
    Release,
    Tokens,
    Usage,
    encode,
    split_frame,
)
from common.wire.channel import FrameChannel
from prefill_server.client_writer import ClientWriter
from tests.support.daemons import BLOCK, status
from tests.support.prefill import events, prompts
from tests.support.prefill_pipeline import Setup
from tests.support.wait import poll

FILLER = Tokens(request_id="other", tokens=[1], text="f" * 16_000)  # another request's frame


async def test_frames_switch_to_the_inbox_while_the_client_is_behind_and_back(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt)
    s.run_forwards()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # read later, in one go
    writer = ClientWriter(FrameChannel(ours, max_fds=0), write_timeout_s=30, high_water=32_000)
    relayed = s.pipeline.relay.counts

    def step(token: int) -> None:
        s.pipeline.deliver(Tokens(request_id="a", tokens=[token]))

    task = s.start("a", max_tokens=9, writer=writer)
    await s.until(lambda: s.link.of(KvReady, "a"))
    req = s.pipeline.requests["a"]
    s.pipeline.deliver(Release(request_id="a", event_slot=s.link.of(Handoff, "a")[0].event_slot))
    step(11)  # the decode's first answer: taken by the handover, relayed by the task
    await s.until(lambda: req.waiting is not None)
    assert relayed == {"direct": 0, "queued": 1}
    step(12)
    step(13)  # the task waits with nothing queued, the client keeps up: direct
    assert relayed == {"direct": 2, "queued": 1} and req.waiting is not None
    for _ in range(2000):  # another request on the connection fills what the client lets queue
        if not writer.can_send_now():
            break
        writer.send_nowait(FILLER)
        await asyncio.sleep(0)
    assert not writer.can_send_now(), "the unread client never counted as behind"
    step(14)
    step(15)  # behind: to the inbox, the task's send waits for the client
    assert relayed == {"direct": 2, "queued": 3}
    await s.until(lambda: req.waiting is None)  # the task took them from its inbox
    assert not task.done()  # in its send, waiting for the client

    peer = FrameChannel(theirs, max_fds=0)
    frames: list = []

    async def read() -> None:
        while not (frames and isinstance(frames[-1], Finish)):
            msg = await peer.recv()
            if msg.request_id == "a":
                frames.append(msg)

    reader = asyncio.create_task(read())
    await s.until(lambda: req.waiting is not None)  # caught up: the task waits for its inbox
    step(16)  # direct again
    assert relayed == {"direct": 3, "queued": 3}
    usage = Usage(prompt_tokens=20, completion_tokens=7)
    s.pipeline.deliver(Finish(request_id="a", reason="length", usage=usage))
    async with asyncio.timeout(10):
        await reader
        by_task = await task

    first = s.link.of(KvReady, "a")[0].first_token
    tokens = [t for f in frames if isinstance(f, Tokens) for t in f.tokens]
    assert tokens == [first, 11, 12, 13, 14, 15, 16]
    assert [type(f) for f in frames[:-1]] == [Tokens] * (len(frames) - 1)
    assert frames[-1].usage.completion_tokens == 7
    assert "".join(f.text for f in frames[:-1]) + frames[-1].text == s.rt.tokenizer.decode(tokens)
    # the task relayed the first token, 11, then 14 and 15 in one frame, and the FINISH
    assert [f.tokens for f in by_task if isinstance(f, Tokens)] == [[first], [11], [14, 15]]
    assert req.direct_frames == 3
    assert s.clean(), (s.rt.allocator, s.slots_free())
    peer.close()
    writer.channel.close()
    await s.close()


async def test_a_request_being_cancelled_gets_no_direct_frame(cfg_rt) -> None:  # type: ignore[no-untyped-def]
    s = Setup(*cfg_rt)
    s.run_forwards()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    writer = ClientWriter(FrameChannel(ours, max_fds=0), write_timeout_s=30)
    task = s.start("a", max_tokens=9, writer=writer)
    await s.until(lambda: s.link.of(KvReady, "a"))
    req = s.pipeline.requests["a"]
    s.pipeline.deliver(Release(request_id="a", event_slot=s.link.of(Handoff, "a")[0].event_slot))
    s.pipeline.deliver(Tokens(request_id="a", tokens=[11]))
    await s.until(lambda: req.waiting is not None)
    task.cancel()  # the client's ABORT: a step that arrives before the task runs stays unsent
    s.pipeline.deliver(Tokens(request_id="a", tokens=[12]))
    assert s.pipeline.relay.counts == {"direct": 0, "queued": 2}
    await asyncio.gather(task, return_exceptions=True)
    writer.flush()
    writer.channel.close()
    peer = FrameChannel(theirs, max_fds=0)
    tokens = []
    with contextlib.suppress(ConnectionClosed):  # EOF after the frames sent
        while True:
            tokens += (await asyncio.wait_for(peer.recv(), 5)).tokens
    assert tokens == [s.link.of(KvReady, "a")[0].first_token, 11]
    peer.close()
    await s.close()


# ---- through real daemons ------------------------------------------------------------------------
def test_concurrent_streams_equal_the_reference_and_mostly_skip_the_inbox(
    pair_factory, tiny
) -> None:  # type: ignore[no-untyped-def]
    """48 streaming requests at once, half on one shared connection (as the API keeps one):
    greedy tokens equal the single-process reference, every request's frames are TOKENS then
    FINISH, their text is the tokens' text; the decode's TOKENS went to the clients from the
    read callback for most of them, and every one of them is counted once."""
    model, tok = tiny
    pair_factory.start("decode")
    pair_factory.start("prefill")
    greedy = [SamplingParams(max_tokens=10 + i % 9, ignore_eos=True) for i in range(48)]
    cases = list(zip(prompts(48, [3, 15, 17, 40]), greedy, strict=True))

    async def run_all() -> list[list]:
        async def one(conn: client.Connection | None, i: int) -> list:
            p, sp = cases[i]
            kw = {"prompt_tokens": p, "sampling": sp, "request_id": f"r{i}", "text_deltas": True}
            if conn is None:
                return [m async for m in client.stream(pair_factory.client_socket, **kw)]
            return [m async for m in conn.stream(**kw)]

        async with client.Connection(pair_factory.client_socket) as shared:
            return await asyncio.gather(
                *(one(shared if i % 2 else None, i) for i in range(len(cases)))
            )

    results = asyncio.run(run_all())
    for i, ((p, sp), frames) in enumerate(zip(cases, results, strict=True)):
        tokens = [t for f in frames[:-1] for t in f.tokens]
        assert tokens == reference.generate(model, p, sp, block_size=BLOCK), f"request {i}"
        assert all(isinstance(f, client.Tokens) for f in frames[:-1]), f"request {i}"
        assert isinstance(frames[-1], client.Finish), f"request {i}"
        assert frames[-1].usage.completion_tokens == sp.max_tokens
        assert "".join(f.text for f in frames) == tok.decode(tokens), f"request {i}"
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}
    finished = {e["request_id"]: e for e in events(pair_factory, "request_finished")}
    assert len(finished) == len(cases)
    direct = sum(e["direct_frames"] for e in finished.values())
    assert sum(e["direct_frames"] > 0 for e in finished.values()) >= len(cases) // 2, finished
    (stopped,) = events(pair_factory, "prefill_stopped")
    assert stopped["relayed_direct"] == direct > stopped["relayed_queued"]
    # the decode sends every token but the first (the prefill's) in one TOKENS frame
    decoded = sum(sp.max_tokens - 1 for _, sp in cases)
    assert stopped["relayed_direct"] + stopped["relayed_queued"] == decoded


class _RawClient:
    """A client connection read only when the test says so (a FrameChannel reads ahead)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.buf = bytearray()
        self.frames: dict[str, list] = {}

    def read_until(self, done) -> None:  # type: ignore[no-untyped-def]
        while not done():
            got = split_frame(self.buf)
            if got is None:
                data = self.sock.recv(65536)
                assert data, "the prefill closed the connection"
                self.buf += data
                continue
            msg, n = got
            del self.buf[:n]
            self.frames.setdefault(msg.request_id, []).append(msg)


def test_a_client_that_stops_reading_mid_stream_stalls_no_one_and_keeps_its_order(  # type: ignore[no-untyped-def]
    pair_factory, tiny
) -> None:
    """A client reads its streams' first frames, then nothing while another client's requests
    run, then the rest: the other client is served meanwhile; the stalled one's frames went
    direct, then (its writer past its high-water mark) through the inbox, and arrive in order,
    equal to the reference, FINISH last."""
    model, tok = tiny
    pair_factory.start("decode")
    pair_factory.start("prefill")
    # ~350 bytes a token with 20 logprobs: far more than the socket and the writer's 256 KiB
    slow_sp = SamplingParams(max_tokens=160, ignore_eos=True, logprobs=20)
    slow = {f"slow{i}": p for i, p in enumerate(prompts(16, [5, 20], seed=5))}
    raw = _RawClient(pair_factory.client_socket)
    try:
        gens = [Generate(sampling=slow_sp, prompt_tokens=p, request_id=r) for r, p in slow.items()]
        raw.sock.sendall(b"".join(encode(g) for g in gens))
        raw.read_until(
            lambda: len(raw.frames) == len(slow) and all(len(f) >= 3 for f in raw.frames.values())
        )
        fast = [(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts(8, [7, 30])]

        async def others() -> list[client.Result]:
            return await asyncio.gather(
                *(
                    client.generate(
                        pair_factory.client_socket, prompt_tokens=p, sampling=sp, timeout=30
                    )
                    for p, sp in fast
                )
            )

        for (p, sp), res in zip(fast, asyncio.run(others()), strict=True):
            assert res.tokens == reference.generate(model, p, sp, block_size=BLOCK)
        # every slow token is at the prefill now: in the writer, or in its requests' inboxes
        poll(lambda: status(pair_factory.link_socket).inflight == 0, what="decode done")
        raw.read_until(lambda: all(isinstance(f[-1], Finish) for f in raw.frames.values()))
    finally:
        raw.sock.close()
    for rid, p in slow.items():
        frames = raw.frames[rid]
        tokens = [t for f in frames[:-1] for t in f.tokens]
        assert tokens == reference.generate(model, p, slow_sp, block_size=BLOCK), rid
        assert all(len(f.logprobs) == len(f.tokens) for f in frames[:-1]), rid
        assert frames[-1].usage.completion_tokens == slow_sp.max_tokens
        assert "".join(f.text for f in frames) == tok.decode(tokens), rid
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}
    finished = {e["request_id"]: e for e in events(pair_factory, "request_finished")}
    direct = [finished[rid]["direct_frames"] for rid in slow]
    # direct while it read, through the inbox once it fell behind (the decode sent 159 each)
    assert all(0 < d < slow_sp.max_tokens - 2 for d in direct), direct
