"""Prefill on the torch thread: one varlen forward over pieces of several prompts (a whole prompt,
the part after its cached prefix, or one chunk of a long one), scatter into the pool, the first
token of each prompt whose last piece it is."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.daemon.runtime import ModelRuntime
from common.model import logits as logits_mod
from common.model.logits import TokenHistory
from common.model.paged import slots_for
from common.model.prefill import prefill_many, split_rows
from common.model.sampling import SamplingError, SamplingParams, draw, make_generator
from common.sampling_params import TokenLogprob
from common.structured import bitmask, grammars_for
from common.transfer import Producer

#: most prompts of one forward whose first token goes to the mailbox (KV_LAUNCHED): an idle
#: decode takes one such launch at a time, and a busy one none
MAX_LAUNCHED = 4


def launches_early(p: SamplingParams) -> bool:
    """Whether a request's first token may go to the decode on the GPU (KV_LAUNCHED): plain
    greedy, so that token is the raw logits' argmax on both sides, and more tokens to come."""
    plain = p.greedy and not p.penalized and p.min_tokens == 0 and p.structured is None
    return plain and p.logprobs is None and p.prompt_logprobs is None and p.max_tokens > 1


@dataclass(frozen=True, slots=True)
class FirstToken:
    """What one prompt's prefill gives its request: the first token (None when max_tokens is 0:
    only the prompt is scored), its logprob entry and the prompt's (when asked); `complete`:
    its grammar's text is complete after this token (the request ends, "stop")."""

    token: int | None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    complete: bool = False


@dataclass(frozen=True)
class Piece:
    """Positions start .. end-1 of a prompt whose `blocks` already hold the K/V of positions
    0 .. start-1 (a cached prefix, earlier chunks). `sampling` None: not the prompt's last piece,
    nothing is sampled; `slot`: the event recorded once its last piece is written (-1: none)."""

    prompt: list[int]
    start: int
    end: int
    blocks: list[int]
    sampling: SamplingParams | None
    slot: int = -1


def run_prefill_batch(
    rt: ModelRuntime,
    pieces: Sequence[Piece],
    producer: Producer | None = None,
    *,
    token_budget: int,
    launched: Callable[[list[int]], None] | None = None,
) -> list[FirstToken | SamplingError | None]:
    """Write each piece's K/V into its blocks of the pool; for each piece that ends its prompt,
    the prompt's first token (with its logprobs and the prompt's when its params ask), or a
    SamplingError in its place when that prompt's logits are not finite or its draw fails (the
    other prompts keep theirs); None for the other pieces.

    A batch that fits the daemon's prefill graphs (`rt.graphs`: few enough tokens and
    prompts, none asking for prompt logprobs) replays one instead of launching its kernels.
    Otherwise the pieces run in as few forwards as `token_budget` allows (one, when the caller keeps their
    sum within it), and each prompt's logits and token are those of prefilling it alone: the
    token is drawn with the generator of (seed, step 0), as the single-process reference draws it.
    A prompt whose params ask for prompt logprobs comes whole, as one piece from position 0 (the
    pipeline gives it no cached prefix and the batcher does not chunk it): its logits at every
    position are then all computed here.
    Runs on the torch thread, on the daemon's stream. On CUDA, the producer records the slot of
    every last piece right after the batch's scatter on that stream, so a peer stream that waits
    on it sees every write of that prompt's K/V, earlier chunks' and cached blocks' included
    (written by earlier forwards on this stream). A failure of the forward itself raises, for
    the whole batch.

    With `launched` and the producer's mailbox (v12), the first token of up to MAX_LAUNCHED
    pieces whose request `launches_early` is written into the mailbox entry of its slot (the
    argmax of its logits, the token the draw below takes) before the slot is recorded, and
    `launched(indices of those pieces)` is called right after the records, before the host
    waits for anything: the decode may then queue work behind the slot (KV_LAUNCHED).
    """
    bs = rt.layout.block_size
    ids = [p.prompt[p.start : p.end] for p in pieces]
    lengths = [len(x) for x in ids]
    mappings = [slots_for(p.blocks, p.start, p.end - p.start, bs) for p in pieces]
    starts = [p.start for p in pieces]
    tables = [p.blocks for p in pieces]
    every = [p.sampling is not None and p.sampling.prompt_logprobs is not None for p in pieces]
    for p, want in zip(pieces, every, strict=True):
        if want and p.start != 0:
            raise ValueError("prompt logprobs need the whole prompt in one piece")
    graphs = rt.graphs  # small forwards replay a CUDA graph (host-bound otherwise)
    bucket = None
    if graphs is not None and not any(every):
        bucket = graphs.bucket_for(lengths, [len(t) for t in tables])
    with rt.on_stream():
        if bucket is not None:
            out = graphs.run(ids, mappings, starts, tables, bucket)
        else:
            out = prefill_many(
                rt.model,
                [torch.tensor(x, dtype=torch.long) for x in ids],
                mappings,
                rt.pool.tensor,
                token_budget=token_budget,
                every_position=every,
                starts=starts,
                block_tables=tables,
            )
        last = [i for i, p in enumerate(pieces) if p.sampling is not None]
        params = [p.sampling for p in pieces if p.sampling is not None]  # those of `last`
        mailbox = None if producer is None or launched is None else producer.mailbox
        early = [] if mailbox is None else _early_rows(pieces, last, params)
        answers: list[FirstToken | SamplingError | None] = [None] * len(pieces)
        argmax = None
        if last:
            rows, full = split_rows(out, lengths, every)
            logits = rows[last]
            if early:
                assert mailbox is not None
                argmax = torch.argmax(logits, dim=-1)
                for j in early:
                    slot = pieces[last[j]].slot
                    mailbox[slot : slot + 1].copy_(argmax[j : j + 1])
        if producer is not None:
            for i in last:
                producer.record(pieces[i].slot, rt.stream)
        if early:
            assert launched is not None
            launched([last[j] for j in early])
        if not last:
            return answers
        vocab, dev = logits.shape[-1], logits.device
        histories = [
            TokenHistory.start(pieces[i].prompt, [], vocab, dev) if p.penalized else None
            for i, p in zip(last, params, strict=True)
        ]
        generators = [make_generator(p, 0) for p in params]
        matchers, masks = _first_masks(rt, params, vocab)
        firsts, lps = draw(
            logits,
            params,
            generators,
            steps=[0] * len(last),
            histories=histories,
            eos_ids=rt.model.config.stop_token_ids,
            argmax=argmax,  # the mailbox's tokens, where it has some: the same argmax
            masks=masks,
        )
        for j, (i, p, first, lp) in enumerate(zip(last, params, firsts, lps, strict=True)):
            if isinstance(first, SamplingError):
                answers[i] = first
                continue
            k = p.prompt_logprobs
            scored = None if k is None else logits_mod.prompt_logprobs(full[i], pieces[i].prompt, k)
            if p.max_tokens == 0:  # only the prompt is scored
                answers[i] = FirstToken(None, None, scored)
            else:
                m = matchers.get(j)
                complete = m is not None and (not m.accept(first) or m.terminated)
                answers[i] = FirstToken(first, lp, scored, complete)
        return answers


def _first_masks(
    rt: ModelRuntime, params: list[SamplingParams], vocab: int
) -> tuple[dict, tuple[list[int], torch.Tensor] | None]:
    """The grammar masks of the constrained prompts' first tokens (computed on the host after
    the forward was launched) and their matchers by row; nothing when none is constrained. The
    grammars were compiled at admission (the cache's hits here)."""
    rows = [j for j, p in enumerate(params) if p.structured is not None]
    if not rows:
        return {}, None
    config = rt.model.config
    cache = grammars_for(rt.tokenizer, config.vocab_size, config.stop_token_ids)
    mask = bitmask.allocate(len(rows), vocab)
    mask.zero_()
    matchers = {}
    for k, j in enumerate(rows):
        structured = params[j].structured
        assert structured is not None
        matchers[j] = m = cache.compile(structured).matcher()
        m.fill(mask, k)
    return matchers, (rows, mask)


def _early_rows(
    pieces: Sequence[Piece], last: list[int], params: list[SamplingParams]
) -> list[int]:
    """The positions in `last` (at most MAX_LAUNCHED) of the prompts whose first token goes to
    the mailbox: recorded on an event slot, their request `launches_early`."""
    rows = [j for j, i in enumerate(last) if pieces[i].slot >= 0 and launches_early(params[j])]
    return rows[:MAX_LAUNCHED]
