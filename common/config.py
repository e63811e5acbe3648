"""Settings of the two daemons: one keyword-only dataclass each, shared by CLI, API and tests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from common.rundir import default_runtime_dir


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """What both daemons share. Paths default to files in the runtime dir."""

    runtime_dir: Path = field(default_factory=default_runtime_dir)
    model: str | None = None  # None: the built-in tiny model
    allow_byte_tokenizer: bool = False  # a checkpoint without tokenizer.json loads with bytes
    device: str = "auto"  # auto | cpu | cuda:N
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    ipc_backend: str = "auto"  # auto | shm | cuda-raw | cuda-torch
    block_size: int = 16
    num_blocks: int = 1024
    torch_threads: int = 0  # 0: 1 for the tiny model, torch's default otherwise
    link_socket: Path | None = None
    socket_group: str | None = None  # sockets 0660 with this group instead of 0600
    allowed_uids: tuple[int, ...] = ()  # () : our own uid only
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    drain_timeout_s: float = 10.0
    max_prompt_tokens: int = 8192
    spin_us: int = 0  # poll a link without sleeping this long when an answer is due (0: never)
    max_connections: int = 1024  # open connections on the listening socket; more are refused
    frame_timeout_s: float = 30.0  # a frame must complete within this, however slowly it trickles
    link_key_file: Path | None = None  # the shared secret of a TCP link (mode 0600)

    @property
    def link_path(self) -> Path:
        return self.link_socket or self.runtime_dir / "decode.sock"

    def uids(self) -> frozenset[int]:
        return frozenset(self.allowed_uids) | {os.getuid()}


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(DaemonConfig):
    """The decode daemon: accepts links, pulls KV, runs the continuous-batching loop."""

    max_batch: int = 64
    listen: str | None = None  # tcp://ADDR:PORT: also accept links across hosts (NIXL)

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "decode.pid"


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(DaemonConfig):
    """The prefill daemon: client front door, forward + scatter, handoff, leases."""

    client_socket: Path | None = None
    event_slots: int = 64
    lease_timeout_s: float = 30.0
    handoff_timeout_s: float = 30.0  # how long a request may wait for blocks / capacity / the link
    max_pending: int = 1024  # requests in flight in this daemon; more get NO_CAPACITY
    # prompt tokens in one prefill forward (a longer prompt runs alone); None: the device's default
    max_prefill_tokens: int | None = None

    def prefill_budget(self, device_type: str) -> int:
        """--max-prefill-tokens, or 8192 on CUDA and 1 (one prompt a forward) on CPU, where a
        forward costs about its tokens and batching buys no throughput (docs/benchmarks.md)."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return 8192 if device_type == "cuda" else 1

    client_idle_timeout_s: float = 300.0  # a client connection with no request and no frame
    client_write_timeout_s: float = 30.0  # a client that reads none of its stream this long
    decode: str | None = None  # tcp://HOST:PORT: link to a decode on another host (NIXL)
    transfer: str = "push"  # a TCP link's KV transfer: push (prefill WRITEs) or pull (decode READs)
    # Unix-socket links: HANDOFF when a prompt is queued, its first token (the KV written) after it
    early_handoff: bool = True

    @property
    def client_path(self) -> Path:
        return self.client_socket or self.runtime_dir / "prefill.sock"

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "prefill.pid"
