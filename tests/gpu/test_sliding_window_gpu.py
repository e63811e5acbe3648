"""Sliding-window attention on the GPU in fp32: the kernels, the decode and prefill CUDA graphs
and the daemons (prefix cache on) give transformers' greedy tokens for a window shorter than the
prompt, with prompts long enough that the window crosses blocks of 16 and the context is wider
than one of the decode kernel's 256-key splits (which start at each row's window)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model import SamplingParams, load_model, reference, slots_for
from tests.support.checkpoints import save_hf_model
from tests.support.daemons import Pair
from tests.support.gpu_runner import runner_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]
WINDOWED = {
    "mistral": {"sliding_window": 40},
    "qwen3": {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1},
}
NEW = 24
PROMPT = 300  # tokens: the decode's context crosses its kernel's 256-key splits


def _checkpoint(path: Path, family: str):  # type: ignore[no-untyped-def]
    """save_hf_model's windowed checkpoint with room for 1,024 positions (its 256 would hold no
    prompt past a decode split); the HF model on the GPU."""
    hf = save_hf_model(path, family, config={"max_position_embeddings": 1024}, **WINDOWED[family])
    return hf.to("cuda")


def _prompt(n: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [1, *(rng.randrange(3, 300) for _ in range(n - 1))]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Argmax continuation by full forwards (no cache, no end-of-sequence stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(hf(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", list(WINDOWED))
def test_kernels_and_graphs_with_a_window_equal_transformers(tmp_path: Path, family: str) -> None:
    """The eager kernels (reference.generate), the decode graphs (DecodeRunner) and a prefill
    graph over a cached prefix (PrefillGraphs) against transformers on the GPU, fp32."""
    from common.model.prefill_graphs import PrefillGraphs

    hf = _checkpoint(tmp_path, family)
    model, _ = load_model(tmp_path, device="cuda", dtype=torch.float32, allow_byte_tokenizer=True)
    assert model.use_kernels and any(model.config.layer_windows)
    prompt = _prompt(PROMPT)
    want = _hf_greedy(hf, prompt)
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    assert reference.generate(model, prompt, greedy) == want
    got, _ = runner_generate(model, [prompt], NEW)
    assert got[0] == want
    # the prompt's last 60 positions after 240 cached ones, replayed from a prefill graph
    with torch.no_grad():
        expected = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    kv = model.new_kv_cache(40, 16)
    table = list(range(39, 20, -1))  # 19 blocks, descending
    model.prefill_batch([torch.tensor(prompt[:240])], [slots_for(table, 0, 240, 16)], kv)
    graphs = PrefillGraphs(model, kv, max_tokens=256, max_seqs=2, max_blocks=24)
    graphs.capture()
    piece, slots = prompt[240:], slots_for(table, 240, 60, 16).tolist()
    bucket = graphs.bucket_for([60], [len(table)])
    assert bucket is not None
    logits = graphs.run([piece], [slots], [240], [table], bucket)[0]
    assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("family", list(WINDOWED))
def test_daemons_with_a_window_equal_transformers_fp32(
    pair_factory: Pair, tmp_path: Path, family: str
) -> None:
    """Both daemons on cuda:0 in fp32 (kernels, decode and prefill graphs, prefix cache on): a
    300-token prompt, then again (288 tokens from the cache: the windowed context kernel over
    cached blocks) beside a longer one sharing 17 of its blocks; transformers' tokens each."""
    hf = _checkpoint(tmp_path / family, family)
    prompt = _prompt(PROMPT)
    longer = [*prompt[:280], *_prompt(30, seed=9)]
    want = {tuple(p): _hf_greedy(hf, p) for p in (prompt, longer)}
    args = ("--model", str(tmp_path / family), "--allow-byte-tokenizer")
    args += ("--device", "cuda:0", "--dtype", "float32")
    pair_factory.start("decode", *args)
    pair_factory.start("prefill", *args)
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)

    async def run(*prompts: list[int]) -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(pair_factory.client_socket, prompt_tokens=p, sampling=greedy)
                for p in prompts
            )
        )

    (first,) = asyncio.run(run(prompt))
    assert first.finish.usage.cached_tokens == 0 and first.tokens == want[tuple(prompt)]
    again, shared = asyncio.run(run(prompt, longer))
    assert again.finish.usage.cached_tokens == 288
    assert shared.finish.usage.cached_tokens == 272
    assert again.tokens == want[tuple(prompt)]
    assert shared.tokens == want[tuple(longer)]
    assert pair_factory.stop_all() == {"prefill": 0, "decode": 0}
