"""A HANDOFF's way into the decode: checked against the link, and its blocks reserved for the
request's whole life, or refused with the ERROR the protocol names (BAD_REQUEST, NO_CAPACITY).

The decode's prefix cache (common.kv.prefix_cache, the prefill's rules): the blocks start with the
cached blocks of the prompt's prefix, named from the HANDOFF's prompt tokens as the prefill names
them, and only the rest are pulled; they are published once the pull wrote them."""

from __future__ import annotations

import structlog

from common.daemon.runtime import ModelRuntime
from common.errors import OutOfBlocks, PdkvError
from common.kv.tier_io import settle
from common.protocol import ErrorCode, Handoff
from decode_server.grammars import start as start_grammar
from decode_server.peer import Peer
from decode_server.sequence import Sequence, blocks_needed, seq_key

log = structlog.get_logger(__name__)


def admit(rt: ModelRuntime, peer: Peer, h: Handoff, stop_ids: frozenset[int]) -> Sequence | None:
    """Check `h` and reserve its blocks: its Sequence (Phase.NEW, nothing planned or pulled yet),
    or None once the refusal is posted to `peer`."""
    consumer = peer.consumer
    try:
        if consumer is None:
            raise ValueError("HANDOFF before REGISTER")
        consumer.validate(h, rt.model.config.vocab_size)
        if h.sampling.max_tokens < 1:  # max_tokens 0 (prompt logprobs only) never leaves P
            raise ValueError("a HANDOFF with max_tokens 0 has nothing to decode")
        grammar = start_grammar(rt, h.sampling, stop_ids)  # GrammarError: before any block
    except (ValueError, PdkvError) as exc:
        refuse(peer, h.request_id, str(exc))
        return None
    block_size = rt.layout.block_size
    need = blocks_needed(h.num_tokens, h.sampling.max_tokens, block_size)
    if need > rt.allocator.total:
        peer.post_error(
            ErrorCode.BAD_REQUEST,
            f"prompt + max_tokens need {need} KV blocks, the decode pool has "
            f"{rt.allocator.total} (lower max_tokens or raise the decode's --num-blocks)",
            h.request_id,
        )
        return None
    cache = rt.prefix
    names = cache.names(h.prompt_tokens) if cache is not None else []
    hit = cache.hit(names, h.num_tokens) if cache is not None else []
    settle(rt)  # the host tier's write-backs are done reading blocks freed meanwhile
    try:
        blocks = rt.allocator.allocate(
            seq_key(peer.link_id, h.request_id), need - len(hit), reuse=hit
        )
    except OutOfBlocks as exc:
        log.info(
            "handoff_no_capacity",
            request_id=h.request_id,
            link=peer.link_id,
            need=need,
            free=exc.free,
        )
        peer.post_error(ErrorCode.NO_CAPACITY, str(exc), h.request_id)
        return None
    if cache is not None:
        cache.counted(h.num_tokens, len(hit))
    return Sequence(
        request_id=h.request_id,
        link=peer,
        prompt_len=h.num_tokens,
        generated=[] if h.first_token is None else [h.first_token],
        blocks=blocks,
        sampling=h.sampling,
        stop_ids=stop_ids,
        block_size=block_size,
        event_slot=h.event_slot,
        names=names,
        cached_blocks=len(hit),
        prompt=list(h.prompt_tokens) if h.sampling.repetition_penalty != 1.0 else [],
        tier=None if rt.host_tier is None else rt.host_tier.conversation(h.prompt_tokens, names),
        grammar=grammar,
    )


def refuse(peer: Peer, request_id: str, why: str) -> None:
    """Answer a HANDOFF with BAD_REQUEST: the decode holds nothing for it."""
    log.warning("handoff_rejected", request_id=request_id, link=peer.link_id, error=why)
    peer.post_error(ErrorCode.BAD_REQUEST, why, request_id)


__all__ = ["admit", "refuse"]
