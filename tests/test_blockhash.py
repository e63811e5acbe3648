"""Block names (common.kv.blockhash) go on the wire and are compared across daemons: pinned to fixed
vectors, and the fast packing/hashing path checked against the plain definition (array.array
packing, one BLAKE2b per block) on random prompts; LazyNames reads like the list it stands for,
however much of it is computed."""

from __future__ import annotations

import array
import hashlib
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv.blockhash import LazyNames, block_names, hash_seed

SEED = hash_seed(model="m", dtype="float32", block_size=16, layout={"num_layers": 2})
INT64 = st.integers(-(2**63), 2**63 - 1)


def _reference(tokens: list[int], block_size: int, seed: bytes) -> list[bytes]:
    """The definition: block i = BLAKE2b-128(person "pdkv-block"; name i-1 || its ids as
    little-endian int64), name -1 the seed."""
    full = len(tokens) // block_size
    packed = array.array("q", tokens[: full * block_size])
    if sys.byteorder != "little":
        packed.byteswap()
    ids = packed.tobytes()
    names, parent = [], seed
    for i in range(full):
        chunk = ids[i * block_size * 8 : (i + 1) * block_size * 8]
        parent = hashlib.blake2b(parent + chunk, digest_size=16, person=b"pdkv-block").digest()
        names.append(parent)
    return names


def test_fixed_vectors() -> None:
    assert SEED.hex() == "b8be29b465467b9a1b412687b4975475"
    rng = random.Random(1234)
    tokens = [rng.randrange(32000) for _ in range(40)]
    assert [n.hex() for n in block_names(tokens, 16, SEED)] == [
        "e3d0e80363f930893b5a84cc0e991c82",
        "3f5321b07aced08fadcf4313609e5d4d",
    ]
    assert [n.hex() for n in block_names(list(range(-2, 6)), 4, SEED)] == [
        "4b2638a303f5f411a835a6dd7e8e39ae",
        "5ad36bf3034e4f7b816150e5746d317a",
    ]


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(INT64, max_size=200) | st.lists(st.integers(0, 40), max_size=200),
    block_size=st.integers(1, 20),
    seed=st.binary(min_size=16, max_size=16),
)
def test_block_names_match_the_definition(tokens: list[int], block_size: int, seed: bytes) -> None:
    ref = _reference(tokens, block_size, seed)
    assert block_names(tokens, block_size, seed) == ref
    assert block_names(tuple(tokens), block_size, seed) == ref
    assert list(LazyNames(tokens, block_size, seed)) == ref


@pytest.mark.parametrize(
    ("bad", "error"), [(2**63, OverflowError), (-(2**63) - 1, OverflowError), (1.0, TypeError)]
)
def test_an_id_int64_cannot_hold_raises_what_array_raises(bad: object, error: type) -> None:
    with pytest.raises(error):
        block_names([1, 2, 3, bad], 4, SEED)
    assert block_names([1, 2, 3, bad], 8, SEED) == []  # not in a full block: never packed
    assert block_names([1, 2, 3, True], 4, SEED) == block_names([1, 2, 3, 1], 4, SEED)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 12 * 4 + 3),
    known=st.integers(0, 12),
    index=st.integers(-14, 14),
    start=st.none() | st.integers(-14, 14),
    stop=st.none() | st.integers(-14, 14),
    step=st.none() | st.integers(-3, 3).filter(bool),
)
def test_lazy_names_index_like_the_list(
    n: int, known: int, index: int, start: int | None, stop: int | None, step: int | None
) -> None:
    """With `known` names computed beforehand (a lookup's run), [i] and [a:b:c] are the list's,
    IndexError where the list's is."""
    tokens = list(range(100, 100 + n))
    ref = block_names(tokens, 4, SEED)
    lazy = LazyNames(tokens, 4, SEED)
    lazy[:known]
    assert lazy.computed == min(known, len(ref))
    assert lazy[start:stop:step] == ref[start:stop:step]
    if -len(ref) <= index < len(ref):
        assert lazy[index] == ref[index]
    else:
        with pytest.raises(IndexError):
            lazy[index]
    assert list(lazy) == ref and len(lazy) == len(ref)
