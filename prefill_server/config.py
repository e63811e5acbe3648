"""The prefill daemon's settings: PrefillConfig, over what both daemons share (common.daemon.config).

Each field a user sets declares its option (common.settings.opt): `pdkv prefill start` and the
table in docs/operations.md are generated from these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from common.daemon.config import DaemonConfig
from common.daemon.pool_size import Forward
from common.settings import opt


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(DaemonConfig):
    """The prefill daemon: client front door, forward + scatter, handoff, leases."""

    role: ClassVar[str] = "prefill"
    #: its pool holds prompts in flight and the prefix cache: the smaller share of the pair's 0.9
    default_memory_fraction: ClassVar[float] = 0.35
    client_socket: Path | None = field(
        default=None,
        metadata=opt(
            "--client-socket",
            show_default="RUNTIME_DIR/prefill.sock",
            help="Where clients connect.",
        ),
    )
    lease_timeout_s: float = field(
        default=30.0,
        metadata=opt(
            "--lease-timeout", help="Seconds the decode may hold a request's blocks before RELEASE."
        ),
    )
    handoff_timeout_s: float = field(
        default=30.0,
        metadata=opt(
            "--handoff-timeout",
            help="Seconds a request may wait for free blocks, decode capacity or a dropped link to "
            "come back (a link that never came up or was refused fails it at the next failed "
            "reconnect).",
        ),
    )
    max_pending: int = field(
        default=1024,
        metadata=opt(
            "--max-pending",
            min=1,
            help="Most requests in flight in the prefill daemon; more get NO_CAPACITY at once.",
        ),
    )
    client_idle_timeout_s: float = field(
        default=300.0,
        metadata=opt(
            "--client-idle-timeout",
            min=0.1,
            help="Seconds a client connection may stay open with no request in flight and no "
            "frame sent.",
        ),
    )
    client_write_timeout_s: float = field(
        default=30.0,
        metadata=opt(
            "--client-write-timeout",
            min=0.1,
            help="Seconds a client may leave its stream unread; then its requests are aborted.",
        ),
    )
    max_prefill_tokens: int | None = field(  # None: prefill_budget picks by device
        default=None,
        metadata=opt(
            "--max-prefill-tokens",
            min=1,
            show_default="16384 on CUDA, 1 on CPU",
            help="Most prompt tokens prefilled in one forward: prompts that arrive while a forward "
            "runs share the next one up to this. 1: one prompt per forward, the CPU default (a "
            "forward there costs about its tokens). Set, it is also the chunk size: a prompt "
            "with more tokens to compute runs in chunks of this many, each attending to the ones "
            "before (unset: chunks of 8192).",
        ),
    )
    event_slots: int = field(
        default=256,
        metadata=opt(
            "--event-slots",
            min=1,
            max=1024,
            help="CUDA: interprocess events in the handoff ring (handoffs in flight at once; "
            "a request past them waits before its forward).",
        ),
    )
    prefill_graph_tokens: int = field(
        default=4096,
        metadata=opt(
            "--prefill-graph-tokens",
            min=0,
            help="CUDA: forwards of at most this many tokens (and 8 prompts) replay a CUDA graph "
            "captured at start instead of launching their ~200 kernels from Python, which costs "
            "more than a small forward's GPU time (a cached prefix's few new tokens). Measured on "
            "an H100 at the 1.1B shape (docs/benchmarks.md): 16 x 2,000-token prompts had TTFT "
            "p50 13.0 ms with 4096 against 17.5 ms with 1024. 0: off.",
        ),
    )
    early_handoff: bool = field(  # every link (TCP ones since protocol v11)
        default=True,
        metadata=opt(
            "--early-handoff",
            negatable=True,
            help="Send each HANDOFF when its prompt is queued for the forward, so the decode "
            "checks it, reserves its blocks and prepares the pull while the prefill computes; the "
            "first token follows in a KV_READY message that starts the pull (on a TCP push link "
            "the decode's PUSH goes at the HANDOFF and the prefill WRITEs it when the KV is "
            "written). Off: HANDOFF after the first token.",
        ),
    )
    launch_early: bool = field(  # CUDA, Unix-socket links, with --early-handoff
        default=True,
        metadata=opt(
            "--launch-early",
            negatable=True,
            help="CUDA, with --early-handoff: for a greedy request (no penalties, min_tokens or "
            "logprobs) whose forward holds all the prefill has in flight, write its first token "
            "into a mailbox on the GPU before its event slot is recorded and tell the decode "
            "(KV_LAUNCHED) as soon as the forward is queued, so an idle decode queues its pull "
            "and first step behind it and the 2nd token no longer waits for the decode's host "
            "work after the forward. Takes one pool block.",
        ),
    )
    pipeline_forwards: bool | None = field(  # None: pipelined() picks by device
        default=None,
        metadata=opt(
            "--pipeline-forwards",
            negatable=True,
            show_default="on",
            help="Send the next batch of queued prompts to the device as soon as a forward "
            "returns, before that forward's first tokens, KV_READYs and relays are sent: the "
            "device computes while the daemon's loop answers, instead of idling between "
            "forwards (on the CPU VM 5-10 % of a burst's forward time; TTFT p50 0.90x, p99 "
            "0.88x; on an H100, nano-vllm's burst: 35.6k against 35.3k tokens/s, 2nd token p50 "
            "33 against 47 ms). Off: answer, then start the next forward.",
        ),
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata=opt(
            "--decode",
            multiple=True,
            metavar="PATH|tcp://HOST:PORT",
            show_default="RUNTIME_DIR/decode.sock",
            help="A decode daemon to hand requests to: its link socket, or tcp://HOST:PORT on "
            "another host (the KV moves with NIXL; needs --link-key-file and pdkv[nixl]). Give "
            "it once per decode daemon: each request goes to the least loaded one that is up "
            "(all of one kind: Unix sockets or TCP, several of either).",
        ),
    )
    transfer: str = field(
        default="push",
        metadata=opt(
            "--transfer",
            choices=("push", "pull"),
            help="How a TCP link moves the KV: push (the prefill WRITEs into the decode's blocks) "
            "or pull (the decode READs the prefill's); see docs/operations.md for which is faster "
            "where.",
        ),
    )

    def prefill_budget(self, device_type: str) -> int:
        """--max-prefill-tokens, or 16384 on CUDA (as one process's burst prefill: on an H200
        a burst of 256 prompts reached its first tokens sooner than with 8192) and 1 (one
        prompt a forward) on CPU, where a forward costs about its tokens and batching buys no
        throughput (docs/benchmarks.md)."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return 16384 if device_type == "cuda" else 1

    def pipelined(self, device_type: str) -> bool:
        """--pipeline-forwards, on by default on every device (docs/benchmarks.md: on the CPU
        the idle between forwards went from 5-10 % to 0.4 %; on an H100 the nano burst's 2nd
        token p50 from 47 to 33 ms). `device_type` stays for a device where it would not pay."""
        if self.pipeline_forwards is not None:
            return self.pipeline_forwards
        return device_type in ("cpu", "cuda")

    def prefill_chunk(self) -> int:
        """Most positions of one prompt computed in one forward (chunked prefill):
        --max-prefill-tokens when set, else 8192 on any device."""
        return self.max_prefill_tokens or 8192

    def longest_sequence(self, max_positions: int) -> int:
        """The longest prompt: the prefill's pool holds prompts only."""
        return min(self.max_prompt_tokens, max_positions)

    def largest_forward(self, device_type: str, max_positions: int, kernels: bool) -> Forward:
        """A forward takes prompts up to the token budget, or one piece of a longer prompt (a
        chunk, at most the longest prompt); one logits row a prompt (at most --max-pending of
        them). The torch attention masks a piece over its whole context (a cached prefix, the
        chunks before) explicitly; with the kernels, CUDA graphs up to --prefill-graph-tokens
        (and 8 prompts) keep their pool."""
        longest = self.longest_sequence(max_positions)
        tokens = max(self.prefill_budget(device_type), min(self.prefill_chunk(), longest))
        rows = min(tokens, self.max_pending)
        if not kernels:
            return Forward(
                tokens=tokens, logit_rows=rows, mask_pairs=min(tokens, longest) * longest
            )
        graph = min(self.prefill_graph_tokens, self.prefill_budget(device_type))
        return Forward(
            tokens=tokens, logit_rows=rows, graph_tokens=graph, graph_rows=8 if graph else 0
        )

    @property
    def decode_addresses(self) -> tuple[str, ...]:
        """Every --decode, or this host's decode socket (--link-socket) when none is given."""
        return self.decode or (str(self.link_path),)

    @property
    def client_path(self) -> Path:
        return self.client_socket or self.runtime_dir / "prefill.sock"

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "prefill.pid"


__all__ = ["PrefillConfig"]
