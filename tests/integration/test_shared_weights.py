"""One copy of the weights per host (--share-weights), through the real daemons on the CPU.

A 131 MB random checkpoint (a 256k-token vocabulary: the embedding and the head are 65.5 MB each)
is served by a pair that shares it and by one that does not: both give transformers' greedy tokens,
and the sharing pair's proportional set size (PSS, /proc/PID/smaps_rollup: a shared page counts
1/n in each of its n processes) is one copy of the weights smaller. Then the owner of the weights
is SIGKILLed: the other daemon serves on from its mapping and takes the ownership over, and the
restarted daemon maps the weights from it instead of loading them.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from common import client
from common.model.sampling import SamplingParams
from tests.support.daemons import Pair, short_dir, wait_ready
from tests.support.wait import poll

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
PROMPTS = [[1, *range(40, 60)], [1, 7, 250, 3, 99, 42]]
VOCAB, HIDDEN = 256_000, 64
WEIGHTS = 2 * VOCAB * HIDDEN * 4  # embed + lm_head, fp32: the bulk of the arena


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The checkpoint's directory and transformers' greedy tokens for PROMPTS."""
    path = tmp_path_factory.mktemp("big")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])
    return path, want


def _model(path: Path) -> tuple[str, ...]:
    return ("--model", str(path), "--allow-byte-tokenizer", "--num-blocks", "64")


def _greedy(pair: Pair) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair.client_socket, prompt_tokens=p, sampling=greedy)
                for p in PROMPTS
            )
        )

    return [r.tokens for r in asyncio.run(run())]


def _pss(pid: int) -> int:
    """Proportional set size of `pid`, bytes."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Pss line for pid {pid}")


def _events(pair: Pair, role: str, event: str) -> list[dict]:
    return _parsed(pair.daemons[role].log_text(), event)


def _parsed(text: str, event: str) -> list[dict]:
    """The log's JSON lines of `event`; a last line still being written is skipped."""
    out = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            out.append(entry)
    return out


def _pair_pss(tmp_path_factory: pytest.TempPathFactory, path: Path, *flags: str) -> tuple:
    pair = Pair(short_dir(tmp_path_factory))
    try:
        pair.start("decode", *_model(path), *flags)
        pair.start("prefill", *_model(path), *flags)
        tokens = _greedy(pair)  # every weight page touched in both processes
        pss = sum(_pss(d.proc.pid) for d in pair.daemons.values())
        return tokens, pss, pair
    finally:
        assert pair.stop_all() == {"prefill": 0, "decode": 0}
        pair.kill_all()


def test_the_pair_holds_one_copy_of_the_weights(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple[Path, list[list[int]]]
) -> None:
    path, want = checkpoint
    shared_tokens, shared, pair = _pair_pss(tmp_path_factory, path)
    own_tokens, own, _ = _pair_pss(tmp_path_factory, path, "--no-share-weights")
    assert shared_tokens == want and own_tokens == want
    assert [e["role"] for e in _events(pair, "decode", "weights")] == ["owner"]
    assert [e["role"] for e in _events(pair, "prefill", "weights")] == ["importer"]
    saved = own - shared
    print(f"pair PSS: {own / 2**20:.0f} MiB unshared, {shared / 2**20:.0f} MiB shared")
    # one copy of the weights (131 MB) less, within the noise of two torch processes' heaps
    assert 0.85 * WEIGHTS < saved < 1.25 * WEIGHTS, (own, shared)


def test_the_owner_killed_the_other_serves_on_and_hands_the_weights_to_its_restart(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple[Path, list[list[int]]]
) -> None:
    path, want = checkpoint
    pair = Pair(short_dir(tmp_path_factory))
    try:
        prefill = pair.start("prefill", *_model(path))  # first: it loads and owns the weights
        decode = pair.start("decode", *_model(path))
        wait_ready(prefill, linked=True)
        assert _greedy(pair) == want
        assert _events(pair, "decode", "weights_mapped")[0]["owner_pid"] == prefill.proc.pid

        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(timeout=10)
        try:
            poll(lambda: _events(pair, "decode", "weights_owner_taken_over"), timeout=20)
        except AssertionError:
            raise AssertionError(f"no takeover:\n{decode.log_text()[-4000:]}") from None
        assert decode.proc.poll() is None

        again = pair.start("prefill", *_model(path))
        mapped = _events(pair, "prefill", "weights_mapped")
        assert mapped and mapped[-1]["owner_pid"] == decode.proc.pid
        assert _greedy(pair) == want
        assert again.stop() == 0 and decode.stop() == 0
    finally:
        pair.kill_all()
