"""KVConsumer against a real producer pool in shared memory: open once, validate, pull, close."""

from __future__ import annotations

import os

import pytest
import torch

from common.errors import IpcError, PdkvError
from common.kv.pool import KVPool, PoolLayout
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode, Handoff, Register
from common.transfer import KVConsumer, TransferRefused
from tests.support.decode import Side, open_consumer


def _handoff(block_ids: list[int], num_tokens: int, **kw) -> Handoff:  # type: ignore[no-untyped-def]
    return Handoff(
        request_id="r",
        block_ids=block_ids,
        num_tokens=num_tokens,
        prompt_tokens=[1] * num_tokens,
        first_token=2,
        sampling=SamplingParams(max_tokens=4),
        **kw,
    )


def test_a_pull_copies_the_peer_blocks_and_reports_done_at_once_on_cpu(side: Side, rt):
    side.pool.tensor.copy_(torch.randn(side.pool.layout.shape))
    local = KVPool.create(rt.layout)
    consumer = open_consumer(side, local)
    done: list[BaseException | None] = []
    assert consumer.pull([3, 4, 9], [0, 1, 7], -1, done.append) is None  # nothing to wait on
    assert done == [None]  # synchronous on CPU: the frame was the signal
    assert torch.equal(local.tensor[[0, 1, 7]], side.pool.tensor[[3, 4, 9]])
    assert local.tensor[2].abs().sum() == 0  # nothing else written
    consumer.close()


def test_the_peer_pool_is_the_producers_memory_not_a_copy(side: Side, rt):
    consumer = open_consumer(side, KVPool.create(rt.layout))
    side.pool.tensor[5].fill_(7.0)
    assert consumer.peer is not None and bool((consumer.peer.tensor[5] == 7.0).all())
    consumer.close()


def test_a_pull_that_cannot_start_raises_and_never_calls_done(side: Side, rt):
    consumer = open_consumer(side, KVPool.create(rt.layout))
    done: list[BaseException | None] = []
    with pytest.raises(IpcError, match="repeat"):
        consumer.pull([0, 1], [5, 5], -1, done.append)  # destination repeats
    consumer.close()
    with pytest.raises(PdkvError, match="closed"):
        consumer.pull([0], [0], -1, done.append)  # after close: no mapping to read
    assert done == []


@pytest.mark.parametrize(
    ("handoff", "reason"),
    [
        (_handoff([0], 5), "5 tokens need 2 blocks, HANDOFF names 1"),
        (_handoff([0, 0], 5), "HANDOFF block ids repeat"),
        (_handoff([0, 32], 5), r"HANDOFF block ids \[32\] out of range \[0, 32\)"),
        (_handoff([0, 1], 5, event_slot=0), "event slot 0 does not exist"),
    ],
)
def test_validate_names_what_is_wrong_with_a_handoff(side: Side, rt, handoff, reason):
    consumer = open_consumer(side, KVPool.create(rt.layout))
    consumer.validate(_handoff([0, 1], 5), vocab_size=rt.model.config.vocab_size)  # 4 per block
    with pytest.raises((ValueError, IpcError), match=reason):
        consumer.validate(handoff, vocab_size=rt.model.config.vocab_size)
    consumer.close()


def test_validate_refuses_token_ids_beyond_the_vocabulary(side: Side, rt):
    consumer = open_consumer(side, KVPool.create(rt.layout))
    h = _handoff([0], 1)
    with pytest.raises(ValueError, match="vocab size 2"):
        consumer.validate(h, vocab_size=2)
    consumer.close()


def test_a_register_of_another_layout_is_incompatible_before_any_fd_is_taken(side: Side, rt):
    other = PoolLayout(**{**rt.layout.to_wire(), "block_size": rt.layout.block_size * 2})
    _, fds = side.producer.register()
    wrong = Register.build(other.to_wire(), [side.producer.region.desc], [len(fds)], [])
    taken: list[int] = []
    with pytest.raises(TransferRefused) as info:
        KVConsumer.open(wrong, _taker(fds, taken), KVPool.create(rt.layout))
    assert info.value.code == ErrorCode.INCOMPATIBLE
    assert taken == []  # refused before any fd was taken: the channel still owns them


def test_an_unknown_backend_kind_closes_the_taken_fds(side: Side, rt):
    import msgspec

    _, fds = side.producer.register()
    desc = msgspec.structs.replace(side.producer.region.desc, kind="nixl")
    bad = Register.build(rt.layout.to_wire(), [desc], [len(fds)], [])
    taken: list[int] = []
    with pytest.raises(TransferRefused) as info:
        KVConsumer.open(bad, _taker(fds, taken), KVPool.create(rt.layout))
    assert info.value.code == ErrorCode.INCOMPATIBLE
    assert taken and all(_closed(fd) for fd in taken)


async def test_close_is_idempotent_and_drain_returns_with_nothing_in_flight(side: Side, rt):
    consumer = open_consumer(side, KVPool.create(rt.layout))
    await consumer.drain()
    assert consumer.pulls_in_flight == 0
    consumer.close()
    consumer.close()
    assert consumer.peer is None


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _taker(fds: list[int], taken: list[int]):  # type: ignore[no-untyped-def]
    """take_fds as the channel gives them (duplicates, as SCM_RIGHTS makes), noting each."""

    def take(n: int) -> list[int]:
        taken.extend(os.dup(fd) for fd in fds[:n])
        return taken

    return take
