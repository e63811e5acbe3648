"""The daemons target of bench/serve.py: a pair of its own on temporary sockets, or running ones.

`own_pair` starts a decode then a prefill daemon through the real CLI in a fresh 0700 temp
runtime dir (without waiting in between: they load their models side by side and the prefill's
link retries until the decode listens), waits until the prefill reports its link up, and at the
end stops the prefill then the decode (SIGTERM, SIGKILL after a timeout) and removes the
directory, logs included; if the pair fails to come up, the error carries the tail of its logs. `daemon_stream` is one request
through `common.client`, yielding the token ids of each TOKENS frame as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from serve_load import ServerTimings

from common import client
from common.daemon.rundir import child_pids
from common.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
_SOCK_MAX = 100  # AF_UNIX paths are limited to 108 bytes


class PairFailed(RuntimeError):
    """The daemons did not come up; the message holds the tail of their logs."""


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc; other jobs do not inflate it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> dict[int, float]:
    """`process_cpu_s` of `pid` and of each of its live children (an API's workers), by pid."""
    found = {}
    for p in [pid, *child_pids(pid)]:
        with contextlib.suppress(FileNotFoundError):  # a child that exited meanwhile
            found[p] = process_cpu_s(p)
    return found


#: a directory: the daemons log at INFO and each pair's logs are copied there when it stops
#: (pairN-<role>.log), e.g. for bench/forward_gaps.py; unset: WARNING, and the logs go with
#: the pair's runtime dir
KEEP_LOGS = "PDKV_BENCH_LOGS"


def start_cli(rt: Path, role: str, opts: list[str]) -> subprocess.Popen:
    """`pdkv --runtime-dir rt <role> start <opts>` in the background, its output in rt/<role>.log."""
    level = "INFO" if os.environ.get(KEEP_LOGS) else "WARNING"
    argv = [sys.executable, "-m", "pdkv.cli", "--runtime-dir", str(rt)]
    argv += ["--log-format", "json", "--log-level", level, role, "start", *opts]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    with open(rt / f"{role}.log", "ab") as log:
        return subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )


async def wait_linked(sock: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    """Return once the prefill daemon on `sock` answers STATUS with its link up; PairFailed when
    one of `procs` exits or the time is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise PairFailed(f"a daemon exited (codes {[p.poll() for p in procs]})")
        with contextlib.suppress(OSError, TimeoutError, client.PdkvError):
            st = await client.status(sock, timeout=1)
            if st.links and st.links[0]["state"] == "up":
                return
        await asyncio.sleep(0.05)
    raise PairFailed(f"{sock} not ready in {timeout:.0f} s")


def stop_procs(procs: list[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM each in order (no waiting in between: the run is over, nothing is in flight),
    then wait for all; SIGKILL what is still there after `timeout`."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _log_tails(rt: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}"
        for log in sorted(rt.glob("*.log"))
    )


def temp_runtime_dir() -> Path:
    base = tempfile.gettempdir()
    if len(base) + len("/pdkv-serve-xxxxxxxx/prefill.sock") > _SOCK_MAX:
        base = "/tmp"
    rt = Path(tempfile.mkdtemp(prefix="pdkv-serve-", dir=base))
    os.chmod(rt, 0o700)
    return rt


@contextlib.contextmanager
def tcp_link(transfer: str) -> Iterator[tuple[list[str], list[str]]]:
    """The decode's and the prefill's options for a TCP link on this host (NIXL `transfer`), on
    a free port with a fresh key file (removed at the end), as two hosts would be linked."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        addr = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    fd, key = tempfile.mkstemp(prefix="pdkv-serve-key-")
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        decode = ["--listen", addr, "--link-key-file", key]
        yield decode, ["--decode", addr, "--link-key-file", key, "--transfer", transfer]
    finally:
        os.unlink(key)


@contextlib.contextmanager
def own_pair(
    common_opts: list[str], decode_opts: list[str], prefill_opts: list[str] | None = None
) -> Iterator[str]:
    """Start a linked pair (see the module docstring) and yield the prefill's client socket."""
    rt = temp_runtime_dir()
    procs: list[subprocess.Popen] = []
    try:
        # both load their model at once; the prefill's link retries until the decode listens
        procs.append(start_cli(rt, "decode", common_opts + decode_opts))
        procs.append(start_cli(rt, "prefill", common_opts + (prefill_opts or [])))
        sock = str(rt / "prefill.sock")
        try:
            asyncio.run(wait_linked(sock, procs))
        except PairFailed as e:
            raise PairFailed(f"{e}\n{_log_tails(rt)}") from None
        yield sock
    finally:
        stop_procs(procs[::-1])  # prefill first: it stops taking requests, then the decode
        keep_logs(rt)
        shutil.rmtree(rt, ignore_errors=True)


def keep_logs(rt: Path) -> None:
    """With PDKV_BENCH_LOGS set, copy the pair's logs there, numbered by pair."""
    if not (dest := os.environ.get(KEEP_LOGS)):
        return
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    n = 1 + len({p.name.split("-", 1)[0] for p in out.glob("pair*-*.log")})
    for log in sorted(rt.glob("*.log")):
        shutil.copy(log, out / f"pair{n}-{log.name}")


#: per event loop and socket, the one connection requests share (`daemon_stream(shared=True)`)
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, client.Connection]] = (
    weakref.WeakKeyDictionary()
)


def _shared(sock: str) -> client.Connection:
    conns = _SHARED.setdefault(asyncio.get_running_loop(), {})
    if sock not in conns:
        conns[sock] = client.Connection(sock)
    return conns[sock]


async def daemon_stream(
    sock: str,
    prompt: list[int],
    output_len: int,
    timeout: float = 600,
    *,
    text: bool = False,
    shared: bool = False,
) -> AsyncIterator[list[int] | ServerTimings]:
    """One greedy request of exactly `output_len` tokens (ignore_eos); yields each frame's ids,
    then the daemons' timings of the request from its FINISH. `text`: ask for each frame's text
    too (GENERATE's `stream`, as the API does), so the prefill detokenizes every token.
    `shared`: on the one connection of this loop to `sock`, as the API sends every request
    (its TTFT then holds no connect); else on a connection of its own."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    kw = {"prompt_tokens": prompt, "sampling": params, "timeout": timeout, "text_deltas": text}
    frames = _shared(sock).stream(**kw) if shared else client.stream(sock, **kw)
    async for msg in frames:
        if isinstance(msg, client.Tokens) and msg.tokens:
            yield msg.tokens
        elif isinstance(msg, client.Finish) and msg.timings:
            yield ServerTimings({**msg.timings, "cached_tokens": msg.usage.cached_tokens})


def decode_pulled_blocks(prefill_sock: str) -> int:
    """Blocks the decodes behind this prefill have pulled since they started (their prefix cache
    counts every pull's copied blocks, with the cache on or off): summed over the prefill's links
    to decodes on Unix sockets (a tcp:// decode is not asked)."""

    async def ask() -> int:
        st = await client.status(prefill_sock, timeout=10)
        total = 0
        for link in st.links:
            decode = str(link.get("decode", ""))
            if decode and not decode.startswith("tcp://"):
                dst = await client.status(decode, timeout=10)
                total += int((dst.prefix_cache or {}).get("pulled_blocks", 0))
        return total

    return asyncio.run(ask())


def pool_sizes(prefill_sock: str) -> dict[str, int]:
    """Blocks in the prefill's pool and in its first decode's on a Unix socket (STATUS)."""

    async def ask() -> dict[str, int]:
        st = await client.status(prefill_sock, timeout=10)
        sizes = {"prefill": int(st.pool["total"])}
        for link in st.links:
            decode = str(link.get("decode", ""))
            if decode and not decode.startswith("tcp://"):
                sizes["decode"] = int((await client.status(decode, timeout=10)).pool["total"])
                break
        return sizes

    return asyncio.run(ask())


def kv_block_bytes(model: str | None, dtype: str | None, device: str, block_size: int) -> int:
    """Bytes of one KV block (K and V of every layer) of `model` in the daemons' dtype."""
    from common.model.config import LlamaConfig
    from common.model.loader import read_config

    c = LlamaConfig.tiny() if model is None else read_config(Path(model).expanduser())
    name = dtype or ("float32" if device == "cpu" else "bfloat16")
    width = 4 if name in ("float32", "fp32") else 2
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * block_size * width
