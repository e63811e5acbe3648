"""The interprocess event ring really orders a peer's stream, and slots are reused only after
the peer's ack (a variant that reuses early is shown to be caught)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.support import gpu_procs

pytestmark = pytest.mark.gpu

SPIN = 200_000_000  # torch.cuda._sleep cycles: ~100 ms at H200 clocks


def test_event_wait_orders_peer_writes(spawn) -> None:
    n = 1 << 22
    out, cmd = spawn.Queue(), spawn.Queue()
    child = spawn.Process(
        target=gpu_procs.prefill_after_spin, args=(n, 3.0, SPIN, out, cmd), daemon=True
    )
    child.start()
    raw_desc, handles = out.get(timeout=gpu_procs.TIMEOUT)
    region, ring = gpu_procs.open_ring(raw_desc, handles, 0)
    shared = region.to_tensor()
    cmd.put("go")
    slot = out.get(timeout=gpu_procs.TIMEOUT)
    stream = torch.cuda.Stream(0)
    ring.wait(slot, stream)
    with torch.cuda.stream(stream):
        seen = shared.clone()
    stream.synchronize()
    cmd.put("done")
    child.join(timeout=gpu_procs.TIMEOUT)
    assert torch.all(seen == 3.0), f"saw {seen.unique().tolist()} before the peer's write ended"
    ring.close()
    region.close()


def _decode(spawn, early_reuse: bool) -> list[tuple[int, float]]:
    """Run the slow-decode scenario; return the (request, seen value) pairs that were wrong."""
    out, acks = spawn.Queue(), spawn.Queue()
    child = spawn.Process(
        target=gpu_procs.prefill_cycling,
        args=(16, 4, SPIN // 20, early_reuse, out, acks),
        daemon=True,
    )
    child.start()
    raw_desc, handles = out.get(timeout=gpu_procs.TIMEOUT)
    region, ring = gpu_procs.open_ring(raw_desc, handles, 0)
    buf = region.to_tensor()
    stream = torch.cuda.Stream(0)
    wrong = []
    while (msg := out.get(timeout=gpu_procs.TIMEOUT)) is not None:
        i, slot = msg
        time.sleep(0.01)  # slow decode: the prefill runs ahead as far as the ring lets it
        ring.wait(slot, stream)
        with torch.cuda.stream(stream):
            seen = buf[slot].clone()
        stream.synchronize()
        if not torch.all(seen == float(i)):
            wrong.append((i, float(seen[0])))
        if not early_reuse:
            acks.put(slot)  # RELEASE: only now may the prefill record this slot again
    acks.put(-1)
    child.join(timeout=gpu_procs.TIMEOUT)
    assert child.exitcode == 0
    ring.close()
    region.close()
    return wrong


def test_slots_reused_only_after_ack(spawn) -> None:
    assert _decode(spawn, early_reuse=False) == []


def test_early_slot_reuse_is_caught(spawn) -> None:
    # Control: the same scenario with slots released at once must show wrong values, which
    # proves the test above would catch a ring that handed out slots before the ack.
    assert _decode(spawn, early_reuse=True) != []
