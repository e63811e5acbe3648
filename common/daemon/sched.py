"""Where the daemons' threads run: the loop thread's scheduler slice, and whether this process
shares its CPUs with another (docs/operations.md, "CPU placement").

A daemon's loop thread mostly sleeps in epoll and runs for tens of µs per frame; the frame that
wakes it often finds its CPU busy with a task that runs for hundreds of µs (on a 2-vCPU VM: a
client reading its first token on the prefill's CPU, or the other daemon's torch thread). With
the kernel's default slice (~1.4 ms on the 2-vCPU VM) the woken loop thread waits until that
task sleeps; with a short slice requested (`sched_attr.sched_runtime` of a SCHED_OTHER thread,
Linux 6.12 and later) EEVDF gives it an earlier deadline, and the wake-up preempts the running
task at once. The share of CPU time, the nice level and the policy stay as they were; the torch
thread keeps the default slice (`default_slice`, its executor's initializer): a forward
preempted every 100 µs would lose its caches. A thread the loop starts later (the pull's
waiter, asyncio's helper threads) inherits the short slice; those mostly sleep. Best effort: a kernel without it ignores or
refuses the request, and nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct

#: the loop thread's slice: the kernel's lower bound (0.1 ms)
LOOP_SLICE_US = 100
# the 64-bit ABIs' numbers (asm-generic's 274 for arm64, riscv64, loongarch64); none for a 32-bit
# process, whose table differs even on a 64-bit kernel
_SYS_SCHED_SETATTR = (
    {"x86_64": 314, "aarch64": 274, "riscv64": 274, "loongarch64": 274}.get(platform.machine())
    if struct.calcsize("P") == 8
    else None
)
_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)


def set_slice(us: int) -> bool:
    """Ask for a scheduler slice of `us` µs for the calling thread (0: the kernel's default),
    keeping its policy and nice level; True if the kernel took the request (one before 6.12
    takes it and keeps its own slice). Only for a SCHED_OTHER thread on Linux, else False."""
    if _SYS_SCHED_SETATTR is None:
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False
        nice = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's, on Linux
        attr = _ATTR.pack(_ATTR.size, os.SCHED_OTHER, 0, nice, 0, us * 1000, 0, 0, 0, 0)
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_SCHED_SETATTR, 0, ctypes.c_char_p(attr), 0) == 0
    except (OSError, AttributeError):
        return False


def default_slice() -> None:
    """The calling thread back to the kernel's default slice (a thread inherits its creator's).
    Never raises: it is a thread pool's initializer, and a failing one breaks the pool."""
    with contextlib.suppress(Exception):  # best effort, as set_slice itself
        set_slice(0)


def cpus_apart(pid: int) -> bool:
    """True when process `pid` (its main thread) may run on none of the CPUs this thread may
    run on: e.g. a decode daemon pinned to a CPU of its own, apart from its prefill. False when
    they share one, or when either cannot be read (another PID namespace, a gone process)."""
    if pid <= 0 or not hasattr(os, "sched_getaffinity"):
        return False
    try:
        return not (os.sched_getaffinity(0) & os.sched_getaffinity(pid))
    except OSError:
        return False


__all__ = ["LOOP_SLICE_US", "cpus_apart", "default_slice", "set_slice"]
