"""A single-process serving engine for bench/serve.py: continuous batching in one thread.

It stands for "the same model without disaggregation" and is built on the model-level API only
(`LlamaModel.prefill` / `decode_step`, `KVPool`, `BlockAllocator`, the sampler), never on daemon
internals. Requests come in from the asyncio side; one engine thread runs steps, each:

1. admit waiting requests in arrival order while the batch has room, their blocks are free and the
   step's prefill token budget lasts (the first always goes): prefill each alone, sample its first
   token and hand it to the client at once;
2. one decode step over every running sequence (on CUDA with the kernels, replayed from the same
   CUDA-graph runner the decode daemon uses); each new token is handed over as it is sampled.

Blocks for prompt + max_tokens are reserved at admission, so a running sequence never waits for
memory. Tokens reach the loop through `call_soon_threadsafe`, one call per token, as the daemons
send one TOKENS frame per token. All model calls are in `ModelRunner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from common.kv.allocator import BlockAllocator
from common.kv.pool import KVPool, PoolLayout
from common.model import LlamaModel, finish_reason, make_generator, sample_batch, slots_for
from common.sampling_params import SamplingParams

# emit(tokens, done, error): called on the engine thread; `error` ends the request
Emit = Callable[[list[int], bool, str | None], None]


@dataclass(eq=False)  # identity: the engine looks sequences up in its lists
class Sequence:
    """One request inside the engine; `blocks` hold prompt + max_tokens positions once admitted."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    emit: Emit
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


class ModelRunner:
    """The engine's only calls into the model: a prefill of one sequence, a decode step of many."""

    def __init__(
        self, model: LlamaModel, kv: torch.Tensor, block_size: int, max_batch: int
    ) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.graphs = None  # on CUDA with the kernels: the decode daemon's CUDA-graph runner
        if model.device.type == "cuda" and model.use_kernels:
            from common.model.runner import DecodeRunner

            max_pos = model.config.max_position_embeddings
            max_blocks = min(-(-max_pos // block_size), kv.shape[0])
            self.graphs = DecodeRunner(model, kv, max_batch=max_batch, max_blocks=max_blocks)
            self.graphs.capture()
            self._warm_prefill(max_pos)

    def _warm_prefill(self, longest: int) -> None:
        """The prefill's kernel shape classes run once now, as the prefill daemon runs them at
        its start (common.model.warmup): without it the first requests of a measured rate
        waited for cuBLAS's first loads (H200, 2026-12-03: the goodput sweep's first rate read
        TTFT p50 148 ms against 12 ms at the next, twice the rate). Writes nothing."""
        from common.model import warmup

        buckets = warmup.prefill_token_buckets(longest, longest)
        groups = [[m] for n in buckets for m in (n, n - 1) if 1 <= m <= longest]
        warmup.warm_sampling(warmup.warm_prefill(self.model, self.kv, groups))
        torch.cuda.synchronize(self.model.device)

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Logits [vocab] of the prompt's last position; the prompt's KV lands in its blocks."""
        slots = slots_for(seq.blocks, 0, len(seq.prompt), self.block_size)
        return self.model.prefill(torch.tensor(seq.prompt), slots, self.kv)

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, vocab]: each sequence's last token fed at its position."""
        bs = self.block_size
        positions = [len(s.prompt) + len(s.generated) - 1 for s in seqs]
        width = max(p // bs for p in positions) + 1
        tables = torch.tensor([(s.blocks[:width] + [0] * width)[:width] for s in seqs])
        pos = torch.tensor(positions)
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        tokens = torch.tensor([s.generated[-1] for s in seqs])
        if self.graphs is not None and self.graphs.bucket_for(len(seqs)):
            args = (tokens.tolist(), positions, slots.tolist(), tables.numpy())
            return self.graphs.run(*args)[1]  # replayed as the decode daemon does
        return self.model.decode_step(tokens, pos, slots, tables, pos + 1, self.kv)


class LocalEngine:
    """Continuous batching over one model in one thread; use as a context manager (starts and
    stops the thread). `stream` is the asyncio entry point; `submit` the thread-safe one."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int = 1024,
        block_size: int = 16,
        max_batch: int = 64,
        prefill_tokens: int = 2048,
    ) -> None:
        layers, heads, dim = model.kv_layout_args()
        dtype = str(model.dtype).removeprefix("torch.")
        layout = PoolLayout(num_blocks, layers, heads, dim, block_size, dtype)
        self.pool = KVPool.create(layout, device=model.device)
        self.allocator = BlockAllocator(num_blocks)
        self.runner = ModelRunner(model, self.pool.tensor, block_size, max_batch)
        self.max_batch, self.prefill_tokens, self.block_size = max_batch, prefill_tokens, block_size
        self._max_len = model.config.max_position_embeddings
        self._stops = frozenset(model.config.stop_token_ids)
        self._inbox: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="local-engine", daemon=True)

    def __enter__(self) -> LocalEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inbox.put(None)
        self._thread.join()

    def submit(self, prompt: list[int], params: SamplingParams, emit: Emit) -> None:
        """Queue one request; its tokens, end or error come through `emit` on the engine thread."""
        self._inbox.put(Sequence(f"local-{next(self._ids)}", list(prompt), params.validate(), emit))

    async def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[list[int]]:
        """Yield the request's new tokens as the engine samples them; RuntimeError on failure."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[list[int], bool, str | None]] = asyncio.Queue()

        def emit(tokens: list[int], done: bool, error: str | None) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, (tokens, done, error))

        self.submit(prompt, params, emit)
        while True:
            tokens, done, error = await inbox.get()
            if error is not None:
                raise RuntimeError(error)
            if tokens:
                yield tokens
            if done:
                return

    # -- engine thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            for item in self._drain(block=not self._waiting and not self._running):
                if item is None:
                    return self._fail_all("engine stopped")
                self._accept(item)
            try:
                self.step()
            except Exception as e:  # a model error ends every request, not the engine
                self._fail_all(f"{type(e).__name__}: {e}")

    def _drain(self, block: bool) -> list[Sequence | None]:
        """Everything in the inbox; waits for the first item only when `block` (engine idle)."""
        items: list[Sequence | None] = []
        with contextlib.suppress(queue.Empty):
            items.append(self._inbox.get(block=block))
            while True:
                items.append(self._inbox.get_nowait())
        return items

    def _accept(self, seq: Sequence) -> None:
        total = len(seq.prompt) + seq.params.max_tokens
        if not seq.prompt or total > self._max_len or self._blocks_for(seq) > self.allocator.total:
            seq.emit(
                [],
                True,
                f"request of {len(seq.prompt)} + {seq.params.max_tokens} tokens "
                f"does not fit (max {self._max_len} positions, {self.allocator.total} blocks)",
            )
            return
        self._waiting.append(seq)

    def step(self) -> None:
        """Admit and prefill what fits, then one decode step over the running sequences."""
        budget = self.prefill_tokens
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            need = self._blocks_for(seq)
            first = budget == self.prefill_tokens
            if (len(seq.prompt) > budget and not first) or not self.allocator.can_allocate(need):
                break
            self._waiting.popleft()
            budget -= len(seq.prompt)
            seq.blocks = self.allocator.allocate(seq.rid, need)
            logits = self.runner.prefill(seq)[None]
            self._append([seq], logits)
        if self._running:
            self._append(list(self._running), self.runner.decode(self._running))

    def _append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence, hand it over, retire the sequences that are done."""
        params = [s.params for s in seqs]
        generators = [make_generator(s.params, len(s.generated)) for s in seqs]
        for seq, token in zip(seqs, sample_batch(logits, params, generators), strict=True):
            seq.generated.append(token)
            done = finish_reason(seq.generated, seq.params, self._stops) is not None
            if done:
                self.allocator.free(seq.rid)
                if seq in self._running:
                    self._running.remove(seq)
            elif seq not in self._running:
                self._running.append(seq)
            seq.emit([token], done, None)

    def _blocks_for(self, seq: Sequence) -> int:
        return -(-(len(seq.prompt) + seq.params.max_tokens) // self.block_size)

    def _fail_all(self, reason: str) -> None:
        for seq in [*self._running, *self._waiting]:
            if seq.rid in self.allocator:
                self.allocator.free(seq.rid)
            seq.emit([], True, reason)
        self._running.clear()
        self._waiting.clear()
