"""Protocol version, its numbered history, and the compatibility fingerprint of the handshake."""

from __future__ import annotations

import hashlib
import json
from typing import Any

MAGIC = b"PDKV"

#: The version this build speaks. A peer with another version is refused at HELLO.
PROTOCOL_VERSION = 13

#: Every version ever shipped and what it changed. Append, never edit.
HISTORY: dict[int, str] = {
    1: "first version: HELLO..PONG on the link; GENERATE/STATUS on the client socket",
    2: "HELLO carries `compat` (what the fingerprint hashes, in the clear) so INCOMPATIBLE names "
    "the fields that differ; error code NUMERIC_ERROR",
    3: "links across hosts (TCP): HELLO/HELLO_OK nonces and proofs (HMAC-SHA256 over both), "
    "REGISTER/REGISTERED carry `nixl` (a NIXL agent and its registered pool), PUSH and "
    "PUSH_FAILED for push links, error code AUTH_FAILED",
    4: "the early handoff on Unix-socket links: HANDOFF's `first_token` may be null (sent when the "
    "prompt is queued for its forward, before its KV is written), and TOKENS P → D then carries "
    "that first token, which also says the KV may be read; TOKENS has `sent_ns`",
    5: "KV_READY P → D: the first token of an early HANDOFF, which says its KV is written, gets "
    "its own message instead of TOKENS P → D (TOKENS is D → P → C only again; its `sent_ns` goes); "
    "STATUS_REPLY has `model_card` (the model's name, checkpoint path and context length)",
    6: "PONG carries the decode's load (`free_blocks`, `sequences`), by which a prefill linked to "
    "several decodes picks one per request",
    7: "sampling features: SamplingParams (GENERATE, HANDOFF) has `logprobs`, `prompt_logprobs`, "
    "`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_tokens`, "
    "`stop_token_ids`, and max_tokens may be 0 with prompt_logprobs; TOKENS has `logprobs` (one "
    "[token, logprob, top] entry per token) and `prompt_logprobs` (P → C, up to 512 per frame)",
    8: "the prefix cache: FINISH's `usage` has `cached_tokens` (prompt tokens whose KV was reused), "
    "STATUS_REPLY has `prefix_cache` (its counters) and its `pool` a `cached` count",
    9: "FINISH P → C has `decode`: the link (link-N@DECODE) the request was handed to, so a "
    "client sees which decode daemon served it when a prefill has several",
    10: "STEP_TOKENS D → P: one decode step's tokens (and logprobs) for every sequence of a link "
    "and the FINISHes of that step in one frame, instead of a TOKENS frame per sequence; "
    "STATUS_REPLY has `instance` (the daemon's --instance, the `pdkv_instance` label of its "
    "metrics)",
    11: "TCP links hand off early: after an early HANDOFF the decode sends PUSH at once (push "
    "links), with the HANDOFF's `request_id`, and the prefill WRITEs it when the KV is written, "
    "leasing the blocks and sending KV_READY; on pull links the decode READs on KV_READY",
    12: "KV_LAUNCHED P → D: an early HANDOFF's forward, first token and event record are queued "
    "on the prefill's GPU (not done); the first token is on the GPU in the mailbox entry of its "
    "event slot, in the prefill pool's block that REGISTER's new `mailbox_block` names, so the "
    "decode may queue its pull and first step behind the slot before KV_READY; an ABORT after "
    "KV_LAUNCHED is answered as after KV_READY",
    13: "structured output: SamplingParams (GENERATE, HANDOFF) has `structured` ({kind, spec}: "
    "json_object, json_schema, regex, choice or grammar), the constraint the prefill's first "
    "token and the decode's steps are chosen under",
}

SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})


def compat_fields(*, model_id: str, layout: dict[str, Any], backend: str) -> dict[str, Any]:
    """What `fingerprint` hashes, in the clear: HELLO carries it so a refusal can name the field
    that differs instead of two hashes."""
    shape = {k: v for k, v in sorted(layout.items()) if k != "num_blocks"}
    return {"model": model_id, "backend": backend, **shape}


def compat_diff(ours: dict[str, Any], theirs: dict[str, Any], *, limit: int = 8) -> str:
    """The fields of two `compat_fields` that differ, as "block_size 32 ≠ 16" (theirs ≠ ours),
    at most `limit` of them, each value cut short (a peer's values are untrusted text)."""
    diffs = [
        f"{_short(k)} {_short(theirs.get(k, '(none)'))} ≠ {_short(ours.get(k, '(none)'))}"
        for k in sorted(set(ours) | set(theirs), key=str)
        if theirs.get(k) != ours.get(k)
    ]
    more = f" (+{len(diffs) - limit} more)" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more


def _short(value: object, limit: int = 64) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def fingerprint(*, model_id: str, layout: dict[str, Any], backend: str) -> str:
    """Compatibility hash compared at HELLO: model identity, pool layout less its size, backend.

    `layout` is PoolLayout.to_wire(); `num_blocks` is left out because the two daemons may size
    their pools differently — everything that shapes one block must match.
    """
    shape = {k: v for k, v in sorted(layout.items()) if k != "num_blocks"}
    canon = json.dumps({"model": model_id, "layout": shape, "backend": backend}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
