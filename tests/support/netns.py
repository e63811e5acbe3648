"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for the daemons'
link across hosts. Needs root and `ip`; `netns_skip_reason()` says why not when they cannot be
made. The names are unique per test run, and `Hosts.remove()` (idempotent) deletes both
namespaces, which takes the veth pair with them."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def netns_skip_reason() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"pdkvprobe{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    """Namespace `prefill_ns` (address `prefill_ip`) and `decode_ns` (`decode_ip`), one veth."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    made: list[str] = field(default_factory=list)

    @property
    def prefill_ns(self) -> str:
        return f"pdkvp{self.tag}"

    @property
    def decode_ns(self) -> str:
        return f"pdkvd{self.tag}"

    prefill_ip = "10.213.7.1"
    decode_ip = "10.213.7.2"

    @property
    def prefill_if(self) -> str:
        return f"vp{self.tag}"  # interface names are at most 15 characters

    def create(self) -> None:
        for ns in (self.prefill_ns, self.decode_ns):
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        peer_if = f"vd{self.tag}"
        _ip("link", "add", self.prefill_if, "type", "veth", "peer", "name", peer_if)
        for ns, dev, addr in (
            (self.prefill_ns, self.prefill_if, self.prefill_ip),
            (self.decode_ns, peer_if, self.decode_ip),
        ):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")

    def cut(self) -> None:
        """Pull the cable: the prefill's end of the veth goes down (no FIN reaches anyone)."""
        _ip("-n", self.prefill_ns, "link", "set", self.prefill_if, "down")

    def exec_argv(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def remove(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
        # a veth not yet moved into a namespace (create failed half way) lives in ours
        subprocess.run(["ip", "link", "del", self.prefill_if], capture_output=True, timeout=30)
