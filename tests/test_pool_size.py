"""--num-blocks auto's arithmetic (common.daemon.pool_size) at its edges, its reserve against the
memory real forwards take (the tiny model on the CPU, measured in a process of their own), and
the host memory it is measured against (common.daemon.memory: a cgroup's limit bounds it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.daemon import memory, pool_size
from common.daemon.pool_size import Forward, PoolSizeError, check, parse_num_blocks, plan
from common.daemon.rundir import StartupError
from common.model.config import LlamaConfig
from decode_server.config import DecodeConfig
from prefill_server.config import PrefillConfig

GIB = 2**30
MIB = 2**20


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("AUTO", "auto"), (" 12 ", 12)])
def test_num_blocks_reads_a_count_or_auto(text: str, value: object) -> None:
    assert parse_num_blocks(text) == value


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "many", ""])
def test_num_blocks_refuses_what_is_neither(text: str) -> None:
    with pytest.raises(ValueError, match="positive number of blocks or auto"):
        parse_num_blocks(text)


def _plan(**kw: int | float) -> pool_size.PoolPlan:
    args: dict = dict(total=100 * GIB, free=90 * GIB, fraction=0.5, held=10 * GIB, reserve=GIB)
    return plan(**{**args, "block_bytes": 2 * MIB, **kw})


def test_the_budget_gives_the_pool_when_enough_is_free() -> None:
    p = _plan()
    assert p.budget == 50 * GIB and p.limit == "budget"
    assert p.blocks == (50 - 10 - 1) * GIB // (2 * MIB)


def test_what_is_free_now_caps_the_pool_less_the_reserve_and_the_margin() -> None:
    p = _plan(free=20 * GIB)
    assert p.limit == "free"
    assert p.margin == 2 * GIB  # 2 % of 100 GiB
    assert p.blocks == (20 - 1 - 2) * GIB // (2 * MIB)


def test_the_margin_is_at_least_its_floor() -> None:
    assert _plan(total=GIB, free=GIB, held=0, reserve=0).margin == pool_size.MARGIN_MIN


def test_blocks_are_whole_and_never_negative() -> None:
    exact = _plan(total=GIB, free=GIB, fraction=1, held=0, reserve=0, block_bytes=1000)
    assert exact.limit == "free"  # the margin binds below the whole budget
    room = GIB - pool_size.MARGIN_MIN
    assert exact.blocks == room // 1000
    one_short = _plan(total=GIB, free=GIB, fraction=1, held=0, reserve=room % 1000 + 1)
    assert one_short.blocks == (room - room % 1000 - 1) // (2 * MIB)
    assert _plan(held=60 * GIB).blocks == 0
    assert _plan(free=0).blocks == 0


@pytest.mark.parametrize("fraction", [0, -0.1, 1.01])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        _plan(fraction=fraction)
    assert _plan(fraction=1).budget == 100 * GIB


def test_check_passes_at_exactly_one_longest_sequence() -> None:
    p = dataclasses.replace(_plan(), blocks=512)
    check(p, 512, 8192)
    with pytest.raises(PoolSizeError):
        check(dataclasses.replace(p, blocks=511), 512, 8192)


def test_check_wants_one_block_at_least() -> None:
    p = dataclasses.replace(_plan(), blocks=0)
    with pytest.raises(PoolSizeError, match="needs 1;"):
        check(p, 0, 0)
    check(dataclasses.replace(p, blocks=1), 0, 0)


def test_the_refusal_is_one_startup_line_naming_numbers_and_fixes() -> None:
    p = _plan(fraction=0.1, held=GIB, free=3 * GIB)
    assert p.limit == "free" and p.blocks == 0
    with pytest.raises(StartupError) as info:
        check(p, 512, 8192)
    text = str(info.value)
    assert "\n" not in text
    for part in ("0.1 of 100 GiB is 10 GiB", "1 GiB held", "1 GiB reserved", "only 3 GiB"):
        assert part in text, text
    assert "8192 tokens needs 512" in text and "margin of 2 GiB" in text
    assert "raise --memory-fraction" in text and "--num-blocks N" in text


def test_the_reserve_adds_up_its_parts() -> None:
    c = LlamaConfig.tiny()
    whole = Forward(tokens=7, logit_rows=3, mask_pairs=11, gathered_keys=5, graph_tokens=2)
    parts = [Forward(tokens=7, logit_rows=0), Forward(tokens=0, logit_rows=3)]
    parts += [Forward(0, 0, mask_pairs=11), Forward(0, 0, gathered_keys=5)]
    parts += [Forward(0, 0, graph_tokens=2)]
    assert pool_size.reserve_bytes(c, 2, whole) == sum(
        pool_size.reserve_bytes(c, 2, f) for f in parts
    )
    assert pool_size.reserve_bytes(c, 2, Forward(0, 0)) == 0
    assert pool_size.reserve_bytes(c, 4, whole) > pool_size.reserve_bytes(c, 2, whole)


def test_each_role_names_its_largest_forward() -> None:
    dec = DecodeConfig(max_batch=8).largest_forward("cpu", 4096, kernels=False)
    assert (dec.tokens, dec.logit_rows, dec.gathered_keys) == (8, 8, 8 * 4096)
    assert DecodeConfig(max_batch=8).largest_forward("cuda", 4096, kernels=True).graph_tokens == 8
    pre = PrefillConfig(max_prompt_tokens=2048).largest_forward("cpu", 4096, kernels=False)
    assert (pre.tokens, pre.logit_rows, pre.mask_pairs) == (2048, 1024, 2048 * 2048)
    cuda = PrefillConfig().largest_forward("cuda", 40960, kernels=True)
    assert (cuda.tokens, cuda.graph_tokens, cuda.graph_rows, cuda.mask_pairs) == (16384, 4096, 8, 0)
    assert PrefillConfig(max_prompt_tokens=100).longest_sequence(4096) == 100
    assert DecodeConfig().longest_sequence(4096) == 4096
    assert DecodeConfig().memory_share() == 0.55 and PrefillConfig().memory_share() == 0.35
    assert DecodeConfig(memory_fraction=0.2).memory_share() == 0.2


# A real forward of the tiny model (fp32, CPU, torch path) at each role's largest shape, in a
# process of its own: its peak RSS above the RSS after a small warm-up forward, in bytes (the
# high-water mark reset there: ru_maxrss kept the peak of loading, which a forward at this size
# may not pass, and read 0 after some other test modules had run in the parent).
_MEASURE = """
import json, sys, torch
from common.model.loader import load_model
role, n, rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
model, _ = load_model(None, device=torch.device("cpu"), dtype=torch.float32)
kv = model.new_kv_cache(n // 16 + 2, 16)
def status(key):  # VmRSS / VmHWM of /proc/self/status, in bytes
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
def reset_peak():  # the high-water mark is reset to the current RSS first (clear_refs "5", Linux 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")
long = lambda t: torch.full((t,), 7)
if role == "prefill":  # the last chunk of a longest prompt, over the chunk before it
    model.prefill_batch([long(32)], [torch.arange(16, 48)], kv, starts=[16],
                        block_tables=[[0, 1, 2]])
    base = reset_peak()
    model.prefill_batch([long(n - 16)], [torch.arange(16, n)], kv, starts=[16],
                        block_tables=[list(range(n // 16))])
else:  # a full batch, one row's table the longest sequence's
    one = lambda v: torch.tensor([v])
    model.decode_step(one(1), one(5), one(5), torch.zeros(1, 1, dtype=torch.long), one(6), kv)
    base = reset_peak()
    tables = torch.zeros(rows, n // 16, dtype=torch.long)
    tables[0] = torch.arange(n // 16)
    full = lambda v: torch.full((rows,), v)
    model.decode_step(full(1), full(n - 1), full(n - 1), tables, full(n), kv)
print(json.dumps(status("VmHWM") - base))
"""


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_reserve_covers_a_real_largest_forward(role: str) -> None:
    # the decode's at 4 x the batch-context product of the prefill's shape: at 8 x 4096 its
    # measured peak (20-23 MB against a 26.8 MB reserve) once passed the reserve on a loaded VM,
    # the RSS's own noise (allocator, lazily made buffers) a few MB
    n, rows = (4096, 8) if role == "prefill" else (8192, 16)
    if role == "prefill":
        forward = PrefillConfig(max_prompt_tokens=n).largest_forward("cpu", n, kernels=False)
    else:
        forward = DecodeConfig(max_batch=rows).largest_forward("cpu", n, kernels=False)
    reserve = pool_size.reserve_bytes(LlamaConfig.tiny(), 4, forward)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, role, str(n), str(rows)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured > 0
    assert measured <= reserve, f"{role}: measured {measured} bytes > reserve {reserve}"


def _cgroup(tmp_path: Path, own: str, files: dict[str, str]) -> tuple[int, int]:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self").write_text(own)
    return memory.cgroup_memory(tmp_path, tmp_path / "self")


def test_a_cgroup_v2_limit_bounds_the_host_memory(tmp_path: Path) -> None:
    files = {"pod/memory.max": "4294967296\n", "pod/memory.current": "1000\n"}
    assert _cgroup(tmp_path, "0::/pod\n", files) == (4 * GIB, 1000)


def test_a_container_sees_its_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    files = {"memory.max": "2147483648\n", "memory.current": "5\n"}
    assert _cgroup(tmp_path, "0::/kubepods/burstable/pod1\n", files) == (2 * GIB, 5)


def test_cgroup_v1_limit_and_no_limit(tmp_path: Path) -> None:
    own = "garbage\n9:name=systemd:/\n4:memory:/job\n0::/\n"
    files = {
        "memory/job/memory.limit_in_bytes": "1073741824",
        "memory/job/memory.usage_in_bytes": "7",
    }
    assert _cgroup(tmp_path, own, files) == (GIB, 7)
    files["memory/job/memory.limit_in_bytes"] = "9223372036854771712"  # v1's "no limit"
    assert _cgroup(tmp_path, own, files) == (0, 0)


def test_no_cgroup_limit(tmp_path: Path) -> None:
    assert _cgroup(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": "9\n"}) == (0, 0)
    assert _cgroup(tmp_path, "0::/\n", {}) == (0, 0)
    assert memory.cgroup_memory(tmp_path, tmp_path / "absent") == (0, 0)
