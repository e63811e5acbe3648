"""CUDA graphs' static outputs, emulated on the CPU (issue 42's CUDA-only failure).

On CUDA the decode's steps replay graphs (common.model.runner.DecodeRunner) whose argmax and
logits are static per-bucket buffers: `run` returns views of them, and the next replay of the same
bucket overwrites them; so may a replay of a larger bucket: the graphs share one memory pool,
captured largest first, so a smaller bucket's outputs may lie where a larger one keeps its
intermediates. On the CPU every eager step returns fresh tensors, so a view read after a later
replay (an aliasing bug) is invisible there. `StaticDecodeGraphs` has DecodeRunner's interface
(`run`, `bucket_for`, `max_batch`, `max_blocks`, `replay_ns`, `buckets`) and runs the eager
step, then copies its results into static per-bucket tensors and returns views of those, taking
carried tokens exactly as DecodeRunner does: a stand-in for a fault the CPU cannot cause for
real. Each run puts junk into every bucket's outputs first (the padded rows keep it, as
a graph computes rows of length 0), so that a view read after a later run, or past its rows,
is wrong.

`StaticPrefillGraphs` does the same for the prefill's graphs (PrefillGraphs: each piece's
last-token logits). `LateReadback` gives a launched step's tokens to the host as a pinned copy
on CUDA does: junk in the host buffer until its event is synchronized (or queried done). What
none emulates: the rest of a stream's asynchrony (on the CPU every op is done when it returns,
which is the stream's order) and the Triton kernels' sums.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.daemon.runtime import ModelRuntime
from common.model.prefill import prefill_many
from common.model.sampling import carry_tokens
from common.model.warmup import batch_buckets, graph_token_buckets
from decode_server.overlap import Readback

#: PrefillGraphs' sequence buckets (common.model.prefill_graphs imports triton: not here)
SEQ_BUCKETS = (1, 2, 4, 8)
#: what a padded row's logits hold (a graph computes them over no K/V): large, so its argmax is
#: not any real row's by accident
JUNK = 1.0e4


class StaticDecodeGraphs:
    """DecodeRunner's contract over the eager torch path: results in static per-bucket buffers."""

    def __init__(self, rt: ModelRuntime, *, max_batch: int, max_blocks: int) -> None:
        self.model, self.kv = rt.model, rt.pool.tensor
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.buckets = batch_buckets(max_batch)
        self.replay_ns = 0
        vocab = rt.model.config.vocab_size
        self._logits = {b: torch.full((b, vocab), JUNK) for b in self.buckets}
        self._argmax = {b: torch.zeros(b, dtype=torch.int64) for b in self.buckets}
        self._junk_token = vocab - 1  # a special id: a stale argmax read or carried shows
        self.replays: Counter[int] = Counter()  # per bucket
        self.carried = 0  # replays whose tokens were carried from a step before
        self.back_to_back = 0  # replays of the bucket the replay before used
        self._last: int | None = None

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _clobber(self) -> None:
        """Junk in every bucket's outputs: what a replay may leave in any earlier step's views
        (the module's docstring says why; every bucket, the stricter contract)."""
        for b in self.buckets:
            self._logits[b].fill_(JUNK)
            self._argmax[b].fill_(self._junk_token)

    def run(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        carry: tuple[np.ndarray, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecodeRunner.run: (argmax [n], logits [n, vocab]), views of this bucket's buffers
        that its next replay overwrites."""
        n = len(tokens)
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"batch of {n} rows: at most {self.max_batch}")
        tables = np.zeros((n, self.max_blocks), dtype=np.int64)
        for row, blocks in enumerate(block_tables):
            blocks = np.asarray(blocks, dtype=np.int64)
            if blocks.shape[0] > self.max_blocks:
                raise ValueError(f"a block table is wider than max_blocks={self.max_blocks}")
            tables[row, : blocks.shape[0]] = blocks
        tok = torch.tensor(list(tokens), dtype=torch.int64)
        if carry is not None:  # DecodeRunner: the rows travel with the inputs, then this op
            rows = torch.from_numpy(np.array(carry[0], dtype=np.int64))
            carry_tokens(tok, rows, carry[1])
            self.carried += 1
        pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
        logits = self.model.decode_step(
            tok,
            pos,
            torch.as_tensor(np.asarray(slots, dtype=np.int64)),
            torch.from_numpy(tables),
            pos + 1,
            self.kv,
        )
        self.replay_ns = time.monotonic_ns()
        self._clobber()
        out, argmax = self._logits[bucket], self._argmax[bucket]
        out[:n] = logits
        argmax.copy_(torch.argmax(out, dim=-1))
        self.replays[bucket] += 1
        self.back_to_back += self._last == bucket
        self._last = bucket
        return argmax[:n], out[:n]


class StaticPrefillGraphs:
    """PrefillGraphs' contract (common.model.prefill_graphs) over the eager torch path: each
    piece's last-token logits in a static per-(tokens, sequences) bucket buffer, its padded rows
    junk, returned as a view that the bucket's next run overwrites."""

    def __init__(
        self, rt: ModelRuntime, *, max_tokens: int, max_seqs: int, max_blocks: int
    ) -> None:
        self.model, self.kv = rt.model, rt.pool.tensor
        self.tokens = graph_token_buckets(max_tokens)
        self.max_tokens = self.tokens[-1]
        self.seqs = [s for s in SEQ_BUCKETS if s <= max(1, max_seqs)]
        self.max_seqs, self.max_blocks = self.seqs[-1], max_blocks
        vocab = rt.model.config.vocab_size
        self._logits = {
            (nt, ns): torch.full((ns, vocab), JUNK)
            for nt in self.tokens
            for ns in self.seqs
            if ns <= nt
        }
        self.replays: Counter[tuple[int, int]] = Counter()

    def bucket_for(self, lengths: Sequence[int], widths: Sequence[int]) -> tuple[int, int] | None:
        """As PrefillGraphs.bucket_for."""
        total, n = sum(lengths), len(lengths)
        if total > self.max_tokens or n > self.max_seqs or not n or max(widths) > self.max_blocks:
            return None
        nt = next(b for b in self.tokens if b >= total)
        ns = next(b for b in self.seqs if b >= n)
        return (nt, ns) if (nt, ns) in self._logits else None

    def run(
        self,
        tokens: Sequence[Sequence[int]],
        slots: Sequence[torch.Tensor],
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        bucket: tuple[int, int],
    ) -> torch.Tensor:
        """As PrefillGraphs.run: [n, vocab], a view of the bucket's buffer."""
        logits = prefill_many(
            self.model,
            [torch.tensor(list(t), dtype=torch.long) for t in tokens],
            list(slots),
            self.kv,
            token_budget=self.max_tokens,
            starts=list(starts),
            block_tables=list(tables),
        )
        for buffer in self._logits.values():  # a replay may overwrite any earlier view
            buffer.fill_(JUNK)
        out = self._logits[bucket]
        out[: len(tokens)] = logits
        self.replays[bucket] += 1
        return out[: len(tokens)]


class _Landing:
    """A CUDA event recorded after a device-to-host copy, as its host sees it: the copy's
    values are in `host` once `synchronize()` ran or `query()` said done, not before."""

    def __init__(self, host: torch.Tensor, values: torch.Tensor) -> None:
        self.host, self.values, self.landed = host, values, False

    def query(self) -> bool:
        self._land()
        return True

    def synchronize(self) -> None:
        self._land()

    def _land(self) -> None:
        if not self.landed:
            self.host.copy_(self.values)
            self.landed = True


class LateReadback(Readback):
    """decode_server.overlap.Readback whose copies land late: `start` leaves junk (a special id,
    finite flags set) in the host buffer and returns an event that puts the values there when
    the host waits on it, so a read that does not wait reads junk."""

    def __init__(self, max_batch: int, device: torch.device, junk_token: int) -> None:
        super().__init__(max_batch, device)
        self._junk = junk_token
        self.started = 0

    def start(self, argmax: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host, _ = super().start(argmax, logits)  # on the CPU: copied at once
        values = host.clone()
        host[0].fill_(self._junk)
        self.started += 1
        return host, _Landing(host, values)


__all__ = ["JUNK", "LateReadback", "StaticDecodeGraphs", "StaticPrefillGraphs"]
