"""The decode's FINISH timings: the marks a request's life stamps and the spans FINISH reports.

Each key and what it spans is docs/protocol.md's ("FINISH (D → P → C)"). The control flow only
stamps marks on `seq.marks` (CLOCK_MONOTONIC ns), under these names:

    handoff_sent, handoff_rx   the HANDOFF's send (P's clock), its bytes read here
    handoff_read, admitted     handed to the request table; checked and blocks reserved
    kv_ready_sent, kv_ready_read   an early HANDOFF's KV_READY: sent (P's clock), read
    kv_launched_sent, kv_launched_read   its KV_LAUNCHED (v12): sent (P's clock), read
    launch_started             its pull and first step started on KV_LAUNCHED (not KV_READY)
    kv_sent, kv_read           the frame that made the KV ready to move (KV_LAUNCHED when the
                               pull started on it, else KV_READY after an early HANDOFF, else
                               the HANDOFF): sent, read
    pull_started, enqueued     the pull's start called, returned
    joined                     in the batch (or queued for it)
    usable                     joined, and its pull's start returned: the KV is usable on our
                               stream (a NIXL transfer: once done)
    pulled                     the copy seen complete on the host (RELEASE goes)
    first_step_started, first_step_prepared, first_step_replaying, first_step_launched,
    first_step_synced          its first step (engine.py's last_step_ns)
    first_posted, finished     its first decoded token posted; its FINISH built

A mark from P's clock is stamped only from a frame that carries one (`sent_ns` is 0 on a link
across hosts), so the spans from it are absent there.
"""

from __future__ import annotations

from common.timings import Span
from decode_server.sequence import Sequence

#: FINISH's timings from the decode, in the order they are reported.
SPANS = (
    # `always`: 0.0 when a mark is missing (no clock from P, FINISH before the copy was seen
    # complete, never in the batch): readers of FINISH rely on these keys
    Span("decode_handoff_us", "kv_sent", "pulled", always=True),
    Span("pull_us", "kv_read", "pulled", always=True),
    Span("usable_us", "kv_sent", "usable", always=True),
    Span("first_step_us", "pull_started", "first_posted", always=True),
    Span("admit_us", "handoff_read", "admitted"),
    Span("read_us", "handoff_sent", "handoff_read"),
    Span("wire_us", "handoff_sent", "handoff_rx"),
    Span("first_wait_us", "admitted", "kv_ready_read"),
    Span("first_read_us", "kv_ready_sent", "kv_ready_read"),
    Span("launch_lead_us", "launch_started", "kv_ready_read"),
    Span("enqueue_us", "pull_started", "enqueued"),
    Span("join_us", "joined", "first_step_started"),
    Span("first_launch_us", "first_step_started", "first_step_launched"),
    Span("first_prep_us", "first_step_started", "first_step_prepared"),
    Span("first_fill_us", "first_step_prepared", "first_step_replaying"),
    Span("first_sync_us", "first_step_launched", "first_step_synced"),
)
DECODE_MS = Span("decode_ms", "pull_started", "finished", 1_000_000)


def finish_timings(seq: Sequence) -> dict[str, float]:
    """The timings of `seq`'s FINISH (stamp `finished` first)."""
    out = seq.marks.render(SPANS)
    if seq.steps >= 2:  # the mean of its steps after the first, start to token
        out["later_step_us"] = round(seq.later_step_ns / (seq.steps - 1) / 1000, 1)
    out.update(seq.marks.render((DECODE_MS,)))
    return out


__all__ = ["DECODE_MS", "SPANS", "finish_timings"]
