"""One copy of the weights on one GPU (gpu marker): the decode maps the prefill's arena over CUDA
IPC (or the other way round), the GPU holds one copy fewer than with --no-share-weights, the
greedy tokens are transformers' either way, and an importer whose owner is SIGKILLed stops at once
(exit 1, `weights_owner_lost`) instead of reading memory that may be gone.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model.sampling import SamplingParams
from tests.support.daemons import Pair, short_dir, wait_ready

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
PROMPTS = [[1, *range(40, 60)], [1, 7, 250, 3, 99, 42]]
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], int]:
    """(dir, transformers' fp32 greedy tokens for PROMPTS, the weights' bytes in fp32)."""
    path = tmp_path_factory.mktemp("gpuw")
    cfg = transformers.LlamaConfig(
        **SHAPE, initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(prompt) :])
    nbytes = sum(p.numel() * 4 for p in hf.parameters())
    return path, want, nbytes


def _args(path: Path) -> tuple[str, ...]:
    return ("--model", str(path), "--allow-byte-tokenizer", "--device", "cuda:0")


def _greedy(pair: Pair) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair.client_socket, prompt_tokens=p, sampling=params)
                for p in PROMPTS
            )
        )

    return [r.tokens for r in asyncio.run(run())]


def _used() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def _events(d, event: str) -> list[dict]:  # type: ignore[no-untyped-def]
    lines = d.log_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e["event"] == event]


def _pair_used(factory: pytest.TempPathFactory, path: Path, *flags: str) -> tuple:
    pair = Pair(short_dir(factory))
    # fp32: transformers' greedy tokens are the oracle
    args = (*_args(path), "--dtype", "float32", "--num-blocks", "256", *flags)
    try:
        pair.start("decode", *args)
        pair.start("prefill", *args)
        tokens = _greedy(pair)
        used = _used()
        roles = [e["role"] for d in pair.daemons.values() for e in _events(d, "weights")]
        return tokens, used, roles
    finally:
        assert pair.stop_all() == {"prefill": 0, "decode": 0}
        pair.kill_all()


def test_gpu_pair_holds_one_copy_and_its_tokens_are_transformers(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple
) -> None:
    path, want, nbytes = checkpoint
    torch.cuda.init()
    shared_tokens, shared, roles = _pair_used(tmp_path_factory, path)
    own_tokens, own, _ = _pair_used(tmp_path_factory, path, "--no-share-weights")
    assert sorted(roles) == ["importer", "owner"]
    assert shared_tokens == want and own_tokens == want
    print(f"GPU used by the pair: {own / 2**20:.0f} MiB unshared, {shared / 2**20:.0f} shared")
    assert 0.85 * nbytes < own - shared < 1.2 * nbytes, (own, shared, nbytes)


def test_gpu_importer_stops_when_its_owner_is_killed(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple
) -> None:
    path, want, _ = checkpoint
    pair = Pair(short_dir(tmp_path_factory))
    args = (*_args(path), "--dtype", "float32", "--num-blocks", "256")
    try:
        prefill = pair.start("prefill", *args)  # first: the owner
        decode = pair.start("decode", *args)
        wait_ready(prefill, linked=True)
        assert _greedy(pair) == want
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(timeout=10)
        assert decode.proc.wait(timeout=30) == 1
        lost = _events(decode, "weights_owner_lost")
        assert lost and lost[0]["owner_pid"] == prefill.proc.pid
        # restarted (as systemd would), the decode owns the weights and the prefill maps them
        decode = pair.start("decode", *args)
        prefill = pair.start("prefill", *args)
        assert _events(prefill, "weights_mapped")[-1]["owner_pid"] == decode.proc.pid
        assert _greedy(pair) == want
        assert pair.stop_all() == {"prefill": 0, "decode": 0}
    finally:
        pair.kill_all()
