"""The decode daemon's settings: DecodeConfig, over what both daemons share (common.daemon.config).

Each field a user sets declares its option (common.settings.opt): `pdkv decode start` and the
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
class DecodeConfig(DaemonConfig):
    """The decode daemon: accepts links, pulls KV, runs the continuous-batching loop."""

    role: ClassVar[str] = "decode"
    #: its pool holds every running sequence's whole context: the larger share of the pair's 0.9
    default_memory_fraction: ClassVar[float] = 0.55
    max_batch: int = field(
        default=64, metadata=opt("--max-batch", min=1, help="Most sequences decoded in one step.")
    )
    overlap_steps: str = field(
        default="auto",
        metadata=opt(
            "--overlap-steps",
            choices=("auto", "on", "always", "off"),
            help="Launch each decode step before the previous one's tokens are read, while every "
            "sequence in the batch is plain greedy (its next input is the previous step's argmax, "
            "on the device): the loop's work on a step's results overlaps the GPU's next step. "
            "on: except while a prefill computes a prompt it handed to this decode early (the "
            "GPU's gaps between steps are then the prefill's); always: then too; auto: on for "
            "CUDA, off on the CPU (where every token would wait one more step).",
        ),
    )
    warm_wait: str = field(
        default="auto",
        metadata=opt(
            "--warm-wait",
            choices=("auto", "on", "off"),
            help="While the batch is empty and a sequence handed off early awaits its KV, keep "
            "the torch thread awake in 50 µs waits, so that the sequence's first step (its 2nd "
            "token) is not launched from a cold core. auto: on for CUDA, off on the CPU (where "
            "the wake-ups would be taken from the prefill's forward).",
        ),
    )
    prefill_first_ms: float | None = field(  # None: prefill_first_for picks by device
        default=None,
        metadata=opt(
            "--prefill-first-ms",
            min=0,
            metavar="MS",
            show_default="50 on CUDA, 0 on CPU",
            help="Before a step, while a prefill on this decode's own device computes prompts it "
            "handed here early, launch no step for up to MS ms (then step at least once before "
            "holding again), so the GPU computes those prompts first, as one process would. "
            "Lower TTFT and more tokens/s in bursts, for up to MS ms more between two tokens of "
            "the sequences decoding meanwhile. 0: off.",
        ),
    )
    listen: str | None = field(
        default=None,
        metadata=opt(
            "--listen",
            metavar="tcp://ADDR:PORT",
            help="Also accept links from prefill daemons on other hosts here (an explicit bind "
            "address; the KV moves with NIXL; needs --link-key-file and pdkv[nixl]). The Unix "
            "socket stays.",
        ),
    )

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "decode.pid"

    def largest_forward(self, device_type: str, max_positions: int, kernels: bool) -> Forward:
        """A step of --max-batch rows; the torch attention gathers each row's K/V up to the
        longest table's width (max_positions); the kernels' steps replay CUDA graphs, whose pool
        holds one more step's activations."""
        b = self.max_batch
        if kernels:
            return Forward(tokens=b, logit_rows=b, graph_tokens=b, graph_rows=b)
        return Forward(tokens=b, logit_rows=b, gathered_keys=b * max_positions)

    def warm_wait_on(self, device_type: str) -> bool:
        """--warm-wait on a device of this type."""
        if self.warm_wait == "auto":
            return device_type == "cuda"
        return self.warm_wait == "on"

    def prefill_first_for(self, device_type: str) -> float:
        """--prefill-first-ms on a device of this type (0: off)."""
        if self.prefill_first_ms is None:
            return 50.0 if device_type == "cuda" else 0.0
        return self.prefill_first_ms

    def overlap_mode(self, device_type: str) -> str:
        """--overlap-steps on a device of this type: "on", "always" or "off"."""
        if self.overlap_steps == "auto":
            return "on" if device_type == "cuda" else "off"
        return self.overlap_steps


__all__ = ["DecodeConfig"]
