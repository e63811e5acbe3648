"""The prefill's decode daemons: one DecodeLink per --decode, and the choice of one per request.

Each request goes to the least loaded decode whose link is up, never to one that refused it
with NO_CAPACITY since (`pick(exclude)`). A decode's load is what this prefill has handed to it
and not yet seen end (`mine`, exact) plus what the decode reported on its last PONG beyond ours
(`others`: the sequences of other prefills linked to it, once a heartbeat old at most); ties go
to the decode with more free blocks, then round robin. Nothing is polled per request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

from prefill_server.link import DecodeLink


class DecodeLinks:
    """Every link of this prefill, by address; the choice of a decode per request."""

    def __init__(self, links: list[DecodeLink]) -> None:
        if not links:
            raise ValueError("a prefill needs at least one decode link")
        self.all = links
        self._turn = itertools.count()

    def __iter__(self) -> Iterator[DecodeLink]:
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def by_id(self, link_id: str) -> DecodeLink | None:
        """The live link whose connection is `link_id`, or None (it ended or reconnected)."""
        for link in self.all:
            if link.link_id == link_id and link.ready.is_set():
                return link
        return None

    def up(self) -> list[DecodeLink]:
        return [link for link in self.all if link.ready.is_set()]

    def pick(self, exclude: frozenset[str] = frozenset()) -> DecodeLink | None:
        """The least loaded link that is up and not in `exclude` (link ids); None if none is."""
        candidates = [link for link in self.up() if link.link_id not in exclude]
        if not candidates:
            return None
        turn = next(self._turn)
        n = len(self.all)
        return min(
            candidates,
            key=lambda link: (
                link.load.total,
                -link.load.free_blocks,
                (self.all.index(link) - turn) % n,
            ),
        )

    async def wait_any_up(self, timeout: float) -> None:
        """Return once some link is up; else ConnectionError naming each link's last error, as
        soon as every link's wait gave up. One decode that dropped is waited for (a restart,
        DecodeLink.wait_up); of several, each gets its next connection attempt only: with every
        decode down a request fails in seconds, not after the handoff timeout."""
        if self.up():
            return
        patient = len(self.all) == 1
        waits = [asyncio.ensure_future(link.wait_up(timeout, patient=patient)) for link in self.all]
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.exception() is None for t in done):
                    return
            if len(self.all) == 1:
                raise waits[0].exception()  # type: ignore[misc]
            why = "; ".join(
                f"{link.address}: {link.last_error or 'not connected'}" for link in self.all
            )
            raise ConnectionError(
                f"no link to any decode daemon ({why}; `pdkv status` shows the links)"
            )
        finally:
            for t in waits:
                t.cancel()

    async def stop(self) -> None:
        await asyncio.gather(*(link.stop() for link in self.all))


__all__ = ["DecodeLinks"]
