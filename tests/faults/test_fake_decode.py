"""The prefill daemon against a hand-driven decode: leases that are never released, and a decode
that stops answering heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import client
from common.model.sampling import SamplingParams
from common.protocol import Finish, Release, Tokens, Usage
from tests.support.daemons import Daemon, FaultPair, all_free, pool_of, status, wait_ready
from tests.support.fakes import FakeDecode
from tests.support.wait import poll


def _fake_pair(
    factory: pytest.TempPathFactory, *extra: str
) -> Iterator[tuple[FaultPair, FakeDecode]]:
    path = Path(factory.mktemp("fd", numbered=True))
    os.chmod(path, 0o700)
    fake = FakeDecode(path / "fake-decode.sock").start()
    pair = FaultPair(path)
    d = pair.start(
        "prefill",
        "--link-socket",
        str(fake.path),
        "--lease-timeout",
        "1",
        "--heartbeat-timeout",
        "2",
        "--handoff-timeout",
        "2",
        *extra,
        wait=False,
    )
    wait_ready(d, linked=True)
    yield pair, fake
    pair.kill_all()
    fake.stop()


@pytest.fixture
def fake_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FaultPair, FakeDecode]]:
    yield from _fake_pair(tmp_path_factory)


@pytest.fixture
def fake_setup_late(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[FaultPair, FakeDecode]]:
    """--no-early-handoff: every HANDOFF carries its first token (its blocks leased)."""
    yield from _fake_pair(tmp_path_factory, "--no-early-handoff")


def _prefill(pair: FaultPair) -> Daemon:
    return pair.daemons["prefill"]


def test_client_socket_is_0600(fake_setup) -> None:  # type: ignore[no-untyped-def]
    pair, _ = fake_setup
    mode = os.stat(pair.client_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_lease_never_released_gives_wait_timeout(fake_setup) -> None:  # type: ignore[no-untyped-def]
    pair, fake = fake_setup
    fake.release, fake.answer_pings = False, True
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with pytest.raises(client.RequestFailed) as info:
        asyncio.run(
            client.generate(
                pair.client_socket,
                prompt_tokens=list(range(40)),
                sampling=params,
                request_id="lease-1",
                timeout=20,
            )
        )
    assert info.value.code == "WAIT_TIMEOUT", str(info.value)
    assert [h.request_id for h in fake.handoffs][-1:] == ["lease-1"]
    assert fake.handoffs[-1].block_ids and len(fake.handoffs[-1].block_ids) == 3
    poll(lambda: all_free(pair.client_socket), what="prefill pool free after lease expiry")
    assert '"lease_expired"' in _prefill(pair).log_text()

    # a late RELEASE, TOKENS and FINISH for the expired request change nothing
    fake.send_all(Release(request_id="lease-1"))
    fake.send_all(Tokens(request_id="lease-1", tokens=[1]))
    usage = Usage(prompt_tokens=40, completion_tokens=5)
    fake.send_all(Finish(request_id="lease-1", reason="length", usage=usage))
    st = status(pair.client_socket)
    assert st.links[0]["state"] == "up" and st.inflight == 0
    assert all_free(pair.client_socket)


def test_silent_decode_is_dropped_and_requests_get_link_lost(fake_setup) -> None:  # type: ignore[no-untyped-def]
    pair, fake = fake_setup
    fake.release = True  # the lease ends at once: only the heartbeat can end this request
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def run() -> None:
        task = asyncio.create_task(
            client.generate(
                pair.client_socket,
                prompt_tokens=[5] * 20,
                sampling=params,
                request_id="silent-1",
                timeout=30,
            )
        )
        while not any(h.request_id == "silent-1" for h in fake.handoffs):
            assert not task.done(), task
            await asyncio.sleep(0.01)
        fake.accept = False  # reconnects are refused from now on
        fake.answer_pings = False
        with pytest.raises(client.RequestFailed) as info:
            await task
        assert info.value.code == "LINK_LOST", str(info.value)

    asyncio.run(run())
    st = poll(lambda: (s := status(pair.client_socket)).links[0]["state"] == "down" and s)
    assert "Timeout" in str(st.links[0]["last_error"]) or "timed out" in str(
        st.links[0]["last_error"]
    ), st.links
    assert all_free(pair.client_socket)
    assert '"decode_link_down"' in _prefill(pair).log_text()
    # the link dropped and does not come back: a new request waits --handoff-timeout, then LINK_LOST
    with pytest.raises(client.RequestFailed) as info:
        asyncio.run(client.generate(pair.client_socket, prompt_tokens=[1, 2], sampling=params))
    assert info.value.code == "LINK_LOST"
    assert all_free(pair.client_socket)


def test_handoff_written_to_a_just_dead_decode_gets_link_lost(fake_setup) -> None:  # type: ignore[no-untyped-def]
    """The decode died a moment ago: the HANDOFF write fails (EPIPE) before the prefill has seen
    end of file. The client must get LINK_LOST at once, not wait forever (a CI failure once)."""
    pair, fake = fake_setup
    fake.accept, fake.answer_pings, fake.release = True, True, True
    poll(lambda: status(pair.client_socket).links[0]["state"] == "up", what="link up again")
    fake.accept = False  # the link cannot come back during the request
    fake.deafen()
    before = len(fake.handoffs)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    with pytest.raises(client.RequestFailed) as info:
        asyncio.run(
            client.generate(
                pair.client_socket,
                prompt_tokens=[7] * 20,
                sampling=params,
                request_id="deaf-1",
                timeout=20,
            )
        )
    assert info.value.code == "LINK_LOST", str(info.value)
    assert len(fake.handoffs) == before  # nothing got through to the decode
    st = poll(lambda: (s := status(pair.client_socket)).links[0]["state"] == "down" and s)
    assert "Connection" in str(st.links[0]["last_error"]) or "Broken" in str(
        st.links[0]["last_error"]
    ), st.links
    poll(lambda: all_free(pair.client_socket), what="prefill pool free after the failed write")
    assert status(pair.client_socket).inflight == 0
    fake.deaf, fake.accept = False, True
    poll(lambda: status(pair.client_socket).links[0]["state"] == "up", what="link back up")


def _nocap_then_drop(pair: FaultPair, fake: FakeDecode, *, capacity_after: bool):  # type: ignore[no-untyped-def]
    """nocap-1 is refused (NO_CAPACITY) and then the link drops (the fake closes it right after
    the refusal, so the prefill reads the refusal first) and comes straight back; the decode has
    capacity again after the drop when `capacity_after`. The request's result (or its
    RequestFailed) and the links each HANDOFF of it came on."""
    fake.accept, fake.answer_pings, fake.deaf = True, True, False
    poll(lambda: status(pair.client_socket).links[0]["state"] == "up", what="link up")
    connects = status(pair.client_socket).links[0]["connects"]
    fake.no_capacity, fake.finish_on_first = not capacity_after, True
    fake.refuse_then_drop = {"nocap-1"}
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def run():  # type: ignore[no-untyped-def]
        task = asyncio.create_task(
            client.generate(
                pair.client_socket,
                prompt_tokens=[9] * 20,
                sampling=params,
                request_id="nocap-1",
                timeout=20,
            )
        )
        return (await asyncio.gather(task, return_exceptions=True))[0]

    try:
        result = asyncio.run(run())
    finally:
        fake.no_capacity = fake.finish_on_first = False
        fake.refuse_then_drop = set()
    poll(lambda: status(pair.client_socket).links[0]["connects"] > connects, what="reconnected")
    mine = [(h, link) for h, link in zip(fake.handoffs, fake.handoff_links, strict=True)]
    return result, [(h, link) for h, link in mine if h.request_id == "nocap-1"]


def test_no_capacity_retry_after_a_link_loss_does_not_hand_off_freed_blocks(
    fake_setup_late,  # type: ignore[no-untyped-def]
) -> None:
    """Handed off with its first token (its blocks leased), the request is refused, and the link
    drops (its leases and blocks are freed) and comes straight back: the retry must end the
    request with LINK_LOST, never hand the freed blocks to the new link."""
    pair, fake = fake_setup_late
    result, offers = _nocap_then_drop(pair, fake, capacity_after=True)
    assert isinstance(result, client.RequestFailed) and result.code == "LINK_LOST", result
    assert offers[0][0].first_token is not None  # leased when it was refused
    first_link = offers[0][1]
    assert [link for _, link in offers if link != first_link] == [], "freed blocks handed on"


def test_an_early_offer_refused_then_its_link_lost_is_offered_again(fake_setup) -> None:  # type: ignore[no-untyped-def]
    """Refused while offered early (its KV not written, its blocks its own, never leased) and
    then the link drops: no token of it has reached the decode, so it is offered again, with its
    first token, on the link that came back, and completes.

    The one other order the daemon may see: its forward ends before its loop has read the
    refusal (on CPU the forward holds the GIL the loop needs, ~1 run in 5 here), so KV_READY
    leases the blocks to the dying link; the loss then frees them, and the request must end
    with LINK_LOST without any offer on the new link (the late test's case)."""
    pair, fake = fake_setup
    result, offers = _nocap_then_drop(pair, fake, capacity_after=True)
    assert offers[0][0].first_token is None  # the early offer
    again = [(h, link) for h, link in offers if link != offers[0][1]]
    if isinstance(result, client.RequestFailed):  # leased before the refusal was read
        assert result.code == "LINK_LOST", result
        assert again == [], "blocks freed with the lost link's lease were handed on"
    else:
        assert result.finish is not None and result.finish.reason == "length"
        assert again and all(h.first_token is not None for h, _ in again)
    st = status(pair.client_socket)
    assert st.pool["free"] == st.pool["total"]
    poll(lambda: all_free(pair.client_socket), what="prefill pool free")


def _generate(pair: FaultPair, rid: str, sock: str | None = None) -> client.Result:
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    return asyncio.run(
        client.generate(
            sock or pair.client_socket,
            prompt_tokens=[3] * 20,
            sampling=params,
            request_id=rid,
            timeout=20,
        )
    )


def test_an_early_handoff_has_no_first_token_and_a_tokens_frame_brings_it(fake_setup) -> None:  # type: ignore[no-untyped-def]
    pair, fake = fake_setup
    fake.accept, fake.answer_pings, fake.deaf, fake.release = True, True, False, False
    poll(lambda: status(pair.client_socket).links[0]["state"] == "up", what="link up")
    fake.finish_on_first = True
    try:
        result = _generate(pair, "early-1")
    finally:
        fake.finish_on_first = False
    assert [f for f in fake.frames if f[1] == "early-1"] == [
        ("HANDOFF", "early-1"),
        ("KV_READY", "early-1"),
    ]
    (h,) = [h for h in fake.handoffs if h.request_id == "early-1"]
    assert h.first_token is None and h.event_slot == -1  # CPU: the frame follows the forward
    (first,) = [t for t in fake.first_tokens if t.request_id == "early-1"]
    assert [first.first_token] == result.tokens[:1] and len(result.tokens) == 1
    poll(lambda: all_free(pair.client_socket), what="prefill pool free")


def test_an_early_handoff_refused_for_capacity_goes_again_with_its_first_token(fake_setup) -> None:  # type: ignore[no-untyped-def]
    pair, fake = fake_setup
    fake.accept, fake.answer_pings, fake.deaf, fake.release = True, True, False, False
    poll(lambda: status(pair.client_socket).links[0]["state"] == "up", what="link up")
    fake.finish_on_first, fake.no_capacity_once = True, {"early-2"}
    try:
        result = _generate(pair, "early-2")
    finally:
        fake.finish_on_first = False
    firsts = [h.first_token for h in fake.handoffs if h.request_id == "early-2"]
    assert firsts == [None, result.tokens[0]]
    poll(lambda: all_free(pair.client_socket), what="prefill pool free")


def test_without_the_early_handoff_the_first_token_rides_in_the_handoff(fake_setup) -> None:  # type: ignore[no-untyped-def]
    pair, fake = fake_setup
    fake.accept, fake.answer_pings, fake.deaf, fake.release = True, True, False, False
    late = FaultPair(pair.runtime / "late")
    late.runtime.mkdir(mode=0o700)
    d = late.start("prefill", "--link-socket", str(fake.path), "--no-early-handoff", wait=False)
    try:
        wait_ready(d, linked=True)
        fake.finish_on_first = True
        result = _generate(late, "late-1")
    finally:
        fake.finish_on_first = False
        late.kill_all()
    (h,) = [h for h in fake.handoffs if h.request_id == "late-1"]
    assert h.first_token == result.tokens[0]
    assert [f for f in fake.frames if f[1] == "late-1"] == [("HANDOFF", "late-1")]


def test_a_request_ended_after_its_kv_ready_keeps_its_blocks_until_the_decode_answers(
    fake_setup,
) -> None:  # type: ignore[no-untyped-def]
    """The client goes away after KV_READY went (the decode may not have pulled yet): the blocks
    stay leased until the decode answers the ABORT. Freed at once, a forward could write another
    prompt's KV into them under the pull, and the decode would copy it and cache it under this
    prompt's names (wrong tokens for every later request with that prefix)."""
    pair, fake = fake_setup
    fake.release = False  # a decode that has not pulled yet: no RELEASE
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def start_then_leave() -> None:
        async with client.Connection(pair.client_socket) as conn:
            frames = conn.stream(
                prompt_tokens=list(range(40)), sampling=params, request_id="gone-1", timeout=20
            )
            reading = asyncio.create_task(anext(frames))  # the fake sends no token
            while not any(t.request_id == "gone-1" for t in fake.first_tokens):
                await asyncio.sleep(0.01)
            reading.cancel()  # the client goes away: its stream sends ABORT
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    asyncio.run(start_then_leave())
    poll(lambda: "gone-1" in fake.aborts, what="the ABORT at the decode")
    pool = pool_of(pair.client_socket)
    assert pool["leased"] == 3 and pool["free"] == pool["total"] - 3, pool  # 40 tokens: 3 blocks
    fake.send_all(Release(request_id="gone-1"))  # the decode's pull is done
    poll(lambda: all_free(pair.client_socket), what="prefill pool free after the RELEASE")
    assert status(pair.client_socket).inflight == 0


def test_an_abort_never_answered_ends_with_its_lease(fake_setup) -> None:  # type: ignore[no-untyped-def]
    """The client went away after KV_READY and the decode never answers the ABORT: at the
    lease's deadline the request ends for good (its blocks, and on CUDA its slot, back in use),
    so its id may be used again; before, it stayed 'in flight' until the link ended."""
    pair, fake = fake_setup
    fake.release = False
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def start_then_leave() -> None:
        async with client.Connection(pair.client_socket) as conn:
            frames = conn.stream(
                prompt_tokens=list(range(40)), sampling=params, request_id="gone-2", timeout=20
            )
            reading = asyncio.create_task(anext(frames))
            while not any(t.request_id == "gone-2" for t in fake.first_tokens):
                await asyncio.sleep(0.01)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    asyncio.run(start_then_leave())
    poll(lambda: "gone-2" in fake.aborts, what="the ABORT at the decode")
    poll(lambda: all_free(pair.client_socket), what="the lease (1 s) expired")
    fake.finish_on_first = True  # the same id again, to a decode that answers now
    result = _generate(pair, "gone-2")
    assert result.finish is not None and len(result.tokens) == 1
    poll(lambda: all_free(pair.client_socket), what="prefill pool free")
    assert status(pair.client_socket).inflight == 0
