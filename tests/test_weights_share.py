"""common.ipc.weights: the host's one copy of a model's weights, between real processes.

This process loads and serves the arena; children (real processes, the same code path as a
daemon's) map it: without loading it, read-only, and only when its layout is theirs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from common.cuda import cuda_available, has_extension
from common.errors import CudaError
from common.ipc import vmm
from common.ipc.weights import WeightsKey, acquire, arena_kind, rendezvous
from common.model.arena import WeightsLayout
from common.model.config import LlamaConfig
from common.model.loader import tiny_weights
from tests.support.daemons import short_dir
from tests.support.wait import poll

KEY = WeightsKey("tiny-test", "float32", "cpu")
CPU = torch.device("cpu")

CHILD = """
import sys, torch
from pathlib import Path
from common.cuda import cuda_available, has_extension
from common.errors import CudaError
from common.ipc import vmm
from common.ipc.weights import WeightsKey, acquire, arena_kind, rendezvous
from common.model.arena import WeightsLayout
from common.model.config import LlamaConfig

def refuse(arena):
    raise SystemExit("loaded instead of mapping")

layout = WeightsLayout.of(LlamaConfig.tiny(**eval(sys.argv[2])), torch.float32, separate_head=True)
held = acquire(Path(sys.argv[1]), WeightsKey("tiny-test", "float32", "cpu"), layout,
               torch.device("cpu"), "shm", refuse, on_lost=print)
print("RESULT", held.role, held.owner_pid, float(held.arena.float().sum()), flush=True)
if sys.argv[3] == "write":
    held.arena[0] = 7
print("RESULT wrote", flush=True)
held.close()
"""


def _child(rundir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(rundir), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )


def _results(done: subprocess.CompletedProcess[str]) -> list[list[str]]:
    """The child's RESULT lines (its log lines go to stdout too), split."""
    return [ln.split()[1:] for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]


@pytest.fixture
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    rundir = short_dir(tmp_path_factory, "w")
    config = LlamaConfig.tiny()
    layout = WeightsLayout.of(config, torch.float32, separate_head=True)
    held = acquire(
        rundir,
        KEY,
        layout,
        CPU,
        "shm",
        lambda a: layout.fill(a, tiny_weights(config, 0)),
        on_lost=print,
    )
    yield rundir, held
    held.close()


def test_the_first_loads_and_serves_the_next_maps_without_loading(served) -> None:  # type: ignore[no-untyped-def]
    rundir, held = served
    assert held.role == "owner" and held.owner_pid == os.getpid()
    done = _child(rundir, "{}", "read")
    assert done.returncode == 0, done.stderr
    role, pid, total = _results(done)[0]
    assert (role, int(pid)) == ("importer", os.getpid())
    assert float(total) == pytest.approx(float(held.arena.float().sum()))


def test_the_importer_cannot_write_the_owners_weights(served) -> None:  # type: ignore[no-untyped-def]
    rundir, held = served
    before = held.arena.clone()
    done = _child(rundir, "{}", "write")
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert ["wrote"] not in _results(done)
    assert torch.equal(held.arena, before)


def test_weights_of_another_layout_are_never_offered(served) -> None:  # type: ignore[no-untyped-def]
    """Same key, another arena layout (another pdkv version, say): it loads its own."""
    rundir, _ = served
    done = _child(rundir, "{'intermediate_size': 256}", "read")
    assert done.returncode == 1 and "loaded instead of mapping" in done.stderr


def test_a_dead_owners_socket_is_taken_over(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A socket file nobody serves (its owner SIGKILLed) does not stop the next daemon."""
    rundir = short_dir(tmp_path_factory, "w")
    config = LlamaConfig.tiny()
    layout = WeightsLayout.of(config, torch.float32, separate_head=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale := rendezvous(rundir, KEY, layout, "shm")[1]))
    s.close()  # the file stays, no one listens: ECONNREFUSED
    held = acquire(rundir, KEY, layout, CPU, "shm", lambda a: a.fill_(1), on_lost=print)
    try:
        assert held.role == "owner"
        done = _child(rundir, "{}", "read")
        assert done.returncode == 0 and _results(done)[0][0] == "importer", done.stderr
    finally:
        held.close()
    assert not stale.exists()


def test_a_process_that_comes_during_the_load_waits_for_it_and_maps(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Both daemons started at once: the second blocks on the lock while the first loads (seen
    in /proc/locks) and then maps the arena instead of loading a second copy."""
    rundir = short_dir(tmp_path_factory, "w")
    config = LlamaConfig.tiny()
    layout = WeightsLayout.of(config, torch.float32, separate_head=True)
    child: list[subprocess.Popen[str]] = []

    def load(arena: torch.Tensor) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CHILD), str(rundir), "{}", "read"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        child.append(proc)
        poll(lambda: _blocked_on_flock(proc.pid), timeout=60, what="the child waits on the lock")
        layout.fill(arena, tiny_weights(config, 0))

    held = acquire(rundir, KEY, layout, CPU, "shm", load, on_lost=print)
    try:
        out, err = child[0].communicate(timeout=60)
        done = subprocess.CompletedProcess(child[0].args, child[0].returncode, out, err)
        assert done.returncode == 0, err
        assert _results(done)[0][:2] == ["importer", str(os.getpid())]
        assert "weights_waiting" in out + err
    finally:
        held.close()


def _blocked_on_flock(pid: int) -> bool:
    """`pid` waits for a flock (a "->" line of /proc/locks names the waiters)."""
    return any(
        "->" in line and line.split()[5] == str(pid)
        for line in Path("/proc/locks").read_text().splitlines()
    )


def test_a_runtime_dir_too_long_for_a_socket_loads_unshared(tmp_path: Path) -> None:
    """AF_UNIX paths end at 108 bytes: past that the daemon keeps its weights to itself."""
    rundir = tmp_path / ("d" * max(1, 100 - len(str(tmp_path))))
    rundir.mkdir(mode=0o700)
    config = LlamaConfig.tiny()
    layout = WeightsLayout.of(config, torch.float32, separate_head=True)
    held = acquire(rundir, KEY, layout, CPU, "shm", lambda a: a.fill_(3), on_lost=print)
    try:
        assert held.role == "owner" and int(held.arena[0]) == 3
        assert not rendezvous(rundir, KEY, layout, "shm")[1].exists()
    finally:
        held.close()


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU behaviour; this machine has a GPU")
def test_without_a_gpu_vmm_is_unusable_and_fails_cleanly() -> None:
    """No driver: a CUDA arena would fall back to the pool's backend; the calls raise CudaError
    with the hint, never crash."""
    assert arena_kind(torch.device("cuda:0"), "cuda-raw") == "cuda-raw"
    assert arena_kind(CPU, "shm") == "shm"
    if has_extension():
        with pytest.raises(CudaError, match="hint:"):
            vmm.vmm_empty(1 << 20, torch.device("cuda:0"))


def test_an_owner_closing_without_an_offer_is_nobody(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A dying owner's listener may still take a connection into its backlog and then drop it:
    that is no owner, and the next daemon serves the weights itself."""
    rundir = short_dir(tmp_path_factory, "w")
    layout = WeightsLayout.of(LlamaConfig.tiny(), torch.float32, separate_head=True)
    path = rendezvous(rundir, KEY, layout, "shm")[1]
    dying = socket.socket(socket.AF_UNIX)
    dying.bind(str(path))
    dying.listen(1)

    def drop_one() -> None:
        conn, _ = dying.accept()
        conn.close()
        dying.close()

    t = threading.Thread(target=drop_one)
    t.start()
    held = acquire(rundir, KEY, layout, CPU, "shm", lambda a: a.fill_(2), on_lost=print)
    t.join()
    try:
        assert held.role == "owner" and int(held.arena[0]) == 2
        done = _child(rundir, "{}", "read")
        assert _results(done)[0][:2] == ["importer", str(os.getpid())], done.stderr
    finally:
        held.close()
