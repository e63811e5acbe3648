"""Small prefill forwards replayed from CUDA graphs (the prefill daemon on CUDA).

A prefill forward of a few hundred tokens is bound by the host, not the GPU: at TinyLlama-1.1B's
shape on an H200 the 128 tokens after a 1,536-token cached prefix take 2.6 ms of GPU time but
5.5 ms of wall time, the rest being ~200 kernel launches from Python (bench/prefill_context.py).
That would eat most of what a prefix-cache hit saves. So, like the decode's `DecodeRunner`, the
prefill captures its forward once per shape bucket and replays it.

`PrefillGraphs` holds static device buffers sized for `max_tokens` tokens and `max_seqs` sequences
and one graph per (token bucket, sequence bucket): token buckets 16, 32, ... doubling up to 1,024,
then a quarter of a power of two at a time (`warmup.graph_token_buckets`), up to `max_tokens`;
sequence buckets 1, 2, 4, 8 up to `max_seqs`. Each graph is the paged-context
forward (`fastpath.prefill_context_forward`), which serves every prompt, with a cached prefix or
without one (start 0): every token's K/V is stored first, then attention reads the pool. Padding
is inert: tokens past the last sequence have slot -1 (write nothing) and belong to no sequence
(read by nobody; their rows are garbage that no row-wise op mixes into a real row), sequences past
the last have length 0 (no program runs for them), and their logits rows are dropped.

A forward that does not fit (more tokens or sequences than captured, a prompt that asks for
prompt logprobs, whose logits are needed at every position) runs eagerly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from common.model.fastpath import prefill_context_forward, rope_tables
from common.model.warmup import graph_token_buckets

SEQ_BUCKETS = (1, 2, 4, 8)


class PrefillGraphs:
    """Prefill forwards of `model` over the pool `kv` (fixed for its life) from CUDA graphs.

    Thread affinity: capture and every run on one thread with one current stream (the prefill
    daemon's torch thread and stream), as for DecodeRunner.
    """

    def __init__(
        self,
        model: object,
        kv: torch.Tensor,
        *,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
    ) -> None:
        if getattr(model, "device", torch.device("cpu")).type != "cuda":
            raise ValueError("PrefillGraphs needs a CUDA model")
        self.model, self.kv = model, kv
        self.tokens = graph_token_buckets(max_tokens)
        self.max_tokens = self.tokens[-1]
        self.seqs = [s for s in SEQ_BUCKETS if s <= max(1, max_seqs)]
        self.max_seqs = self.seqs[-1]
        self.max_blocks = max_blocks
        t, s, w = self.max_tokens, self.max_seqs, max_blocks
        # one int64 buffer: tokens | positions | slots (t each) | cu (s + 1) | starts | rows (s
        # each) | tables (row-major [s, w])
        self._size = 3 * t + (s + 1) + 2 * s + s * w
        self._host = torch.zeros(self._size, dtype=torch.int64).pin_memory()
        self._host_np = self._host.numpy()
        self._dev = torch.zeros_like(self._host, device=kv.device)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, int], torch.Tensor] = {}
        rope_tables(model)  # allocated outside capture

    # ---- buffer layout ---------------------------------------------------------------------------
    def _offsets(self) -> tuple[int, int, int, int, int, int, int]:
        t, s = self.max_tokens, self.max_seqs
        cu = 3 * t
        starts = cu + s + 1
        rows = starts + s
        tables = rows + s
        return 0, t, 2 * t, cu, starts, rows, tables

    def _views(self, nt: int, ns: int) -> tuple[torch.Tensor, ...]:
        tok, pos, slot, cu, starts, rows, tables = self._offsets()
        d, w = self._dev, self.max_blocks
        return (
            d[tok : tok + nt],
            d[pos : pos + nt],
            d[slot : slot + nt],
            d[cu : cu + ns + 1],
            d[starts : starts + ns],
            d[rows : rows + ns],
            d[tables : tables + self.max_seqs * w].view(self.max_seqs, w)[:ns],
        )

    def _forward(self, nt: int, ns: int) -> torch.Tensor:
        tokens, positions, slots, cu, starts, rows, tables = self._views(nt, ns)
        args = (cu, starts, tables, nt, self.kv, rows)
        return prefill_context_forward(self.model, tokens, positions, slots, *args)

    # ---- capture ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket's graph (largest first, one memory pool); how many. Nothing is
        written into the pool: every captured row is padding."""
        self._fill([], [], [], [])
        self._dev.copy_(self._host)
        pool = None
        for nt in reversed(self.tokens):
            for ns in reversed(self.seqs):
                if ns > nt:
                    continue
                self._forward(nt, ns)  # compile and warm up outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(nt, ns)
                pool = graph.pool()
                self._graphs[nt, ns], self._logits[nt, ns] = graph, logits
        torch.cuda.current_stream().synchronize()
        return len(self._graphs)

    def bucket_for(self, lengths: Sequence[int], widths: Sequence[int]) -> tuple[int, int] | None:
        """The smallest captured (tokens, sequences) bucket for pieces of `lengths` tokens whose
        block tables have `widths` blocks, or None (run it eagerly)."""
        total, n = sum(lengths), len(lengths)
        if not self._graphs or total > self.max_tokens or n > self.max_seqs or not n:
            return None
        if max(widths) > self.max_blocks:
            return None
        nt = next(b for b in self.tokens if b >= total)
        ns = next(b for b in self.seqs if b >= n)
        return (nt, ns) if (nt, ns) in self._graphs else None

    def _fill(self, tokens, slots, starts, tables) -> None:  # type: ignore[no-untyped-def]
        """Pack the pieces (each a list/array per piece) into the pinned buffer, padding the rest."""
        h, w = self._host_np, self.max_blocks
        tok, pos, slot, cu, st, rows, tab = self._offsets()
        t = self.max_tokens
        lengths = [len(x) for x in tokens]
        total = sum(lengths)
        h[tok : tok + t] = 0
        h[pos : pos + t] = 0
        h[slot : slot + t] = -1
        if total:
            h[tok : tok + total] = np.concatenate([np.asarray(x, dtype=np.int64) for x in tokens])
            h[pos : pos + total] = np.concatenate(
                [np.arange(a, a + n, dtype=np.int64) for a, n in zip(starts, lengths, strict=True)]
            )
            h[slot : slot + total] = np.concatenate([np.asarray(x, dtype=np.int64) for x in slots])
        bounds = np.cumsum([0, *lengths], dtype=np.int64)
        s = self.max_seqs
        h[cu : cu + s + 1] = total
        h[cu : cu + len(bounds)] = bounds
        h[st : st + s] = 0
        h[st : st + len(starts)] = starts
        h[rows : rows + s] = 0
        h[rows : rows + len(lengths)] = bounds[1:] - 1
        grid = h[tab : tab + s * w].reshape(s, w)
        grid[:] = 0
        for i, blocks in enumerate(tables):
            grid[i, : len(blocks)] = blocks

    def run(
        self,
        tokens: Sequence[Sequence[int]],
        slots: Sequence[Sequence[int]],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        bucket: tuple[int, int],
    ) -> torch.Tensor:
        """Replay bucket `bucket` (from `bucket_for`) for pieces: piece i computes `tokens[i]` at
        positions starts[i] .. starts[i]+len-1 of its sequence, writes their K/V to `slots[i]`,
        attends to its positions 0 .. through `tables[i]`. -> logits [n, vocab] fp32 of each
        piece's last token: a device view that the next run overwrites."""
        if self._copied is not None:
            self._copied.synchronize()  # the last run's copy has read the pinned buffer
        self._fill(tokens, slots, starts, tables)
        self._dev.copy_(self._host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._graphs[bucket].replay()
        return self._logits[bucket][: len(tokens)]


__all__ = ["PrefillGraphs"]
