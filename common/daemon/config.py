"""What both daemons share of their settings (DaemonConfig); each daemon's own are in
prefill_server.config (PrefillConfig) and decode_server.config (DecodeConfig).

Each field a user sets declares its option here (common.settings.opt); `pdkv decode start`,
`pdkv prefill start` and the tables in docs/operations.md are generated from the fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from common.daemon.pool_size import Forward, parse_num_blocks
from common.daemon.rundir import default_runtime_dir
from common.settings import instance_name, int_tuple, opt


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """What both daemons share. Paths default to files in the runtime dir."""

    role: ClassVar[str | None] = None
    #: --memory-fraction when unset (each daemon's config says why its share)
    default_memory_fraction: ClassVar[float] = 0.5
    runtime_dir: Path = field(default_factory=default_runtime_dir)
    instance: str | None = field(
        default=None,
        metadata=opt(
            "--instance",
            metavar="NAME",
            show_default="ROLE@HOSTNAME:RUNTIME_DIR",
            help="This daemon's name: shown by pdkv status (STATUS_REPLY's instance) and the "
            "pdkv_instance label of its series in the API's /metrics.",
        ),
    )
    model: str | None = field(
        default=None,
        metadata=opt(
            "--model",
            metavar="DIR",
            show_default="built-in tiny model",
            help="Hugging Face checkpoint dir (config.json + *.safetensors).",
        ),
    )
    device: str = field(
        default="auto",
        metadata=opt(
            "--device", help="auto, cpu or cuda:N (auto: cuda:0 when CUDA works, else cpu)."
        ),
    )
    dtype: str | None = field(
        default=None,
        metadata=opt(
            "--dtype",
            show_default="float32 on CPU, bfloat16 on CUDA",
            help="Model and KV dtype: float32, bfloat16 or float16 (fp32, bf16, fp16 too).",
        ),
    )
    allow_byte_tokenizer: bool = field(
        default=False,
        metadata=opt(
            "--allow-byte-tokenizer",
            help="Load a --model without tokenizer.json with UTF-8 bytes as token ids (its text is "
            "garbage unless the model was trained on bytes); without this flag such a model is "
            "refused.",
        ),
    )
    ipc_backend: str = field(
        default="auto",
        metadata=opt(
            "--ipc-backend",
            choices=("auto", "shm", "cuda-raw", "cuda-torch"),
            help="How the KV pool is shared: shm (CPU memfd), cuda-raw (the extension), cuda-torch "
            "(torch storage IPC); auto picks by device.",
        ),
    )
    num_blocks: int | Literal["auto"] = field(
        default=1024,
        metadata=opt(
            "--num-blocks",
            metavar="N|auto",
            parse=parse_num_blocks,
            help="KV pool size in blocks, or auto: as many as fit in the daemon's "
            "--memory-fraction of the device's memory once its weights are loaded and its "
            'largest forward is reserved for (docs/operations.md, "Sizing the KV pools"; the '
            "start log's pool_sized line shows every number). The default is a fixed count, "
            "small enough for several pairs on one GPU (as the GPU tests run).",
        ),
    )
    memory_fraction: float | None = field(  # None: the role's default_memory_fraction
        default=None,
        metadata=opt(
            "--memory-fraction",
            metavar="F",
            min=0,
            min_open=True,
            max=1,
            show_default="0.55 decode, 0.35 prefill",
            help="With --num-blocks auto: the share of the device's total memory (the host's on "
            "CPU) this daemon may use, weights it loads, activations and pool together, as "
            "vLLM's --gpu-memory-utilization is per instance. The decode gets more: its pool "
            "holds every running sequence's whole context, the prefill's only prompts in flight "
            "and its prefix cache. Together 0.9, leaving a tenth of a shared GPU for what "
            "neither counts (CUDA contexts, cuBLAS workspaces, allocator slack); a daemon alone "
            "on its device may take 0.9.",
        ),
    )
    block_size: int = field(
        default=16,
        metadata=opt(
            "--block-size", min=1, help="Tokens per KV block (must match on both daemons)."
        ),
    )
    link_socket: Path | None = field(
        default=None,
        metadata=opt(
            "--link-socket",
            show_default="RUNTIME_DIR/decode.sock",
            help="The decode daemon's link socket.",
        ),
    )
    socket_group: str | None = field(
        default=None,
        metadata=opt(
            "--socket-group", help="Make sockets 0660 owned by this group (default 0600)."
        ),
    )
    allowed_uids: tuple[int, ...] = field(
        default=(),
        metadata=opt(
            "--allowed-uids",
            parse=int_tuple,
            help="Comma-separated uids allowed to connect besides our own.",
        ),
    )
    torch_threads: int = field(
        default=0,
        metadata=opt(
            "--torch-threads",
            min=0,
            help="CPU threads for torch (0: 1 for the tiny model, torch's default otherwise).",
        ),
    )
    kernel_cache_dir: Path | None = field(
        default=None,
        metadata=opt(
            "--kernel-cache-dir",
            metavar="DIR",
            show_default="$TRITON_CACHE_DIR, else $XDG_CACHE_HOME/pdkv/triton",
            help="Where Triton keeps the kernels it compiles (CUDA): keep it on a persistent path "
            "so that a restarted daemon loads them instead of compiling again.",
        ),
    )
    spin_us: int = field(
        default=0,
        metadata=opt(
            "--spin-us",
            min=0,
            max=100_000,
            help="After a handoff, poll the link this many µs without sleeping: lower latency for "
            "back-to-back handoffs on a host with idle cores, worse on a busy one (0: off).",
        ),
    )
    drain_timeout_s: float = field(
        default=10.0,
        metadata=opt("--drain-timeout", help="Seconds to finish in-flight work on SIGTERM."),
    )
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = field(
        default=5.0, metadata=opt("--heartbeat-timeout", help="A link silent this long is dead.")
    )
    max_connections: int = field(
        default=1024,
        metadata=opt(
            "--max-connections",
            min=1,
            help="Most open connections on the daemon's socket; more are refused with NO_CAPACITY.",
        ),
    )
    frame_timeout_s: float = field(
        default=30.0,
        metadata=opt(
            "--frame-timeout",
            min=0.1,
            help="Seconds a frame may take to arrive whole; a slower sender is disconnected.",
        ),
    )
    link_key_file: Path | None = field(
        default=None,
        metadata=opt(
            "--link-key-file",
            help="Shared secret (mode 0600, ≥ 16 bytes) both daemons prove in HELLO on a TCP link; "
            "required with --listen / --decode tcp://.",
        ),
    )
    prefix_cache: bool = field(
        default=True,
        metadata=opt(
            "--prefix-cache",
            negatable=True,
            help="Keep the KV of full prompt blocks after their request and reuse it for prompts "
            "that start the same way: the prefill then computes only the rest, the decode pulls "
            "only the blocks it lacks. Cached blocks count as free and are evicted least recently "
            "used first when the pool needs room.",
        ),
    )
    share_weights: bool | None = field(  # None: shares_weights() picks by device
        default=None,
        metadata=opt(
            "--share-weights",
            negatable=True,
            show_default="on on CPU, off on CUDA",
            help="Keep one copy of the weights per host and device: a daemon whose model, dtype "
            "and device match a daemon already serving them (same runtime dir) maps that one's "
            "weights instead of loading its own; if the owner exits, the other serves on and "
            "takes the weights over (on CUDA without the extension's VMM arenas it exits 1 "
            "instead, to be restarted). Off on CUDA until its GPU tests have run there "
            "(tests/integration/test_gpu_shared_weights.py).",
        ),
    )
    # -- the host KV tier (issue 43; common/kv/host_tier.py): these two lines together ----------
    host_cache_gb: float = field(
        default=0.0,
        metadata=opt(
            "--host-cache-gb",
            min=0,
            help="Size of the host KV tier in GiB: a shared-memory region every daemon on the host "
            "maps, holding the KV of full blocks (prompts' and generated answers') by the prefix "
            "cache's names, so a later prompt that starts the same way (the next turn of a "
            "conversation) copies them instead of computing them. The first daemon to map it sets "
            "its size. 0: off.",
        ),
    )
    host_cache_path: Path | None = field(
        default=None,
        metadata=opt(
            "--host-cache-path",
            metavar="FILE",
            show_default="/dev/shm/pdkv-UID-<runtime dir>-tier-<block layout>",
            help="The host KV tier's shared-memory file: daemons that name the same file share "
            "one tier (by default those of one runtime dir).",
        ),
    )
    max_prompt_tokens: int = field(
        default=8192,
        metadata=opt(
            "--max-prompt-tokens",
            only="prefill",
            min=1,
            max=262_144,
            help="Longest prompt accepted; longer ones get BAD_REQUEST.",
        ),
    )

    @property
    def instance_name(self) -> str:
        return instance_name(self.instance, self.role or "daemon", self.runtime_dir)

    @property
    def link_path(self) -> Path:
        return self.link_socket or self.runtime_dir / "decode.sock"

    def uids(self) -> frozenset[int]:
        return frozenset(self.allowed_uids) | {os.getuid()}

    def memory_share(self) -> float:
        """--memory-fraction, or the role's default."""
        if self.memory_fraction is not None:
            return self.memory_fraction
        return self.default_memory_fraction

    def largest_forward(self, device_type: str, max_positions: int, kernels: bool) -> Forward:
        """The largest forward this daemon runs (what --num-blocks auto reserves memory for), on
        a model of `max_positions` positions, through the Triton kernels or not."""
        raise NotImplementedError(f"{type(self).__name__} names no forward to size a pool for")

    def longest_sequence(self, max_positions: int) -> int:
        """Tokens of the longest sequence whose KV this daemon's pool must hold at once."""
        return max_positions

    def shares_weights(self, device_type: str) -> bool:
        """--share-weights, or on on CPU (tested: the pair's PSS one copy lower) and off on
        CUDA, whose VMM path has not run on a GPU yet."""
        if self.share_weights is not None:
            return self.share_weights
        return device_type == "cpu"


__all__ = ["DaemonConfig"]
