"""PrefillBatcher over a real model runtime (the tiny model, CPU pool): what a batch takes, and that
a request cancelled while queued never runs (its blocks may already belong to someone else)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
import types

import pytest

from common.daemon.runtime import ModelRuntime
from common.ipc.events import CpuEventRing
from common.model import reference
from common.model.sampling import SamplingParams
from common.protocol import ErrorCode
from common.timings import Marks
from common.transfer import KVProducer
from prefill_server.batcher import PrefillBatcher
from prefill_server.request import RequestFailed
from tests.support.daemons import BLOCK
from tests.support.prefill import prompts

GREEDY = SamplingParams(max_tokens=1)


def _run(rt: ModelRuntime, budget: int, texts: list[list[int]], cancel: set[int], chunk=None):  # type: ignore[no-untyped-def]
    """Queue every prompt (blocks from the runtime's allocator), cancel those in `cancel` while
    they are queued, then let the batcher run; (batcher, results by index)."""

    async def go():  # type: ignore[no-untyped-def]
        producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=1)
        batcher = PrefillBatcher(rt, producer, budget, chunk)
        tasks = []
        for i, p in enumerate(texts):
            blocks = rt.allocator.allocate(f"r{i}", -(-len(p) // BLOCK))
            tasks.append(batcher.submit(f"r{i}", p, blocks, GREEDY, -1))
        await asyncio.sleep(0)  # every request queued, the batcher not started yet
        for i in cancel:
            tasks[i].cancel()
        runner = asyncio.create_task(batcher.run())
        results = await asyncio.gather(*tasks, return_exceptions=True)
        runner.cancel()
        for i in range(len(texts)):
            rt.allocator.free(f"r{i}")
        return batcher, results

    return asyncio.run(go())


def test_queued_prompts_share_forwards_within_the_budget(rt) -> None:  # type: ignore[no-untyped-def]
    texts = prompts(5, [30, 30, 30, 100, 10], seed=9)
    batcher, results = _run(rt, 64, texts, set())
    # in order while they fit: [30, 30] [30] [64 of the 100: a chunk, past the budget], then
    # the queue is [10, the 100's last 36]: one forward (chunked prefill; it was [100] [10])
    assert (batcher.forwards, batcher.prompts) == (4, 5)
    sizes = [shared for _, shared in results]
    assert sizes == [2, 2, 1, 2, 2]
    for (first, _), p in zip(results, texts, strict=True):
        assert first.token == reference.generate(rt.model, p, GREEDY, block_size=BLOCK)[0]


def test_a_request_cancelled_while_queued_never_runs(rt) -> None:  # type: ignore[no-untyped-def]
    texts = prompts(3, [20, 25, 30], seed=4)
    batcher, results = _run(rt, 8192, texts, {1})
    assert isinstance(results[1], asyncio.CancelledError)
    assert (batcher.forwards, batcher.prompts) == (1, 2)
    assert [r[1] for i, r in enumerate(results) if i != 1] == [2, 2]


@pytest.mark.parametrize("chunk", [1, 16, 23, 64])
def test_chunked_prompts_equal_the_reference(rt, chunk: int) -> None:  # type: ignore[no-untyped-def]
    """Prompts longer than the chunk run a chunk per forward, interleaved with the others, each
    chunk attending to the ones before through the pool: the first tokens are the reference's."""
    texts = prompts(3, [70, 5, 48], seed=11)
    batcher, results = _run(rt, chunk, texts, set(), chunk=chunk)
    assert batcher.prompts == 3
    assert batcher.forwards >= sum(-(-len(p) // chunk) for p in texts) - 2  # chunks ran apart
    for (first, _), p in zip(results, texts, strict=True):
        assert first.token == reference.generate(rt.model, p, GREEDY, block_size=BLOCK)[0]


def test_a_prompt_that_asks_for_prompt_logprobs_is_never_chunked() -> None:
    """Its logits at every position come from one forward: its one piece is the whole prompt
    (past the chunk and the budget), and it may not start after a cached prefix."""
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)

    async def go():  # type: ignore[no-untyped-def]
        batcher = PrefillBatcher(None, None, 16, 16)  # type: ignore[arg-type]  # _take: no model
        batcher.submit("a", [1] * 70, [], scored, -1)
        batcher.submit("b", [1] * 70, [], GREEDY, -1)
        with pytest.raises(ValueError, match="prompt logprobs"):
            batcher.submit("c", [1] * 70, [], scored, -1, 16)
        return batcher._take(), batcher._take()

    first, second = asyncio.run(go())
    assert [(job.request_id, p.start, p.end) for job, p in first] == [("a", 0, 70)]
    assert [(job.request_id, p.start, p.end) for job, p in second] == [("b", 0, 16)]
    assert first[0][1].sampling is scored and second[0][1].sampling is None  # a chunk: no draw


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_next_forward_starts_before_the_last_ones_prompts_are_answered_when_pipelined(
    rt, pipelined: bool
) -> None:  # type: ignore[no-untyped-def]
    """--pipeline-forwards: as a forward returns, the next batch goes to the torch thread
    (its forward_started mark) before the returned forward's first tokens are answered (off:
    after); the first tokens are the reference's either way."""
    texts = prompts(3, [20, 25, 30], seed=5)
    answered: dict[int, int] = {}

    def done(i: int, _: object) -> None:
        answered[i] = time.monotonic_ns()

    async def go():  # type: ignore[no-untyped-def]
        producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=1)
        batcher = PrefillBatcher(rt, producer, 1, 8192, pipelined=pipelined)  # one a forward
        futures, marks = [], []
        for i, p in enumerate(texts):
            blocks = rt.allocator.allocate(f"r{i}", -(-len(p) // BLOCK))
            marks.append(Marks())
            future = batcher.submit(f"r{i}", p, blocks, GREEDY, -1, marks=marks[-1])
            future.add_done_callback(functools.partial(done, i))
            futures.append(future)
        runner = asyncio.create_task(batcher.run())
        results = await asyncio.gather(*futures)
        runner.cancel()
        for i in range(len(texts)):
            rt.allocator.free(f"r{i}")
        return results, [m.get("forward_started") for m in marks]

    results, started = asyncio.run(go())
    for (first, shared), p in zip(results, texts, strict=True):
        assert shared == 1
        assert first.token == reference.generate(rt.model, p, GREEDY, block_size=BLOCK)[0]
    for i in (1, 2):  # the forward of prompt i against the answer of prompt i - 1
        assert (started[i] < answered[i - 1]) is pipelined, (i, started, answered)


def test_a_slot_let_go_of_while_its_forward_runs_does_not_fail_the_batch(rt) -> None:  # type: ignore[no-untyped-def]
    """A request that ends while its forward runs lets go of its event slot at once (no decode
    can wait on it yet); the forward's record of that slot is skipped and its batch mates get
    their first tokens (before: IpcError, and the whole batch failed INTERNAL)."""
    texts = prompts(2, [20, 25], seed=6)

    async def go():  # type: ignore[no-untyped-def]
        producer = KVProducer(rt.pool, rt.allocator, rt.backend, event_slots=1)
        producer.events = CpuEventRing(2)  # slot bookkeeping as on CUDA
        batcher = PrefillBatcher(rt, producer, 8192)
        futures, slots = [], []
        for i, p in enumerate(texts):
            blocks = rt.allocator.allocate(f"r{i}", -(-len(p) // BLOCK))
            slots.append(producer.acquire_slot())
            futures.append(batcher.submit(f"r{i}", p, blocks, GREEDY, slots[-1]))
        producer.drop_slot(slots[0])  # r0's request ended (the pipeline's handoff.end)
        runner = asyncio.create_task(batcher.run())
        results = await asyncio.gather(*futures, return_exceptions=True)
        runner.cancel()
        for i in range(len(texts)):
            rt.allocator.free(f"r{i}")
        return results, producer.events.free_count

    results, free = asyncio.run(go())
    for (first, shared), p in zip(results, texts, strict=True):
        assert shared == 2
        assert first.token == reference.generate(rt.model, p, GREEDY, block_size=BLOCK)[0]
    assert free == 1  # r1's slot recorded and still in flight; r0's free


def test_a_forward_that_cannot_start_fails_its_batch_not_the_batcher() -> None:
    """The torch thread's executor refusing the forward (shut down) fails that batch's requests
    with INTERNAL; the batcher answers later ones the same way rather than dying with them
    unanswered."""

    async def go():  # type: ignore[no-untyped-def]
        executor = concurrent.futures.ThreadPoolExecutor(1)
        executor.shutdown()
        rt = types.SimpleNamespace(executor=executor)  # all _launch uses of the runtime
        rt.submit = functools.partial(ModelRuntime.submit, rt)
        batcher = PrefillBatcher(rt, None, 8192, 8192, quiet=None)  # type: ignore[arg-type]
        runner = asyncio.create_task(batcher.run())
        first = batcher.submit("a", [1, 2, 3], [], GREEDY, -1)
        with pytest.raises(RequestFailed) as failed:
            await asyncio.wait_for(first, 10)
        assert failed.value.code == ErrorCode.INTERNAL
        second = batcher.submit("b", [1, 2], [], GREEDY, -1)
        with pytest.raises(RequestFailed):
            await asyncio.wait_for(second, 10)
        assert not runner.done()
        runner.cancel()

    asyncio.run(go())
