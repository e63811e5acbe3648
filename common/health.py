"""Whether daemons can serve, read from their STATUS: the rules that the HTTP API (503 before a
request, /health), `pdkv generate` (refused before it is sent) and `pdkv status` (its exit code)
share.

A prefill can serve while one of its links to a decode is up. Without one, a request would wait
in the prefill up to its --handoff-timeout for a decode that may be gone, so the clients refuse
it at once, saying why (each link's last error). A decode serves while a prefill is linked to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def link_problem(links: Iterable[Mapping[str, Any]]) -> str | None:
    """Why no link of a prefill (its STATUS's `links`) to a decode is up, or None when one is."""
    links = list(links)
    if any(link.get("state") == "up" for link in links):
        return None
    why = "; ".join(link.get("last_error") or "not connected yet" for link in links)
    return f"the prefill daemon's link to the decode daemon is down ({why or 'no link'})"


def daemon_problem(st: Mapping[str, Any]) -> str | None:
    """Why a daemon that answered STATUS (`st`, as a dict) serves nothing, or None: a prefill
    with no link to a decode up, a decode that no prefill is linked to."""
    if st["role"] == "prefill":
        return link_problem(st["links"])
    if not st["links"]:
        return "no prefill daemon is linked to the decode daemon"
    return None


def daemons_healthy(daemons: Iterable[Mapping[str, Any]]) -> bool:
    """The rule of `pdkv status`, over the daemons found in a runtime dir (their STATUS as
    dicts, or with `down` saying why they did not answer): at least one, and every one answers
    and is linked to the other kind, wherever that one's socket lives (daemon_problem)."""
    found = list(daemons)
    return bool(found) and all("down" not in st and daemon_problem(st) is None for st in found)
