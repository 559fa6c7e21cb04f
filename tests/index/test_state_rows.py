"""States sharing the device page space with KV pages (§5.4): rows, the order in which
KV and snapshots give way to running requests' states, and when a given-back row is KV again."""

from __future__ import annotations

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from vllm_hpc.index import PageId, RowId
from vllm_hpc.index.device_pool import DevicePagePool, PageState

ROW = 4
"""Pages per row in these tests (a 4,000-byte state over 1,000-byte pages)."""


def rows_index(pages: int, slots: int = 4, host_slabs: int = 0) -> Harness:
    return Harness(make_index(pages=pages, slots=slots, host_slabs=host_slabs, row_pages=ROW))


def test_kv_pages_go_lowest_first_and_states_take_whole_free_rows_highest_first() -> None:
    pool = DevicePagePool(13, first_id=1, row_pages=ROW)  # rows of pages 1-4, 5-8, 9-12; 13 KV
    assert pool.num_rows == 3
    assert pool.allocate(2, PageState.ACTIVE) == [1, 2]
    assert list(pool.whole_free_rows()) == [2, 1]
    pool.take_row(RowId(2))
    assert [pool.state(PageId(p)) for p in range(9, 13)] == [PageState.STATE] * 4
    assert pool.num_free == 7 and pool.allocate(7, PageState.ACTIVE) == [3, 4, 5, 6, 7, 8, 13]
    pool.give_row(RowId(2))
    assert pool.allocate(1, PageState.ACTIVE) == [9]
    assert pool.row_free(RowId(2)) == 3 and pool.row_cached(RowId(2)) == 0


def test_the_scratch_row_is_never_a_kv_page() -> None:
    h = rows_index(pages=12)
    store = h.index.store
    assert [store.pages.state(PageId(p)) for p in range(1, 5)] == [PageState.STATE] * 4
    assert store.usable_pages == 8 and h.index.available_pages == 8


def test_a_state_takes_a_free_row_before_evicting_anything() -> None:
    h = rows_index(pages=24)
    h.run(toks(1, 4 * BLOCK + 1))  # 4 cached pages, the lowest
    row = h.index.take_state_row()
    assert row == 5  # the highest row, all free
    assert h.index.stats.device_evictions_unbacked == 0
    h.index.release_state_row(row)
    assert store_state(h, row) == PageState.STATE  # the plan being built may still copy it
    h.index.plan_taken()
    assert store_state(h, row) == PageState.FREE
    h.check()


def test_without_a_free_row_the_row_the_lru_would_empty_first_goes() -> None:
    h = rows_index(pages=12)  # rows 1 and 2 (pages 5-12) for KV or states
    old, new = toks(2, 4 * BLOCK + 1), toks(3, 4 * BLOCK + 1)
    h.run(old)  # pages 5-8
    h.run(new)  # pages 9-12, used after old's
    row = h.index.take_state_row()
    assert row == 1  # old's pages: the LRU evicts them first
    assert h.index.match(h.index.prepare_prompt(new)).matched_tokens == 4 * BLOCK
    assert h.index.match(h.index.prepare_prompt(old)).matched_tokens == 0
    h.check()


def test_a_row_holding_a_page_of_a_running_request_is_never_taken() -> None:
    h = rows_index(pages=16)  # rows 1-3 (pages 5-16)
    running = h.admit(toks(4, 4 * BLOCK))
    h.commit(running.lease, toks(4, 4 * BLOCK))  # pages 5-8, held by the lease
    h.run(toks(5, 4 * BLOCK))  # pages 9-12, cached
    assert h.index.take_state_row() == 3  # free
    assert h.index.take_state_row() == 2  # cached pages, evicted
    assert h.index.take_state_row() is None  # only the running request's row is left
    h.check()


def test_running_requests_take_snapshot_rows_superseded_before_live() -> None:
    h = rows_index(pages=32, slots=4, host_slabs=64)
    prompt = toks(6, 3 * BLOCK + 5)
    s64, s128, s192 = map(snap, h.run(prompt, taps=[BLOCK, 2 * BLOCK, 3 * BLOCK]))
    assert s64.superseded and s128.superseded and not s192.superseded
    lost: list[object] = []
    while h.index.take_state_row() is not None:
        lost.extend(s for s in (s64, s128, s192) if s.slot is None and s not in lost)
    assert lost == [s64, s128, s192]  # oldest supersession first, the live one last
    h.check()


def test_kv_pages_take_snapshot_rows_once_the_lru_is_empty() -> None:
    h = rows_index(pages=16, slots=2)
    (tap,) = map(snap, h.run(toks(7, 2 * BLOCK + 1), taps=[2 * BLOCK]))
    assert tap.slot is not None
    h.index.plan_taken()  # its capture copy went out with that plan
    pages = h.index.allocate_pages(h.index.available_pages)
    assert pages is not None and len(pages) == 12  # every page beside the scratch row
    assert tap not in h.index.store.snapshots  # device-only: its row became KV pages
    h.index.free_pages(pages)
    h.check()


def test_kv_pages_take_a_superseded_snapshots_row_before_an_unbacked_page() -> None:
    h = rows_index(pages=32, slots=4)
    prompt = toks(9, 3 * BLOCK + 5)
    s64, s128, s192 = map(snap, h.run(prompt, taps=[BLOCK, 2 * BLOCK, 3 * BLOCK]))
    assert s64.superseded and s128.superseded
    h.index.plan_taken()
    pages = h.index.allocate_pages(h.index.store.pages.num_free + 1)
    assert pages is not None
    assert s64.slot is None and s128.slot is not None and s192.slot is not None
    assert h.index.stats.device_evictions_unbacked == 0  # the prompt's pages all stay
    assert h.index.match(h.index.prepare_prompt(prompt)).matched_tokens == 3 * BLOCK
    h.index.free_pages(pages)
    h.check()


def test_superseded_snapshots_giving_way_leave_l_unchanged() -> None:
    # Only a value victim raises L (§9.3). Without a host tier the superseded taps are
    # device-only, yet losing one to KV pages or to a running request's state is no value
    # eviction, as losing its slot to a new snapshot is none (§9.2).
    h = rows_index(pages=32, slots=4)
    s64, s128, _ = map(snap, h.run(toks(10, 3 * BLOCK + 5), taps=[BLOCK, 2 * BLOCK, 3 * BLOCK]))
    assert s64.superseded and s128.superseded and s64.priority > 0.0
    h.index.plan_taken()
    pages = h.index.allocate_pages(h.index.store.pages.num_free + 1)
    assert pages is not None and s64 not in h.index.store.snapshots
    assert h.index.store.value.inflation == 0.0
    assert h.index.take_state_row() is not None and s128 not in h.index.store.snapshots
    assert h.index.store.value.inflation == 0.0
    h.index.free_pages(pages)
    h.check()


def test_a_snapshot_published_in_the_plan_being_built_keeps_its_row_from_kv() -> None:
    h = rows_index(pages=16, slots=2)
    (tap,) = map(snap, h.run(toks(8, 2 * BLOCK + 1), taps=[2 * BLOCK]))
    # Not yet handed out: the capture copy into its row may still run, so KV cannot have it.
    assert h.index.available_pages == 12 - ROW
    assert h.index.allocate_pages(12) is None
    h.index.plan_taken()
    assert h.index.available_pages == 12
    assert tap in h.index.store.snapshots
    h.check()


def test_a_row_given_back_serves_a_new_state_at_once() -> None:
    h = rows_index(pages=12)
    first = h.index.take_state_row()
    second = h.index.take_state_row()
    assert first is not None and second is not None
    h.index.release_state_row(first)
    assert h.index.take_state_row() == first  # state to state: copies stay ordered in a plan
    h.check()


def store_state(h: Harness, row: RowId) -> PageState:
    pages = h.index.store.pages
    (state,) = {pages.state(PageId(p)) for p in pages.row_range(row)}
    return state
