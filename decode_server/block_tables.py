"""The decode batch's block tables, kept from step to step instead of rebuilt.

A sequence reserves the blocks of its whole life at its HANDOFF (sequence.blocks_needed) and
never changes them, so a row of the table changes only when another sequence takes that row:
one joined before it, or one before it left. Each step rewrites the rows from the first whose
sequence is not the one it held at the last step; a step of the same batch rewrites none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import numpy as np


class HasBlocks(Protocol):
    blocks: list[int]


class BlockTables:
    """One int64 array [rows, width], zero past each row's blocks. Torch thread only."""

    __slots__ = ("_grid", "_rows", "rewritten")

    def __init__(self) -> None:
        self._grid = np.zeros((0, 0), dtype=np.int64)
        self._rows: list[HasBlocks] = []  # the sequence each row holds, as of the last update
        self.rewritten = 0  # rows written since start (what the reuse saves shows against steps)

    def update(self, batch: Seq[HasBlocks]) -> np.ndarray:
        """The tables of `batch` in its order: a view [len(batch), widest] of the kept array,
        valid until the next update."""
        n = len(batch)
        width = max((len(s.blocks) for s in batch), default=0)
        grid, rows = self._grid, self._rows
        start = 0
        if grid.shape[0] < n or grid.shape[1] < width:
            grid = self._grid = np.zeros(
                (max(n, grid.shape[0]), max(width, grid.shape[1])), np.int64
            )
            rows = self._rows = []
        limit = min(n, len(rows))
        while start < limit and rows[start] is batch[start]:
            start += 1
        for i in range(start, n):
            blocks = batch[i].blocks
            row = grid[i]
            row[: len(blocks)] = blocks
            row[len(blocks) :] = 0
        self.rewritten += n - start
        self._rows = list(batch)
        return grid[:n, :width]


__all__ = ["BlockTables"]
