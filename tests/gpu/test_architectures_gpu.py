"""Every architecture through the daemons on CUDA (gpu marker): greedy tokens equal transformers'.

Issue 41's GPU anchor: random fp32 checkpoints of each family (odd shapes, biases and q/k norms
moved off their neutral values, tests/support/checkpoints.py) served by a prefill and a decode on
one GPU in fp32, so the Triton kernels, the prefill's CUDA graphs and the decode's graphs are all
on the path; the prefix cache is on and each prompt is sent twice, the second time a cache hit
whose forward runs the paged-context kernel. Then one layer at the 8B shapes (full width: hidden
4096, 32 heads, 8 KV heads, Llama-3's and Qwen3's vocabularies) so the kernels see real widths.
transformers runs on the same GPU in fp32 as the oracle.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model.sampling import SamplingParams
from tests.support.checkpoints import save_hf_model

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]

NEW_TOKENS = 12
PROMPTS = [[1, *range(40, 61)], [1, 7, 250, 3, 99, 42], [1, *range(100, 170)]]
GPU_ARGS = ("--device", "cuda:0", "--dtype", "float32")

# One layer at the 8B shapes; initializer_range wide enough that the argmax has a margin far
# above fp32's differences between cuBLAS and the kernels at 4096 wide.
WIDE: dict[str, tuple[str, dict]] = {
    "llama3-8b-1layer": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500000.0,
        ),
    ),
    "qwen3-8b-1layer": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
}


def _hf_greedy(hf, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Argmax continuation by full forwards on the GPU (no cache, no end-of-sequence stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([ids], device="cuda:0")).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _serve_twice(pair, model_dir: Path) -> tuple[list[list[int]], list[int]]:
    """Each prompt through the pair, then again (a prefix-cache hit); tokens and cached counts."""
    model = ("--model", str(model_dir), "--allow-byte-tokenizer", *GPU_ARGS)
    pair.start("decode", *model)
    pair.start("prefill", *model)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run() -> list[client.Result]:
        sock = pair.client_socket
        first = await asyncio.gather(
            *(client.generate(sock, prompt_tokens=p, sampling=greedy) for p in PROMPTS)
        )
        again = [await client.generate(sock, prompt_tokens=p, sampling=greedy) for p in PROMPTS]
        return [*first, *again]

    got = asyncio.run(run())
    assert pair.stop_all() == {"prefill": 0, "decode": 0}
    return [r.tokens for r in got], [r.finish.usage.cached_tokens for r in got]


@pytest.mark.parametrize(
    ("family", "tie"),
    [("llama", False), ("qwen2", True), ("qwen3", False), ("mistral", False)],
    ids=["llama", "qwen2-tied", "qwen3", "mistral"],
)
def test_daemons_on_cuda_equal_transformers(pair_factory, tmp_path, family, tie) -> None:
    hf = save_hf_model(tmp_path / family, family, tie=tie).to("cuda:0")
    want = [_hf_greedy(hf, p) for p in PROMPTS]
    tokens, cached = _serve_twice(pair_factory, tmp_path / family)
    assert tokens == want + want
    assert all(c > 0 for c, p in zip(cached[len(PROMPTS) :], PROMPTS, strict=True) if len(p) > 16)


@pytest.mark.parametrize("shape", list(WIDE))
def test_one_layer_at_the_8b_shape_equals_transformers(pair_factory, tmp_path, shape) -> None:
    family, fields = WIDE[shape]
    path = tmp_path / shape
    with torch.device("cuda:0"):
        hf = save_hf_model(
            path, family, config={**fields, "num_hidden_layers": 1, "max_position_embeddings": 4096}
        )
    want = [_hf_greedy(hf, p) for p in PROMPTS]
    del hf
    torch.cuda.empty_cache()
    tokens, _ = _serve_twice(pair_factory, path)
    assert tokens == want + want
