"""The decode step replayed from CUDA graphs, with greedy sampling on the device.

`DecodeRunner` owns static device buffers (token ids, positions, slot mapping, block tables,
lengths) sized for `max_batch` rows and `max_blocks` blocks a row, and one CUDA graph per batch
bucket (1, 2, 4, 8, 16, then every 16 to 128 and every 32 beyond, up to `max_batch`), each
capturing the kernel forward of `common.model.fastpath` plus a device argmax over the pool tensor
it was built with. A step packs its inputs into one pinned host buffer, copies it in one
transfer, replays the smallest bucket that holds the batch and reads the argmax back: one host sync
a step and no allocation. Rows past the batch are padded with slot -1 and length 0, so they write
no K/V and read none. A step launched before the previous one's tokens were read (the decode's
overlapped steps, decode_server/overlap.py) takes a row's input token from that step's device
argmax (`carry`): copied on the GPU after the inputs' transfer, before the replay.

Sampling keeps `common.model.sampling`'s contract: greedy rows take the device argmax (the lowest id
on ties, as `sample` does); a random row is drawn by `sample` from its fp32 logits row with the
generator of (seed, step), so its token is the one any other process draws.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from common.model.fastpath import decode_forward, rope_tables
from common.model.llama import LlamaModel
from common.model.sampling import (
    SamplingError,
    SamplingParams,
    carry_tokens,
    sample_batch_isolated,
)
from common.model.warmup import batch_buckets


class DecodeRunner:
    """Decode steps of `model` over the pool `kv` (fixed for the runner's life) from CUDA graphs.

    Thread affinity: capture and every `step` must run on one thread with the same current
    stream (the daemon's torch thread and stream).
    """

    def __init__(
        self, model: LlamaModel, kv: torch.Tensor, *, max_batch: int, max_blocks: int
    ) -> None:
        if model.device.type != "cuda" or not model.use_kernels:
            raise ValueError("DecodeRunner needs a CUDA model with the Triton kernels on")
        self.model, self.kv = model, kv
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.block_size = kv.shape[3]
        self.buckets = batch_buckets(max_batch)
        b, w = max_batch, max_blocks
        # One int64 buffer: tokens | positions | slots | lens | carried rows | tables ([b, w]).
        self._host = torch.zeros(5 * b + b * w, dtype=torch.int64).pin_memory()
        self._host_np = self._host.numpy()
        self._dev = torch.zeros_like(self._host, device=model.device)
        self._copied = torch.cuda.Event()  # the host buffer is free again once this completes
        self.replay_ns = 0  # monotonic ns: the last `run` called its graph's replay
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._argmax: dict[int, torch.Tensor] = {}
        rope_tables(model)  # allocate outside capture

    def _views(self, n: int) -> tuple[torch.Tensor, ...]:
        b, w, d = self.max_batch, self.max_blocks, self._dev
        tables = d[5 * b :].view(b, w)[:n]
        return d[:n], d[b : b + n], d[2 * b : 2 * b + n], tables, d[3 * b : 3 * b + n]

    def _carried(self, n: int) -> torch.Tensor:
        b = self.max_batch
        return self._dev[4 * b : 4 * b + n]

    def _forward(self, n: int) -> torch.Tensor:
        tokens, positions, slots, tables, lens = self._views(n)
        return decode_forward(self.model, tokens, positions, slots, tables, lens, self.kv)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm the kernels up and capture one graph per bucket (largest first, shared pool)."""
        self._fill([], [], [], [], 0)  # every row padded: nothing written, nothing read
        self._dev.copy_(self._host)
        pool = None
        for n in reversed(self.buckets):
            self._forward(n)  # compile and warm up outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(n)
                argmax = torch.argmax(logits, dim=-1)
            pool = graph.pool()
            self._graphs[n], self._logits[n], self._argmax[n] = graph, logits, argmax
        self._warm_replays()
        torch.cuda.current_stream().synchronize()

    def _warm_replays(self) -> None:
        """Replay every graph once, all rows padded (inert), with the ops an overlapped step
        adds around it, so that a server's first step is not the first use of any of them (a
        fresh pair's first step took 25 ms to launch, later ones under 1 ms; H200, 2026-12-03;
        that these first uses were the cost is presumed, not re-measured)."""
        n = self.buckets[0]
        rows = torch.full((n,), -1, dtype=torch.int64, device=self._dev.device)
        for b, graph in self._graphs.items():
            carry_tokens(self._views(n)[0], rows, self._argmax[b][:n])
            graph.replay()
            finite = torch.isfinite(self._logits[b][:n]).all(dim=-1).to(torch.int64)
            torch.stack((self._argmax[b][:n], finite)).to("cpu", non_blocking=False)

    def _fill(self, tokens, positions, slots, tables, n: int) -> None:
        """Pack a batch of n rows into the pinned host buffer; rows past n become padding."""
        b, w, h = self.max_batch, self.max_blocks, self._host_np
        h[:b] = 0
        h[:n] = tokens
        h[b : 2 * b] = 0
        h[b : b + n] = positions
        h[2 * b : 3 * b] = -1
        h[2 * b : 2 * b + n] = slots
        h[3 * b : 4 * b] = 0
        h[3 * b : 3 * b + n] = np.asarray(positions, dtype=np.int64) + 1
        grid = h[5 * b :].reshape(b, w)
        if isinstance(tables, np.ndarray):  # [n, width]: one copy
            grid[:n, : tables.shape[1]] = tables
            grid[:n, tables.shape[1] :] = 0
            return
        grid[:n] = 0
        for row, blocks in enumerate(tables):
            grid[row, : len(blocks)] = blocks

    def bucket_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds n rows, or None (too many)."""
        return next((b for b in self.buckets if b >= n), None)

    def run(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        carry: tuple[np.ndarray, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay one step: (argmax [n] int64, logits [n, vocab] fp32), both device views that the
        next step overwrites. Row i's new token is at `positions[i]`, written to `slots[i]`; its
        table is `block_tables[i]` (at most `max_blocks` ids; an int64 ndarray [n, width] is
        copied in one go). `carry` (rows [n] int64, argmax): row i's token is `argmax[rows[i]]`
        where rows[i] >= 0 (a step launched ahead's, still on the device), `tokens[i]` else."""
        n = len(tokens)
        bucket = self.bucket_for(n)
        if bucket is None or not self._graphs:
            raise ValueError(f"batch of {n} rows: capture() first, at most {self.max_batch}")
        if isinstance(block_tables, np.ndarray):
            width = block_tables.shape[1]
        else:
            width = max(len(t) for t in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"a block table is wider than max_blocks={self.max_blocks}")
        self._copied.synchronize()
        self._fill(tokens, positions, slots, block_tables, n)
        b = self.max_batch
        if carry is not None:
            self._host_np[4 * b : 4 * b + n] = carry[0]
        self._dev.copy_(self._host, non_blocking=True)
        self._copied.record()
        if carry is not None:
            carry_tokens(self._views(n)[0], self._carried(n), carry[1])
        self.replay_ns = time.monotonic_ns()
        self._graphs[bucket].replay()
        return self._argmax[bucket][:n], self._logits[bucket][:n]

    def step(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int | SamplingError]:
        """`run`, then each row's next token as `sample_batch_isolated` gives it: a row whose
        logits are not finite or whose draw fails gets a SamplingError (one host sync when every
        row is greedy)."""
        argmax, logits = self.run(tokens, positions, slots, block_tables)
        return sample_batch_isolated(logits, params, generators, argmax=argmax)
