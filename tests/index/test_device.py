"""Device page pool and device LRU (§5.4, §9.1, §9.4, §13.1 'Device LRU')."""

from __future__ import annotations

import pytest

from tests.index.harness import BLOCK, Harness, make_index, toks
from vllm_hpc.index import PageId
from vllm_hpc.index.device_pool import DevicePagePool, PageState


def test_pool_uses_the_configured_id_range() -> None:
    pool = DevicePagePool(capacity=4, first_id=1)
    pages = pool.allocate(4, PageState.ACTIVE)
    assert sorted(pages) == [1, 2, 3, 4]
    assert pool.num_free == 0
    pool.free([PageId(3)])
    assert pool.allocate(1, PageState.CACHED) == [3]
    assert pool.state(PageId(3)) is PageState.CACHED
    with pytest.raises(ValueError, match="outside"):
        pool.state(PageId(0))


def test_allocation_returns_none_instead_of_raising_when_full() -> None:
    h = Harness(make_index(pages=4))
    grabbed = h.index.allocate_pages(4)
    assert grabbed is not None
    assert h.index.allocate_pages(1) is None
    h.index.free_pages(grabbed)
    with pytest.raises(ValueError, match="private"):
        h.index.free_pages(grabbed[:1])  # already free
    h.check()


def test_release_appends_deepest_block_first() -> None:
    h = Harness(make_index())
    prompt = toks(1, 3 * BLOCK)
    h.run(prompt)
    path = h.index.match(h.index.prepare_prompt([*prompt, 0])).path
    assert h.index.store.lru.order() == [path[2], path[1], path[0]]


def test_a_hit_moves_the_whole_path_to_mru() -> None:
    h = Harness(make_index())
    a, b = toks(2, 3 * BLOCK), toks(3, 3 * BLOCK)
    (tap,) = h.run(a, taps=[3 * BLOCK - 1])  # anchored on block 1, 63-token tail page
    h.run(b)
    assert tap is not None
    index = h.index
    a_path = index.match(index.prepare_prompt([*a, 0])).path
    b_path = index.match(index.prepare_prompt([*b, 0])).path
    tail = tap.snapshot
    # The tail page joined the LRU at publication, before a's release appended its blocks.
    assert index.store.lru.order() == [tail, *reversed(a_path), *reversed(b_path)]
    admission = h.admit([*a, 0])  # hit on the tap: pins blocks 0..1 and the tail until restored
    assert admission.frontier == 3 * BLOCK - 1
    h.commit(admission.lease, [*a, 0])
    h.finish(admission.lease)
    assert index.store.lru.order() == [*reversed(b_path), tail, *reversed(a_path)]


def test_backed_entries_are_consumed_before_older_unbacked_ones() -> None:
    # Host room for exactly three blocks (plus the minimum the budget check demands).
    h = Harness(make_index(pages=16, host_slabs=3))
    x, y = toks(4, 3 * BLOCK), toks(5, 3 * BLOCK)
    h.run(x)  # x's blocks are written through: backed, but dead KV (no snapshot)
    h.run(y)  # y's write sweeps x's dead host copies: x becomes unbacked, y backed
    index = h.index
    x_path = index.match(index.prepare_prompt([*x, 0])).path
    y_path = index.match(index.prepare_prompt([*y, 0])).path
    assert all(n.host_slab is None for n in x_path) and all(n.host_slab for n in y_path[1:])
    assert index.store.lru.order() == [y_path[2], y_path[1], y_path[0], *reversed(x_path)]
    free = index.store.pages.num_free
    grabbed = index.allocate_pages(free + 3)
    assert grabbed is not None
    assert all(n.device_page is None for n in y_path)  # backed: only the device copy went
    assert all(n.device_page is not None for n in x_path)
    assert index.stats.device_evictions_backed == 3 and index.stats.device_evictions_unbacked == 0
    index.free_pages(grabbed)
    h.check()


def test_held_entries_are_never_evicted() -> None:
    h = Harness(make_index(pages=12))
    prompt = toks(6, 4 * BLOCK)
    h.run(prompt, taps=[2 * BLOCK])
    admission = h.admit([*prompt, 0])  # holds blocks 0..1 (refs) while running
    assert admission.frontier == 2 * BLOCK
    held = admission.lease.path
    grabbed = h.index.allocate_pages(h.index.available_pages)
    assert grabbed is not None
    assert h.index.allocate_pages(1) is None
    assert all(n.device_page is not None for n in held)
    h.index.free_pages(grabbed)
    h.finish(admission.lease)


def test_unbacked_eviction_takes_the_deepest_block_and_its_snapshots() -> None:
    h = Harness(make_index(pages=32, slots=8))
    trunk = toks(7, 2 * BLOCK)
    left, right = trunk + toks(8, 2 * BLOCK), trunk + toks(9, 2 * BLOCK)
    h.run(left, taps=[BLOCK, 3 * BLOCK])
    h.run(right, taps=[3 * BLOCK])
    index = h.index
    l_path = index.match(index.prepare_prompt([*left, 0])).path
    assert index.store.lru.order()[:2] == [l_path[3], l_path[2]]
    assert index.store.make_device_room(index.store.pages.num_free + 1)
    assert l_path[3] not in index.store.lru and len(index.store.snapshots) == 3
    assert index.store.make_device_room(index.store.pages.num_free + 1)
    # Block 2 of the left branch lost its last copy: its snapshot (at 192) went with it.
    assert sorted(s.frontier for s in index.store.snapshots) == [BLOCK, 3 * BLOCK]
    assert len(index.match(index.prepare_prompt([*left, 0])).path) == 2
    assert len(index.match(index.prepare_prompt([*right, 0])).path) == 4
    assert index.stats.device_evictions_unbacked == 2
    h.check()


def test_losing_the_last_copy_deletes_exactly_the_subtree() -> None:
    """§9.4 on an interior node: every node below it and every snapshot anchored there go;
    the node above and its snapshot stay, and liveness counts follow."""
    h = Harness(make_index(pages=32, slots=8))
    trunk = toks(10, 2 * BLOCK)
    left, right = trunk + toks(11, 2 * BLOCK), trunk + toks(12, 2 * BLOCK)
    h.run(left, taps=[BLOCK, 2 * BLOCK, 3 * BLOCK + 5])
    h.run(right, taps=[3 * BLOCK])
    index = h.index
    t0, t1 = index.match(index.prepare_prompt([*left, 0])).path[:2]
    assert t0.live_snapshots_below == 4
    index.store.drop_node_device(t1)
    assert sorted(s.frontier for s in index.store.snapshots) == [BLOCK]
    assert t0.children is None and t0.live_snapshots_below == 1
    assert index.store.pages.num_free == index.store.pages.capacity - 1  # only t0's page
    assert index.stats.nodes_deleted == 5
    h.check()
