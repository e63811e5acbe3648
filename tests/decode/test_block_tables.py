"""BlockTables: a step's tables equal the ones built from scratch, and only rows whose sequence
changed since the last step are written."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from decode_server.block_tables import BlockTables


@dataclass(eq=False)
class S:
    blocks: list[int]


def _fresh(batch: list[S]) -> np.ndarray:
    width = max(len(s.blocks) for s in batch)
    out = np.zeros((len(batch), width), np.int64)
    for i, s in enumerate(batch):
        out[i, : len(s.blocks)] = s.blocks
    return out


def test_rows_are_rewritten_only_from_the_first_change() -> None:
    t = BlockTables()
    a, b, c, d = S([1, 2, 3]), S([4]), S([5, 6]), S([7, 8, 9, 10, 11])
    steps = [
        ([a, b, c], 3),  # all new
        ([a, b, c], 0),  # the same batch: nothing written
        ([a, c], 1),  # b left: c moves up
        ([c, d], 2),
        ([c, d, b], 1),
        ([c], 0),
    ]
    for batch, written in steps[:3]:
        before = t.rewritten
        assert np.array_equal(t.update(batch), _fresh(batch))
        assert t.rewritten - before == written, batch
    before = t.rewritten
    assert np.array_equal(t.update([a, c, d]), _fresh([a, c, d]))
    assert t.rewritten - before == 3  # the array grew: every row again
    for batch, written in steps[3:]:
        before = t.rewritten
        assert np.array_equal(t.update(batch), _fresh(batch))
        assert t.rewritten - before == written, batch
