"""The transfer library between two real processes, on the CPU backend (docs/library.md).

    python examples/transfer_library.py

The owner (this script) registers a KV pool, writes a prompt's KV into three of its blocks and
names them, exports the pool and sends the payload and its fds over a Unix socketpair to the
peer (this script again, started with the other end of the socket). The peer imports the pool,
asks the owner which blocks hold the prompt (by the blocks' names), pulls them into its own
pool, pulls one more layer by layer, pushes a block back into the owner's pool, and sees a bad
pull refused. The owner checks the pushed block in its own memory. Each prints what it did and
every check as OK or FAILED; both exit 0 only if every check passed.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys

import torch

from common.errors import IpcError
from common.ipc.fdpass import MAX_FDS, recv_with_fds, send_with_fds
from common.kv.pool import KVPool, PoolLayout
from common.transfer.cache_manager import CacheManager

LAYOUT = PoolLayout(
    num_blocks=16, num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32"
)
MODEL = "example-model"  # seeds the block names: both sides name blocks for the same model
PROMPT = list(range(100, 112))  # three full blocks of four tokens
OWNER_BLOCKS = [5, 2, 7]  # where the owner keeps the prompt's KV
PUSHED_BLOCK = 9  # the owner's block the peer writes
PUSHED_MARK = 42  # ... with the values of block_kv(42)


def block_kv(mark: int) -> torch.Tensor:
    """One block's known KV: every element of layer l's K is 100*mark + 10*l, its V that + 1."""
    layer = torch.arange(LAYOUT.num_layers, dtype=torch.float32).view(-1, 1, 1, 1, 1)
    kv = torch.tensor([0.0, 1.0]).view(1, 2, 1, 1, 1)
    return (100.0 * mark + 10.0 * layer + kv).expand(LAYOUT.block_shape).contiguous()


class Report:
    """Prints one side's steps and checks; `failed` counts the checks that did not hold."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.failed = 0

    def say(self, line: str) -> None:
        print(f"[{self.side}] {line}", flush=True)

    def check(self, ok: bool, what: str) -> None:
        self.failed += not ok
        self.say(f"{'OK' if ok else 'FAILED'}: {what}")


def send_json(sock: socket.socket, **msg: object) -> None:
    sock.send(json.dumps(msg).encode())


def recv_json(sock: socket.socket) -> dict:
    data = sock.recv(1 << 16)  # SOCK_SEQPACKET: one recv is one whole message
    return json.loads(data) if data else {"op": "closed"}


def owner() -> int:
    report = Report("owner")
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    here.settimeout(60)
    peer = subprocess.Popen(
        [sys.executable, __file__, "--peer", str(there.fileno())], pass_fds=[there.fileno()]
    )
    there.close()

    mgr = CacheManager()
    pool = KVPool.create(LAYOUT)  # on CPU, in a memfd: shareable
    cache = mgr.register_blocks_cache(pool, model=MODEL)
    for block in OWNER_BLOCKS:  # stands in for a forward pass writing the prompt's KV
        pool.tensor[block] = block_kv(block)
    mgr.name_blocks(cache, OWNER_BLOCKS, mgr.block_names(cache, PROMPT))
    report.say(f"wrote and named the prompt's KV in blocks {OWNER_BLOCKS}")

    payload, fds = mgr.export_cache(cache)  # once per peer; the fds stay ours
    send_with_fds(here, payload, fds)
    report.say(f"exported the pool: {len(payload)} bytes of payload and {len(fds)} fd(s) sent")

    while (msg := recv_json(here))["op"] not in ("bye", "closed"):
        if msg["op"] == "lookup":
            names = [bytes.fromhex(name) for name in msg["names"]]
            send_json(here, blocks=mgr.lookup_blocks(cache, names))
        elif msg["op"] == "pushed":
            ok = torch.equal(pool.tensor[msg["block"]], block_kv(msg["mark"]))
            report.check(ok, f"block {msg['block']} holds the values the peer pushed")
            send_json(here, ok=ok)
    code = peer.wait(timeout=60)
    report.check(code == 0, f"the peer exited with {code}")
    mgr.close()
    here.close()
    report.say("all checks passed" if not report.failed else f"{report.failed} check(s) failed")
    return 1 if report.failed else 0


class EveryLayer:
    """A LayerSynchronizer that lets each layer through at once and records the order asked.
    An engine's would wait until its forward pass has written layer i of the source."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def synchronize_layer(self, layer_index: int, timeout_s: float) -> bool:
        self.asked.append(layer_index)
        return True


def peer(fd: int) -> int:
    report = Report("peer")
    sock = socket.socket(fileno=fd)
    sock.settimeout(60)
    mgr = CacheManager()

    payload, fds = recv_with_fds(sock, 1 << 16, MAX_FDS)
    theirs = mgr.import_cache(payload, fds)  # maps the owner's pool; the fds are taken over
    layout = theirs.blocks().layout
    report.say(f"imported the owner's pool: {layout.num_blocks} blocks of {layout.block_nbytes} B")
    mine = mgr.register_blocks_cache(
        KVPool.create(dataclasses.replace(layout, num_blocks=8)), model=MODEL
    )

    names = mgr.block_names(mine, PROMPT)  # the same names as the owner's: same model and layout
    send_json(sock, op="lookup", names=[name.hex() for name in names])
    found = recv_json(sock)["blocks"]
    report.check(found == OWNER_BLOCKS, f"the owner holds the prompt's blocks in {found}")

    local_ids = [0, 1, 2]
    mgr.pull_blocks(theirs, mine, found, local_ids)  # complete on return
    ok = all(
        torch.equal(mine.blocks().tensor[dst], block_kv(src))
        for src, dst in zip(found, local_ids, strict=True)
    )
    report.check(ok, f"pulled blocks {found} into {local_ids}: values match")

    layers = EveryLayer()
    task = mgr.transfer_cache_async(theirs, mine, [found[0]], [3], layers)
    task.synchronize(timeout_s=30)  # re-raises the transfer's error, if any
    ok = layers.asked == [0, 1] and torch.equal(mine.blocks().tensor[3], block_kv(found[0]))
    report.check(ok, f"pulled block {found[0]} into 3 layer by layer {layers.asked}: values match")

    mine.blocks().tensor[4] = block_kv(PUSHED_MARK)
    mgr.push_blocks(mine, theirs, [4], [PUSHED_BLOCK])  # writes the owner's memory
    send_json(sock, op="pushed", block=PUSHED_BLOCK, mark=PUSHED_MARK)
    report.check(recv_json(sock)["ok"], f"pushed block 4 into the owner's block {PUSHED_BLOCK}")

    try:
        mgr.pull_blocks(theirs, mine, [LAYOUT.num_blocks], [0])
        report.check(False, "a pull of a block the owner does not have is refused")
    except IpcError as exc:
        report.check(True, f"a pull of a block the owner does not have is refused: {exc}")

    send_json(sock, op="bye")
    mgr.close()  # unmaps the owner's pool and frees ours
    sock.close()
    return 1 if report.failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        sys.exit(peer(int(sys.argv[2])))
    sys.exit(owner())
