"""The host KV tier through real daemons on CPU (issue 43): greedy tokens with the tier on equal
the tier off and the single-process reference for first requests, repeats whose pool blocks were
evicted (a small pool) and an 8-turn conversation whose prompts hold the earlier answers (the
decode wrote them: `cached_tokens` says the prefill computed about the new message only); two
prefills share one tier; a SIGKILLed pair leaves the tier consistent and the other pair serving,
and restarted maps the same tier; a tier too small for one block is refused at start (exit 3)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common import client
from common.model import reference
from common.model.sampling import SamplingParams
from tests.support.daemons import BLOCK, Pair, short_dir
from tests.support.prefill import expected_hit, prompts

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=20, ignore_eos=True)
SMALL_POOL = ["--num-blocks", "24"]


def tier_args(path: Path) -> list[str]:
    return ["--host-cache-gb", "0.01", "--host-cache-path", str(path)]


@pytest.fixture
def tier_path() -> Iterator[Path]:
    path = Path(f"/dev/shm/pdkv-test-daemons-{os.getpid()}-{os.urandom(4).hex()}")
    yield path
    path.unlink(missing_ok=True)


def make_pair(factory: pytest.TempPathFactory, tier: Path | None) -> Pair:
    extra = tier_args(tier) if tier is not None else []
    pair = Pair(short_dir(factory, "ht"))
    pair.start("decode", "--num-blocks", "64", *extra)
    pair.start("prefill", *SMALL_POOL, *extra)
    return pair


@pytest.fixture
def pairs(tmp_path_factory: pytest.TempPathFactory, tier_path: Path) -> Iterator[dict[bool, Pair]]:
    """A pair with the host tier (True) and one without (False), both with a 24-block prefill."""
    out: dict[bool, Pair] = {}
    try:
        out[True] = make_pair(tmp_path_factory, tier_path)
        out[False] = make_pair(tmp_path_factory, None)
        yield out
    finally:
        for pair in out.values():
            pair.kill_all()


def run(pair: Pair, prompt: list[int], params: SamplingParams = GREEDY) -> client.Result:
    return asyncio.run(client.generate(pair.client_socket, prompt_tokens=prompt, sampling=params))


def cached(result: client.Result) -> int:
    assert result.finish is not None
    return result.finish.usage.cached_tokens


def tier_stats(pair: Pair, role: str = "prefill") -> dict[str, int]:
    sock = pair.client_socket if role == "prefill" else pair.link_socket
    st = asyncio.run(client.status(sock, timeout=5))
    return {k.removeprefix("host_tier_"): v for k, v in st.prefix_cache.items() if "tier" in k}


def test_repeats_after_pool_eviction_equal_tier_off(pairs: dict[bool, Pair], tiny) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    first = prompts(6, [80], seed=31)  # 5 blocks each: 6 of them overflow the 24-block pool
    history: list[list[int]] = []
    for prompt in first + first[:3]:  # the repeats' pool blocks were evicted meanwhile
        got = {on: run(pair, prompt) for on, pair in pairs.items()}
        want = reference.generate(model, prompt, GREEDY, block_size=BLOCK)
        assert got[True].tokens == got[False].tokens == want
        assert cached(got[True]) == expected_hit(history, prompt)
        history.append(prompt)
    assert cached(got[False]) < expected_hit(history[:-1], history[-1])  # off: evicted, computed
    stats = tier_stats(pairs[True])
    assert stats["hits"] >= 3 * 4 and stats["checksum_failures"] == 0
    assert tier_stats(pairs[False]) == {}
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(pairs[True].runtime), "status"]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout
    assert shown.count("host tier") == 2 and f"{stats['hits']} read" in shown  # both daemons


def test_eight_turn_conversation_finds_its_answers(pairs: dict[bool, Pair], tiny) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    conv = prompts(1, [30], seed=41)[0]
    messages = prompts(8, [10], seed=42)
    written = 0  # positions of the conversation whose KV the last turn wrote
    for turn in range(8):
        got = {on: run(pair, conv, ANSWER) for on, pair in pairs.items()}
        want = reference.generate(model, conv, ANSWER, block_size=BLOCK)
        assert got[True].tokens == got[False].tokens == want, f"turn {turn}"
        hit = cached(got[True])
        # the whole conversation so far, answers included (a prefix of this prompt), short of
        # the block of the last token: the prefill computes the new message and a block's rest
        assert hit == min(written // BLOCK, (len(conv) - 1) // BLOCK) * BLOCK, f"turn {turn}"
        if turn:
            assert len(conv) - hit <= len(messages[turn]) + BLOCK + 1
            assert cached(got[False]) < hit  # off: the answers' KV was recomputed
        answer = got[True].tokens
        written = len(conv) + len(answer) - 1  # the last token's KV is never computed
        conv = conv + answer + messages[turn]
    assert tier_stats(pairs[True], "decode")["stored"] >= 7  # the answers' blocks


def test_two_prefills_share_one_tier(
    tmp_path_factory: pytest.TempPathFactory, tier_path: Path, tiny
) -> None:  # type: ignore[no-untyped-def]
    model, _ = tiny
    a = b = None
    try:
        a = make_pair(tmp_path_factory, tier_path)
        b = make_pair(tmp_path_factory, tier_path)
        prompt = prompts(1, [70], seed=51)[0]
        first = run(a, prompt, ANSWER)
        assert cached(first) == 0
        # b never saw it: its blocks come from what a's prefill wrote
        again = run(b, prompt, ANSWER)
        assert (
            again.tokens
            == first.tokens
            == reference.generate(model, prompt, ANSWER, block_size=BLOCK)
        )
        assert cached(again) == expected_hit([prompt], prompt)
        # and the answer a's decode wrote, in b's next turn
        follow = prompt + first.tokens + prompts(1, [5], seed=52)[0]
        turn = run(b, follow, ANSWER)
        assert turn.tokens == reference.generate(model, follow, ANSWER, block_size=BLOCK)
        assert cached(turn) == (len(prompt) + len(first.tokens) - 1) // BLOCK * BLOCK
    finally:
        for pair in (a, b):
            if pair is not None:
                pair.kill_all()


async def _burst(sock: str, batch: list[list[int]]) -> None:
    async def one(p: list[int]) -> None:
        with contextlib.suppress(Exception):  # the daemon was killed under it
            await client.generate(sock, prompt_tokens=p, sampling=ANSWER)

    await asyncio.gather(*(one(p) for p in batch))


def test_a_killed_pair_leaves_the_tier_consistent(
    tmp_path_factory: pytest.TempPathFactory, tier_path: Path, tiny
) -> None:  # type: ignore[no-untyped-def]
    from common.kv.host_tier import HostTier

    model, _ = tiny
    a = b = None
    try:
        a = make_pair(tmp_path_factory, tier_path)
        b = make_pair(tmp_path_factory, tier_path)
        burst = prompts(8, [64, 90, 40], seed=61)
        proc = subprocess.Popen(  # a's daemons write and read the tier while they are killed
            [sys.executable, "-c", f"import asyncio, {__name__} as t; "
             f"asyncio.run(t._burst({a.client_socket!r}, {burst!r}))"],
        )  # fmt: skip
        time.sleep(1.0)
        a.kill_all()
        proc.wait(60)
        # the other pair serves on, from the same tier
        prompt = burst[0]
        want = reference.generate(model, prompt, ANSWER, block_size=BLOCK)
        assert run(b, prompt, ANSWER).tokens == want
        assert run(b, prompt, ANSWER).tokens == want
        tier = HostTier.attach(tier_path)
        tier.verify()  # the index agrees with the slots
        tier.reclaim()  # slots a's daemons were writing when killed
        tier.verify()
        tier.close()
        # restarted, a maps the same tier: what b wrote is found there
        a.start("decode", "--num-blocks", "64", *tier_args(tier_path))
        a.start("prefill", *SMALL_POOL, *tier_args(tier_path))
        again = run(a, prompt, ANSWER)
        assert again.tokens == want
        assert cached(again) == expected_hit([prompt], prompt)
        assert tier_stats(a)["checksum_failures"] == 0
    finally:
        for pair in (a, b):
            if pair is not None:
                pair.kill_all()


def test_a_tier_too_small_for_one_block_is_refused(runtime_dir: Path, tier_path: Path) -> None:
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(runtime_dir), "prefill"]
    argv += ["start", "--device", "cpu", "--host-cache-gb", "0.000001"]
    argv += ["--host-cache-path", str(tier_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds no KV block" in errors[0]
