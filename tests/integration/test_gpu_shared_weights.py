"""One copy of the weights on one GPU (gpu marker): the second daemon maps the first's arena (a
VMM allocation shared as an fd, or legacy CUDA IPC without it), the GPU holds one copy fewer than
with --no-share-weights, and the greedy tokens are transformers' either way. The owner SIGKILLed:
with VMM the importer serves on and takes over; through legacy IPC it stops at once (exit 1,
`weights_owner_lost`) instead of reading memory that may be gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import client
from common.cuda import cuda_available
from common.model.sampling import SamplingParams
from tests.support.daemons import Pair, short_dir, wait_ready
from tests.support.wait import poll

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
    out = []
    for line in d.log_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a last line still being written
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            out.append(entry)
    return out


def _pair_used(factory: pytest.TempPathFactory, path: Path, *flags: str) -> tuple:
    pair = Pair(short_dir(factory))
    # fp32: transformers' greedy tokens are the oracle
    # sharing is off on CUDA by default until these tests have run there: asked for here
    args = (
        *_args(path),
        "--dtype",
        "float32",
        "--num-blocks",
        "256",
        *(flags or ("--share-weights",)),
    )
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


def test_gpu_owner_killed(tmp_path_factory: pytest.TempPathFactory, checkpoint: tuple) -> None:
    """The owner (the prefill, started first) SIGKILLed. With VMM (the extension's cuda-vmm
    arena, an fd that outlives its exporter) the decode serves on, takes the weights over and its
    restarted prefill maps them; through legacy CUDA IPC the decode exits 1 at once."""
    from common.ipc import vmm

    path, want, _ = checkpoint
    pair = Pair(short_dir(tmp_path_factory))
    args = (*_args(path), "--dtype", "float32", "--num-blocks", "256", "--share-weights")
    try:
        prefill = pair.start("prefill", *args)  # first: the owner
        decode = pair.start("decode", *args)
        wait_ready(prefill, linked=True)
        assert _greedy(pair) == want
        shared = _events(prefill, "weights_shared")
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(timeout=10)
        if vmm.usable(0):
            assert shared[0]["kind"] == "cuda-vmm"
            poll(lambda: _events(decode, "weights_owner_taken_over"), timeout=30, what="takeover")
            assert decode.proc.poll() is None
        else:
            assert decode.proc.wait(timeout=30) == 1
            lost = _events(decode, "weights_owner_lost")
            assert lost and lost[0]["owner_pid"] == prefill.proc.pid
            decode = pair.start("decode", *args)  # restarted, as systemd would
        prefill = pair.start("prefill", *args)
        assert _events(prefill, "weights_mapped")[-1]["owner_pid"] == decode.proc.pid
        assert _greedy(pair) == want
        assert pair.stop_all() == {"prefill": 0, "decode": 0}
    finally:
        pair.kill_all()


def test_vmm_arena_outlives_its_exporter_and_is_read_only_to_importers() -> None:
    """csrc/vmm.cpp: a child maps the parent's allocation through the fd, the parent frees its
    tensor and closes the fd, the child still reads the bytes; a write through the importer's
    read-only mapping fails instead of changing them."""
    from common.ipc import vmm

    if not vmm.usable(0):
        pytest.skip("the extension or driver has no shareable VMM allocations")
    dev = torch.device("cuda:0")
    arena, fd, size = vmm.vmm_empty(3 << 20, dev)
    arena.copy_(torch.arange(3 << 20, device=dev).to(torch.uint8))
    torch.cuda.synchronize()
    want = int(arena.sum())
    code = (
        "import os, sys, torch\n"
        "from common.ipc import vmm\n"
        "fd, size, n = (int(x) for x in sys.argv[1:4])\n"
        "t = vmm.vmm_open(fd, size, n, torch.device('cuda:0'))\n"
        "os.close(fd)\n"
        "print('mapped', flush=True)\n"
        "sys.stdin.readline()  # the parent has let go\n"
        "print('sum', int(t.sum()), flush=True)\n"
        "try:\n"
        "    t.fill_(0); torch.cuda.synchronize(); print('wrote', flush=True)\n"
        "except Exception as e:\n"
        "    print('refused', type(e).__name__, flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(fd), str(size), str(3 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(fd,),
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "mapped"
    del arena
    os.close(fd)
    torch.cuda.synchronize()
    child.stdin.write("go\n")
    child.stdin.flush()
    out, _ = child.communicate(timeout=60)
    assert f"sum {want}" in out
    assert "wrote" not in out
