"""The two daemons on two "hosts": network namespaces joined by a veth pair, the prefill in one,
the decode in the other, a TCP link with a shared key, the KV moved by NIXL over UCX's TCP
transport (shared memory between the namespaces is switched off, so every byte crosses the veth).
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from common import client
from common.model import reference
from common.model.loader import load_model
from common.model.sampling import SamplingParams
from tests.support.daemons import Daemon, all_free, wait_ready
from tests.support.load import Load
from tests.support.netns import Hosts, netns_skip_reason
from tests.support.wait import poll

_why_not = netns_skip_reason()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=_why_not or "")
PORT = 47391
KEY = "5f0c2b9d8e7a6143a1b2c3d4e5f60718293a4b5c6d7e8f90"


HELLO_WITHOUT_KEY = """
import socket
from common.protocol import HEADER_SIZE, PROTOCOL_VERSION, Hello, decode, encode
from common.protocol.frame import parse_header
s = socket.create_connection(("{addr}", {port}), timeout=20)
s.sendall(encode(Hello(protocol_version=PROTOCOL_VERSION, fingerprint="x", backend="shm", pid=1)))
head = b""
while len(head) < HEADER_SIZE:
    head += s.recv(HEADER_SIZE - len(head))
_, meta, mem, ev = parse_header(head)
body = b""
while len(body) < meta + mem + ev:
    body += s.recv(meta + mem + ev - len(body))
msg = decode(head + body)
print(type(msg).__name__.upper(), msg.code)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": os.getcwd()}


@dataclass
class CrossPair:
    hosts: Hosts
    root: Path
    daemons: dict[str, Daemon] = field(default_factory=dict)

    def key_file(self, name: str, key: str = KEY) -> Path:
        path = self.root / name
        path.write_text(key + "\n")
        path.chmod(0o600)
        return path

    def start(self, role: str, *args: str, key: str = KEY, wait: bool = True) -> Daemon:
        rt = self.root / role
        rt.mkdir(mode=0o700, exist_ok=True)
        ns = self.hosts.decode_ns if role == "decode" else self.hosts.prefill_ns
        argv = [*self.hosts.exec_argv(ns), sys.executable, "-m", "pdkv.cli"]
        argv += ["--runtime-dir", str(rt), "--log-format", "json", role, "start"]
        argv += ["--device", "cpu", "--heartbeat-timeout", "3", "--num-blocks", "256"]
        argv += ["--link-key-file", str(self.key_file(f"{role}.key", key)), *args]
        log = self.root / f"{role}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, env=_env()
            )
        sock = rt / ("prefill.sock" if role == "prefill" else "decode.sock")
        d = self.daemons[role] = Daemon(role, proc, sock, log)
        if wait:
            wait_ready(d, linked=role == "prefill")
        return d

    def start_both(self, transfer: str) -> None:
        self.start("decode", "--listen", f"tcp://{self.hosts.decode_ip}:{PORT}")
        self.start(
            "prefill", "--decode", f"tcp://{self.hosts.decode_ip}:{PORT}", "--transfer", transfer
        )

    def sock(self, role: str) -> str:
        return str(self.daemons[role].socket)

    def kill_all(self) -> None:
        for d in self.daemons.values():
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait(timeout=10)


@pytest.fixture
def cross(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrossPair]:
    hosts = Hosts()
    pair = CrossPair(hosts, tmp_path_factory.mktemp("x"))
    try:
        hosts.create()
        yield pair
    finally:
        pair.kill_all()
        hosts.remove()


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model(None)


@pytest.mark.parametrize("transfer", ["push", "pull"])
def test_greedy_output_across_hosts_equals_the_reference(cross: CrossPair, tiny, transfer: str):
    cross.start_both(transfer)
    model, _ = tiny
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([5, 16, 17, 40, 90, 33])]
    params = [SamplingParams(max_tokens=6 + i, ignore_eos=True) for i in range(len(prompts))]

    async def run_all() -> list[client.Result]:
        return await asyncio.gather(
            *(
                client.generate(cross.sock("prefill"), prompt_tokens=p, sampling=s)
                for p, s in zip(prompts, params, strict=True)
            )
        )

    results = asyncio.run(run_all())
    for i, (res, p, s) in enumerate(zip(results, prompts, params, strict=True)):
        assert res.tokens == reference.generate(model, p, s, block_size=16), f"request {i}"
        assert res.finish is not None  # the prefill's clock means nothing on the decode's host:
        assert res.finish.timings["decode_handoff_us"] == 0  # no cross-host latency from it
        assert res.finish.timings["handoff_after_first_us"] < 0  # handed off early (v11)
    poll(lambda: all_free(cross.sock("prefill")), what="prefill pool all free")
    poll(lambda: all_free(cross.sock("decode")), what="decode pool all free")
    links = asyncio.run(client.status(cross.sock("decode"))).links
    assert [link["transport"] for link in links] == ["tcp"]
    assert links[0]["handoffs"] == len(prompts)
    assert f'"backend": "nixl-{transfer}"' in cross.daemons["decode"].log_text()
    # pull is slow wherever UCX has no RDMA: the prefill says so at start, push says nothing
    assert ('"nixl_pull_is_slow_here"' in cross.daemons["prefill"].log_text()) == (
        transfer == "pull"
    )
    if transfer == "push":  # no NIXL progress thread spinning a core while nothing moves
        pids = {role: d.proc.pid for role, d in cross.daemons.items()}
        before = {role: _cpu_seconds(pid) for role, pid in pids.items()}
        time.sleep(2.0)
        used = {role: _cpu_seconds(pid) - before[role] for role, pid in pids.items()}
        assert all(s < 0.5 for s in used.values()), used  # spinning: ~2 s each


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_wrong_key_is_refused_and_logged_on_both_ends(cross: CrossPair):
    cross.start("decode", "--listen", f"tcp://{cross.hosts.decode_ip}:{PORT}")
    prefill = cross.start(
        "prefill", "--decode", f"tcp://{cross.hosts.decode_ip}:{PORT}", key=KEY[::-1], wait=False
    )
    decode_log = cross.daemons["decode"].log_text
    poll(lambda: "AUTH_FAILED" in decode_log(), what="the decode logs the refusal")
    poll(lambda: "link_auth_failed" in prefill.log_text(), what="the prefill logs the refusal")
    wait_ready(prefill)  # it serves its socket, without a link
    st = asyncio.run(client.status(cross.sock("prefill")))
    assert st.links[0]["state"] == "down"
    assert "--link-key-file differ" in str(st.links[0]["last_error"])
    assert not asyncio.run(client.status(cross.sock("decode"))).links  # no link was made
    # a client without the key (HELLO without a nonce) learns nothing but AUTH_FAILED
    probe = HELLO_WITHOUT_KEY.format(addr=cross.hosts.decode_ip, port=PORT)
    argv = [*cross.hosts.exec_argv(cross.hosts.prefill_ns), sys.executable, "-c", probe]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_env())
    assert out.stdout.split() == ["ERROR", "AUTH_FAILED"], out.stderr[-2000:]


def test_pulling_the_cable_fails_requests_with_link_lost_and_frees_every_block(cross: CrossPair):
    cross.start_both("push")
    load = Load(cross.sock("prefill"), n=4, max_tokens=800, timeout=60)

    async def run() -> None:
        task = asyncio.create_task(load.run())
        while load.tokens_seen < 30:  # every request is decoding across the link
            await asyncio.sleep(0.05)
        cross.hosts.cut()
        await task

    asyncio.run(run())
    ends = collections.Counter(o.end for o in load.outcomes)
    assert ends == {"LINK_LOST": 4}, ends
    poll(lambda: all_free(cross.sock("prefill")), what="prefill pool all free after the cut")
    poll(lambda: all_free(cross.sock("decode")), what="decode pool all free after the cut")
    assert not asyncio.run(client.status(cross.sock("decode"))).links


@pytest.mark.parametrize("transfer", ["push", "pull"])
def test_clients_leaving_during_the_forward_leave_no_block_held_on_either_host(
    cross: CrossPair, tiny, transfer: str
):
    """Early HANDOFFs across hosts whose clients leave while the prefill computes: the prefill
    drops the decode's held PUSH and sends ABORT, the decode frees what it reserved; nothing
    stays held, and the link serves the next requests to the reference."""
    cross.start_both(transfer)
    model, _ = tiny
    prompt = [(5 * j) % 256 for j in range(480)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def leave_after(delay_s: float) -> None:
        task = asyncio.create_task(
            client.generate(cross.sock("prefill"), prompt_tokens=prompt, sampling=params)
        )
        await asyncio.sleep(delay_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def run() -> list[client.Result]:
        await asyncio.gather(*(leave_after(0.002 * i) for i in range(24)))
        return [
            await client.generate(cross.sock("prefill"), prompt_tokens=p, sampling=params)
            for p in (prompt, prompt[:100])
        ]

    for res, p in zip(asyncio.run(run()), (prompt, prompt[:100]), strict=True):
        assert res.tokens == reference.generate(model, p, params, block_size=16)
    poll(lambda: all_free(cross.sock("prefill")), what="prefill pool all free")
    poll(lambda: all_free(cross.sock("decode")), what="decode pool all free")
    decode_log, prefill_log = (cross.daemons[r].log_text() for r in ("decode", "prefill"))
    assert decode_log.count('"request_aborted"') >= 1  # ABORTs reached it: it held those early
    # no PUSH refused as if it named others' blocks, and no pull failed: a PUSH that crossed an
    # ABORT is answered as such, a WRITE that KV_READY announced goes before the blocks are freed
    assert '"nixl_push_refused"' not in prefill_log and '"pull_failed"' not in decode_log
