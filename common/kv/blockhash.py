"""Names of full KV blocks for the prefix cache: a hash chained over the block's token ids and its
parent block's name, seeded with everything the KV depends on besides the tokens.

Block i of a prompt is named H(name of block i-1, tokens of block i), block 0's parent being the
seed H(model fingerprint, dtype, block size, pool layout). So a name covers the tokens, their
positions (the whole chain before them) and the model, dtype and block geometry: two blocks with
one name hold the same KV. Only full blocks are named; a partial block is never shared.

BLAKE2b with a 16-byte digest: a collision by chance is ~2**-64 per pair at a billion blocks, and
nothing here trusts names from elsewhere (a peer's names are only ever compared with ours).
"""

from __future__ import annotations

import array
import hashlib
import json
import struct
from collections.abc import Iterator, Sequence
from typing import Any

NAME_BYTES = 16
_BLOCK = hashlib.blake2b(digest_size=NAME_BYTES, person=b"pdkv-block")  # copied per block


def hash_seed(*, model: str, dtype: str, block_size: int, layout: dict[str, Any]) -> bytes:
    """The root of every chain: the model's fingerprint, the KV dtype, the block size and the rest
    of the pool's block layout (num_blocks is left out: it does not change a block's KV)."""
    shape = {k: v for k, v in sorted(layout.items()) if k != "num_blocks"}
    canon = json.dumps(
        {"model": model, "dtype": dtype, "block_size": block_size, "layout": shape},
        sort_keys=True,
    )
    return hashlib.blake2b(canon.encode(), digest_size=NAME_BYTES, person=b"pdkv-seed").digest()


def block_names(tokens: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """Names of the full blocks of `tokens` in order (len(tokens) // block_size of them).

    On every prompt's way to its forward (both daemons), so kept cheap: the ids packed once as
    little-endian int64, each block's hash a copy of one keyed-up BLAKE2b state (no per-block
    parameter parsing): ~0.5 µs a block."""
    full = len(tokens) // block_size
    if not full:
        return []
    return _chain(_pack(tokens[: full * block_size]), block_size * 8, seed)


def _pack(tokens: Sequence[int]) -> bytes:
    """The token ids as little-endian int64s ("<": whatever the host's byte order): the bytes a
    block's name hashes.

    struct packs a list ~2-3x faster than array.array did; an id it cannot pack raises what
    array.array raised (TypeError, OverflowError), as block_names always did."""
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error:
        array.array("q", tokens)  # the same check, raising its own error
        raise


def _chain(ids: bytes, step: int, parent: bytes) -> list[bytes]:
    """Names of the consecutive `step`-byte blocks of `ids`, block i's = H(name i-1, its bytes),
    name -1 being `parent`. The hot loop (~0.5 µs a block, mostly the four BLAKE2b calls), so
    the bound methods are local."""
    copy = _BLOCK.copy
    names: list[bytes] = []
    append = names.append
    for start in range(0, len(ids), step):
        h = copy()
        h.update(parent)
        h.update(ids[start : start + step])
        parent = h.digest()
        append(parent)
    return names


class LazyNames(Sequence[bytes]):
    """`block_names(tokens, block_size, seed)`, computed only as far as they are read.

    A prompt's lookup reads names from the first until one is not cached, so a prompt that shares
    nothing costs one hash, not one per block; the rest are computed when read (`fill`, or
    publishing), e.g. while the prompt's forward runs instead of before it."""

    def __init__(self, tokens: Sequence[int], block_size: int, seed: bytes) -> None:
        self._tokens, self._block_size = tokens, block_size
        self._full = len(tokens) // block_size
        self._done: list[bytes] = []
        self._parent = seed

    def __len__(self) -> int:
        return self._full

    def _upto(self, n: int) -> None:
        """Compute names until `n` of them are known."""
        n = min(n, self._full)
        if n <= len(self._done):
            return
        bs, start = self._block_size, len(self._done)
        more = _chain(_pack(self._tokens[start * bs : n * bs]), bs * 8, self._parent)
        self._done.extend(more)
        self._parent = more[-1]

    def __getitem__(self, index):  # type: ignore[no-untyped-def,override]
        # by position in the whole prompt, never relative to the names known so far: with 4 of
        # 5 known, [-2] is the 4th name and [1:-1] three of them
        if isinstance(index, slice):
            wanted = range(self._full)[index]
            self._upto(max(wanted[0], wanted[-1]) + 1 if wanted else 0)
            return list(map(self._done.__getitem__, wanted))
        i = range(self._full)[index]  # IndexError out of range, as a list's
        self._upto(i + 1)
        return self._done[i]

    def __iter__(self) -> Iterator[bytes]:
        i = 0
        while i < self._full:
            self._upto(2 * i + 1)  # doubling: a long hit costs O(log n) calls, not n
            known = self._done[i:]  # a copy: a reader may compute more meanwhile
            yield from known
            i += len(known)

    @property
    def computed(self) -> int:
        """How many names have been computed so far."""
        return len(self._done)

    def fill(self) -> None:
        """Compute every name now."""
        self._upto(self._full)


__all__ = ["NAME_BYTES", "LazyNames", "block_names", "hash_seed"]
