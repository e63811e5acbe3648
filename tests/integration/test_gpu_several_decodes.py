"""One prefill and two decode daemons on one GPU (gpu marker; issue 23's wiring on the H200).

All three daemons on cuda:0 (run it under MPS to share the GPU as a deployment would:
`nvidia-cuda-mps-control -d` first, see docs/operations.md), the model from $PDKV_GPU_CKPT (an HF
checkpoint dir, e.g. the random 1.1B one `bench/engine.py --save-checkpoint` writes; default the
built-in tiny model), fp32: every request's greedy tokens equal the single-process reference, both
decodes serve some, FINISH names each, and no pool holds a block afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from tests.support.daemons import Pair, wait_ready

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="CUDA unavailable (no driver or no GPU)"),
]


@pytest.fixture
def trio(tmp_path_factory: pytest.TempPathFactory):
    pairs = {}
    for name in ("a", "b", "p"):
        path = Path(tmp_path_factory.mktemp(f"rt{name}", numbered=True))
        os.chmod(path, 0o700)
        pairs[name] = Pair(path)
    yield pairs
    for pair in pairs.values():
        pair.kill_all()


def test_gpu_one_prefill_two_decodes_equal_the_reference(trio):
    ckpt = os.environ.get("PDKV_GPU_CKPT")
    model_args = ("--model", ckpt, "--allow-byte-tokenizer") if ckpt else ()
    args = ("--device", "cuda:0", "--dtype", "float32", *model_args)
    a = trio["a"].start("decode", *args, "--num-blocks", "1024")
    b = trio["b"].start("decode", *args, "--num-blocks", "1024")
    prefill = trio["p"].start(
        "prefill", *args, "--decode", str(a.socket), "--decode", str(b.socket), wait=False
    )
    wait_ready(prefill, linked=True, timeout=300)
    rng = random.Random(5)
    vocab = 256 if ckpt is None else 32000
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.choice([17, 64, 200, 513]))] for _ in range(16)
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def all_of_them():  # type: ignore[no-untyped-def]
        return await asyncio.gather(
            *(
                client.generate(
                    str(prefill.socket), prompt_tokens=p, sampling=params, request_id=f"g{i}"
                )
                for i, p in enumerate(prompts)
            )
        )

    results = asyncio.run(all_of_them())
    model, _ = load_model(ckpt, device="cuda:0", dtype=torch.float32, allow_byte_tokenizer=True)
    for i, (res, p) in enumerate(zip(results, prompts, strict=True)):
        assert res.tokens == reference.generate(model, p, params), f"request {i}"
    named = {r.finish.decode.partition("@")[2] for r in results}
    assert named == {str(a.socket), str(b.socket)}, f"one decode got every request: {named}"
    served = [asyncio.run(client.status(str(d.socket))).served for d in (a, b)]
    assert sum(served) == len(prompts) and min(served) > 0, served
    for d in (prefill, a, b):
        st = asyncio.run(client.status(str(d.socket)))
        assert st.pool["free"] == st.pool["total"], f"{d.role} leaked blocks: {st.pool}"
