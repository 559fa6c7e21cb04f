"""HostSlabPool accounting (§5.4, §13.1 'HostSlabPool')."""

from __future__ import annotations

import pytest

from tests.index.harness import BLOCK, Harness, make_index, toks
from vllm_hpc.index import HostGeometry, HostSlabPool, SlabId
from vllm_hpc.index.host_pool import CHUNK_LIMIT_BYTES, SlabUse

MIB = 1 << 20


def test_slab_size_and_image_split() -> None:
    geometry = HostGeometry(block_bytes=2 * MIB + 100, image_bytes=187 * MIB)
    assert geometry.slab_bytes == 2 * MIB + 4096  # rounded up to 4 KiB
    # ceil(187 MiB / (2 MiB + 4 KiB)) = ceil(93.32) = 94 slabs
    assert geometry.image_slabs == 94
    assert geometry.snapshot_slabs(has_tail=True) == 95


def test_budget_zero_disables_the_tier() -> None:
    pool = HostSlabPool(0, HostGeometry(4096, 8192))
    assert not pool.enabled and pool.capacity == 0
    assert pool.allocate(1, SlabUse.NODE) is None


def test_a_budget_below_one_snapshot_plus_one_block_is_rejected() -> None:
    geometry = HostGeometry(4096, 3 * 4096)  # snapshot with tail: 4 slabs, plus a block: 5
    with pytest.raises(ValueError, match="budget 16384 bytes"):
        HostSlabPool(4 * 4096, geometry)
    assert HostSlabPool(5 * 4096, geometry).capacity == 5


def test_exhaustion_and_reuse() -> None:
    pool = HostSlabPool(8 * 4096, HostGeometry(4096, 4096))
    first = pool.allocate(5, SlabUse.NODE)
    assert first == [0, 1, 2, 3, 4]
    assert pool.allocate(4, SlabUse.IMAGE) is None  # only 3 left: nothing taken
    assert pool.num_free == 3
    pool.free([SlabId(1), SlabId(3)])
    again = pool.allocate(4, SlabUse.IMAGE)
    assert again is not None and sorted(again) == [1, 3, 5, 6]  # reused, not contiguous
    assert pool.use(again[0]) is SlabUse.IMAGE
    with pytest.raises(AssertionError):
        pool.free([SlabId(2), SlabId(2)])


def test_take_claims_named_free_slabs_or_nothing() -> None:
    pool = HostSlabPool(8 * 4096, HostGeometry(4096, 4096))
    pool.take([SlabId(5), SlabId(2)], SlabUse.IMAGE)
    assert pool.use(SlabId(5)) is SlabUse.IMAGE and pool.num_in_use(SlabUse.IMAGE) == 2
    for bad in ([SlabId(2)], [SlabId(8)], [SlabId(1), SlabId(1)]):  # in use, beyond, twice
        with pytest.raises(ValueError):
            pool.take(bad, SlabUse.NODE)
    assert pool.num_free == 6 and pool.use(SlabId(1)) is SlabUse.FREE
    assert pool.allocate(6, SlabUse.NODE) == [0, 1, 3, 4, 6, 7]


@pytest.mark.parametrize("block_bytes", [MIB, 3 * MIB + 1, 1000 * MIB])
def test_chunks_hold_whole_slabs_and_never_exceed_4_gib(block_bytes: int) -> None:
    geometry = HostGeometry(block_bytes, block_bytes)
    budget = 9 * (1 << 30) + 12345
    pool = HostSlabPool(budget, geometry)
    slab = geometry.slab_bytes
    assert pool.capacity == budget // slab
    assert sum(pool.chunk_slabs) == pool.capacity
    assert all(count * slab <= CHUNK_LIMIT_BYTES for count in pool.chunk_slabs)
    for index in (0, pool.slabs_per_chunk - 1, pool.slabs_per_chunk, pool.capacity - 1):
        chunk, offset = pool.location(SlabId(index))
        assert chunk == pool.chunk_of(SlabId(index))
        assert offset + slab <= pool.chunk_slabs[chunk] * slab  # never crosses a chunk end


def test_snapshot_images_and_tails_take_whole_slabs_through_the_index() -> None:
    # image 9000 bytes = ceil(9000 / 4096) = 3 slabs; tail = 1 slab; blocks 1 slab each.
    h = Harness(make_index(host_slabs=32, image_bytes=9000))
    prompt = toks(1, 2 * BLOCK + 20)
    (tap,) = h.run(prompt, taps=[BLOCK + 7])
    assert tap is not None
    snapshot = tap.snapshot
    assert len(snapshot.image_slabs) == 3 and snapshot.tail_slab is not None
    store = h.index.store
    assert store.slabs.num_free == 32 - 3 - 1 - 2
    assert {store.slabs.use(s) for s in snapshot.image_slabs} == {SlabUse.IMAGE}
    assert store.slabs.use(snapshot.tail_slab) is SlabUse.TAIL


def test_a_freed_run_comes_back_ascending() -> None:
    """The free list is a stack; a run freed and taken again must not come back reversed, or
    an image written to it could not move as one byte range a plane."""
    pool = HostSlabPool(64 * 4096, HostGeometry(block_bytes=4096, image_bytes=8192))
    run = pool.allocate(8, SlabUse.NODE)
    assert run == sorted(run)
    pool.free(run)
    assert pool.allocate(8, SlabUse.NODE) == run
