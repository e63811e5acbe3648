"""PoolLayout wire form and validation; KVPool creation, views and the block pull."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from common.errors import IpcError, PdkvError
from common.ipc.shm import is_shm
from common.kv.pool import KVPool, PoolLayout


def layout(**overrides: object) -> PoolLayout:
    fields = dict(
        num_blocks=32, num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32"
    )
    fields.update(overrides)
    return PoolLayout(**fields)  # type: ignore[arg-type]


def numbered(pool: KVPool, offset: float = 0.0) -> KVPool:
    """Fill block b with the value b + offset everywhere (exact in bf16 for small b)."""
    ids = torch.arange(pool.num_blocks, dtype=pool.tensor.dtype) + offset
    pool.tensor.copy_(ids.view(-1, 1, 1, 1, 1, 1).expand_as(pool.tensor))
    return pool


def block_values(pool: KVPool) -> list[float]:
    """The value of each block, asserting each block is uniform."""
    flat = pool.tensor.reshape(pool.num_blocks, -1).float()
    assert torch.equal(flat.min(dim=1).values, flat.max(dim=1).values)
    return flat[:, 0].tolist()


def test_layout_geometry() -> None:
    lay = layout(dtype="bfloat16")
    assert lay.block_shape == (2, 2, 4, 2, 4)
    assert lay.shape == (32, 2, 2, 4, 2, 4)
    assert lay.torch_dtype is torch.bfloat16
    assert lay.block_nbytes == 2 * 2 * 4 * 2 * 4 * 2
    assert lay.nbytes == 32 * lay.block_nbytes


def test_layout_wire_round_trip_through_json() -> None:
    lay = layout(dtype="bfloat16")
    wire = msgspec.json.decode(msgspec.json.encode(lay.to_wire()))
    assert PoolLayout.from_wire(wire) == lay
    assert lay.compat_fields() == {k: v for k, v in wire.items() if k != "num_blocks"}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_blocks", 0, "num_blocks must be a positive int, got 0"),
        ("head_dim", -4, "head_dim must be a positive int"),
        ("block_size", 16.0, "block_size must be a positive int, got 16.0"),
        ("num_layers", True, "num_layers must be a positive int"),
        ("dtype", "float64", "unknown dtype 'float64'; supported"),
        ("dtype", torch.float32, "dtype must be a wire name str"),
    ],
)
def test_layout_rejects_bad_fields(field: str, value: object, message: str) -> None:
    wire = layout().to_wire()
    wire[field] = value
    with pytest.raises(PdkvError, match=message):
        PoolLayout.from_wire(wire)


def test_layout_from_wire_names_missing_and_unknown_fields() -> None:
    wire = layout().to_wire()
    del wire["head_dim"]
    wire["heads"] = 2
    with pytest.raises(IpcError, match=r"missing \['head_dim'\], unknown \['heads'\]"):
        PoolLayout.from_wire(wire)
    with pytest.raises(IpcError, match="must be a JSON object, got list"):
        PoolLayout.from_wire([1, 2])


def test_create_on_cpu_is_shared_zeroed_and_block_major() -> None:
    lay = layout(dtype="bfloat16")
    pool = KVPool.create(lay)
    assert is_shm(pool.tensor)
    assert pool.tensor.shape == lay.shape and pool.tensor.dtype is torch.bfloat16
    assert pool.tensor.is_contiguous() and not pool.tensor.any()
    base = pool.tensor.data_ptr()
    for b in (0, 5, 31):  # one block's K and V for all layers: one contiguous byte range
        view = pool.block_view(b)
        assert view.is_contiguous() and view.shape == lay.block_shape
        assert view.data_ptr() - base == b * lay.block_nbytes
        assert view.numel() * view.element_size() == lay.block_nbytes
    assert pool.fingerprint_fields() == lay.compat_fields()


def test_pool_refuses_a_tensor_that_does_not_match_its_layout() -> None:
    lay = layout()
    with pytest.raises(IpcError, match=r"layout needs \(32, 2, 2, 4, 2, 4\) torch.float32"):
        KVPool(lay, torch.zeros(lay.shape, dtype=torch.float16))
    with pytest.raises(IpcError, match="layout needs"):
        KVPool(lay, torch.zeros((31, *lay.block_shape)))
    odd = torch.zeros((lay.shape[1], lay.shape[0], *lay.shape[2:])).transpose(0, 1)
    with pytest.raises(IpcError, match="must be contiguous"):
        KVPool(lay, odd)


def test_block_view_writes_through_and_refuses_scattered_ids() -> None:
    pool = KVPool.create(layout())
    pool.block_view([3, 4, 5]).fill_(7)
    pool.block_view(9).fill_(1)
    assert block_values(pool)[2:10] == [0, 7, 7, 7, 0, 0, 0, 1]
    with pytest.raises(IpcError, match=r"\[1, 3\] are not one run.*gather"):
        pool.block_view([1, 3])
    with pytest.raises(IpcError, match=r"block ids \[32\] out of range \[0, 32\)"):
        pool.block_view(32)
    numbered(pool)
    assert pool.gather([9, 2, 30]).reshape(3, -1)[:, 0].tolist() == [9, 2, 30]


def test_words_view_the_start_of_one_block_and_refuse_what_it_cannot_hold() -> None:
    pool = KVPool.create(layout())  # blocks of 2*2*4*2*4 fp32 = 512 bytes: 64 words
    assert pool.words(5, 3).shape == (3,)  # the first 3 words
    words = pool.words(5, 64)
    assert words.dtype == torch.int64 and words.shape == (64,)
    words.fill_(-1)  # all ones in every byte: only block 5 changes
    assert torch.isnan(pool.tensor[5]).all() and not torch.isnan(pool.tensor[[4, 6]]).any()
    with pytest.raises(IpcError, match="512 bytes cannot hold 65 int64 words"):
        pool.words(5, 65)
    with pytest.raises(IpcError, match=r"block ids \[32\] out of range"):
        pool.words(32, 1)


def _reference_pull(dst: list[float], src: list[float], s: list[int], d: list[int]) -> list[float]:
    out = list(dst)
    for i, j in zip(s, d, strict=True):
        out[j] = src[i]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim", [4, 256])  # small blocks → gather path for scattered ids
@pytest.mark.parametrize("pattern", ["one_run", "three_runs", "scattered", "empty", "tensor"])
def test_copy_blocks_from_matches_per_block_reference(
    dtype: str, head_dim: int, pattern: str
) -> None:
    rng = random.Random(f"{dtype}{head_dim}{pattern}")
    src = numbered(KVPool.create(layout(dtype=dtype, head_dim=head_dim)), offset=100)
    dst = numbered(KVPool.create(layout(dtype=dtype, head_dim=head_dim, num_blocks=48)))
    s_ids: list[int] = {
        "one_run": list(range(4, 20)),
        "three_runs": [*range(0, 4), *range(10, 14), *range(20, 28)],
        "scattered": rng.sample(range(32), 24),
        "empty": [],
        "tensor": rng.sample(range(32), 10),
    }[pattern]
    runs = pattern in ("one_run", "three_runs")
    d_ids = list(range(30, 30 + len(s_ids))) if runs else rng.sample(range(48), len(s_ids))
    # Both strategies are exercised: per-run slices up to the limit, gather + scatter beyond.
    # (scattered ids make ~24 runs; three_runs makes 3; large blocks raise the limit.)
    assert 3 <= dst._run_limit() < 20 and (dst._run_limit() > 4) == (head_dim == 256)
    expected = _reference_pull(block_values(dst), block_values(src), s_ids, d_ids)
    if pattern == "tensor":
        dst.copy_blocks_from(src, torch.tensor(s_ids, dtype=torch.int32), torch.tensor(d_ids))
    else:
        dst.copy_blocks_from(src, s_ids, d_ids)
    assert block_values(dst) == expected


def test_copy_within_one_pool_with_overlapping_runs() -> None:
    pool = numbered(KVPool.create(layout()))
    pool.copy_blocks_from(pool, [0, 1, 2, 3], [1, 2, 3, 4])
    assert block_values(pool)[:6] == [0, 0, 1, 2, 3, 5]


def test_copy_blocks_from_errors_are_clear() -> None:
    dst = KVPool.create(layout())
    src = KVPool.create(layout(num_blocks=8))
    with pytest.raises(IpcError, match=r"incompatible pools.*'head_dim': 8"):
        dst.copy_blocks_from(KVPool.create(layout(head_dim=8)), [0], [0])
    with pytest.raises(IpcError, match="incompatible pools"):
        dst.copy_blocks_from(KVPool.create(layout(dtype="float16")), [0], [0])
    with pytest.raises(IpcError, match=r"source block ids \[8\] out of range \[0, 8\)"):
        dst.copy_blocks_from(src, [1, 8], [0, 1])
    with pytest.raises(IpcError, match=r"destination block ids \[-1\] out of range"):
        dst.copy_blocks_from(src, [1], [-1])
    with pytest.raises(IpcError, match="2 source block ids but 1 destination"):
        dst.copy_blocks_from(src, [1, 2], [0])
    with pytest.raises(IpcError, match=r"destination block ids repeat: \[3, 3\]"):
        dst.copy_blocks_from(src, [1, 2], [3, 3])
    with pytest.raises(IpcError, match=r"must be integers, got torch\.float32"):
        dst.copy_blocks_from(src, torch.tensor([1.0]), [0])
    with pytest.raises(IpcError, match="must be ints"):
        dst.copy_blocks_from(src, ["a"], [0])  # type: ignore[list-item]
    assert not dst.tensor.any()  # nothing was copied by a refused pull


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA unavailable")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_pool_pull_matches_per_block_reference(dtype: str) -> None:
    rng = random.Random(dtype)
    src = numbered(KVPool.create(layout(dtype=dtype, head_dim=64), device="cuda"), offset=100)
    dst = numbered(KVPool.create(layout(dtype=dtype, head_dim=64, num_blocks=48), device="cuda"))
    assert src.device.type == "cuda" and not is_shm(src.tensor)
    s_ids, d_ids = rng.sample(range(32), 20), rng.sample(range(48), 20)
    expected = _reference_pull(block_values(dst), block_values(src), s_ids, d_ids)
    dst.copy_blocks_from(src, s_ids, d_ids)
    torch.cuda.synchronize()
    assert block_values(dst) == expected
    dst.copy_blocks_from(dst, [0, 1, 2], [1, 2, 3])  # within one pool, overlapping
    torch.cuda.synchronize()
    assert block_values(dst)[1:4] == expected[0:3]


@pytest.mark.parametrize("n", [5, 40], ids=["few-ids", "many-ids"])
def test_pull_between_two_pool_objects_over_the_same_memory_has_snapshot_semantics(n: int) -> None:
    """Found in review: runs copied one after another by memmove read blocks an earlier run had
    already overwritten when both pools view the same pages. Such a pull must read first."""
    layout = PoolLayout(
        num_blocks=2 * n + 2,
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        dtype="float32",
    )
    a = KVPool.create(layout)
    for i in range(layout.num_blocks):
        a.tensor[i].fill_(i)
    b = KVPool(layout, a.tensor.view(layout.shape))  # a second pool object, same memory
    src = [2 * i for i in range(n)]
    dst = [2 * i + 2 for i in range(n)]  # each destination is the next run's source
    b.copy_blocks_from(a, src, dst)
    assert [int(b.tensor[d].flatten()[0]) for d in dst] == src
