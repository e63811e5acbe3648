"""`--num-blocks auto` at start: the device's memory read (the driver's on CUDA, the host's on CPU),
the daemon's own holdings and largest forward measured against it, and the decision logged.
The arithmetic is common.daemon.pool_size's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog
import torch

from common.daemon import pool_size
from common.daemon.config import DaemonConfig

log = structlog.get_logger(__name__)
MEMINFO = Path("/proc/meminfo")


CGROUP = Path("/sys/fs/cgroup")
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge number (2^63 less a page)


def host_total() -> int:
    """Bytes of physical memory of the host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_available(meminfo: Path = MEMINFO) -> int:
    """Bytes the kernel says can be allocated now without swapping (MemAvailable); the free
    pages where /proc/meminfo has no such line."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cgroup_memory(root: Path = CGROUP, own: Path = Path("/proc/self/cgroup")) -> tuple[int, int]:
    """(limit, usage) bytes of this process's memory cgroup (v2's memory.max, v1's
    limit_in_bytes), or (0, 0) without a limit: a container's, a systemd unit's MemoryMax=."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return 0, 0
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            files, where = ("memory.max", "memory.current"), [root / path.lstrip("/"), root]
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            where = [root / "memory" / path.lstrip("/"), root / "memory"]
        else:
            continue
        for d in where:  # a container sees its own cgroup at the mount's root
            try:
                limit = (d / files[0]).read_text().strip()
                usage = int((d / files[1]).read_text())
            except (OSError, ValueError):
                continue
            if limit.isdigit() and int(limit) < _UNLIMITED:
                return int(limit), usage
            break
    return 0, 0


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free now) bytes of `device`: the GPU's (cudaMemGetInfo); for cpu the host's,
    within the memory cgroup's limit when there is one."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    total, free = host_total(), host_available()
    limit, usage = cgroup_memory()
    if limit:
        total, free = min(total, limit), min(free, max(0, limit - usage))
    return total, free


def held_bytes(model: Any, shared: Any, device: torch.device) -> int:
    """What the daemon holds once loaded: the weights' arena when it pays for them (its own, or
    the host's copy it owns; none when it maps another daemon's), or on CUDA what torch's
    allocator holds, if that is more (the arena is one of its allocations, unless the
    extension's VMM made it)."""
    owned = shared is None or shared.role == "owner"
    weights = model.weights.embed.untyped_storage().nbytes() if owned else 0
    if device.type == "cuda":
        return max(weights, int(torch.cuda.memory_allocated(device)))
    return weights


def auto_pool(
    cfg: DaemonConfig, model: Any, shared: Any, device: torch.device, block_bytes: int
) -> pool_size.PoolPlan:
    """The pool under `--num-blocks auto` (pool_size.plan), logged as `pool_sized`;
    PoolSizeError (exit 3) when it holds fewer blocks than one longest sequence needs."""
    dtype_bytes = model.dtype.itemsize
    positions = model.config.max_position_embeddings
    forward = cfg.largest_forward(device.type, positions, model.use_kernels)
    reserve = pool_size.reserve_bytes(model.config, dtype_bytes, forward)
    if device.type == "cuda":
        reserve += pool_size.CUDA_WORKSPACES
    total, free = device_memory(device)
    p = pool_size.plan(
        total=total,
        free=free,
        fraction=cfg.memory_share(),
        held=held_bytes(model, shared, device),
        reserve=reserve,
        block_bytes=block_bytes,
    )
    longest = cfg.longest_sequence(positions)
    log.info(
        "pool_sized",
        role=cfg.role,
        device=str(device),
        forward_tokens=forward.tokens,
        longest=longest,
        **p.fields(),
    )
    pool_size.check(p, -(-longest // cfg.block_size), longest)
    return p


def peak_start(device: torch.device) -> int:
    """CUDA: what torch's allocator holds now (the pool made), its peak reset; 0 on CPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def log_peak(device: torch.device, base: int, p: pool_size.PoolPlan, role: str) -> None:
    """CUDA, after the warm-up (every forward shape once, the graphs captured): the peak above
    `base` (peak_start's) against the plan's reserve, logged as `pool_reserve_checked`, a
    warning when the estimate fell short."""
    if device.type != "cuda":
        return
    peak = int(torch.cuda.max_memory_allocated(device)) - base
    held = int(torch.cuda.memory_allocated(device)) - base  # the graphs' pools, kept
    fields = {
        "role": role,
        "warm_peak_mib": round(peak / 2**20, 1),
        "kept_mib": round(held / 2**20, 1),
        "reserve_mib": round(p.reserve / 2**20, 1),
    }
    if peak <= p.reserve:
        log.info("pool_reserve_checked", **fields)
    else:
        log.warning("pool_reserve_short", **fields)
