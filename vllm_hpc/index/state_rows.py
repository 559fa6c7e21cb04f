"""Which row of KV pages a new Gated DeltaNet state takes (§5.4; beyond the spec).

States and KV pages share the device page space (`DevicePagePool`): a state is one row of
``row_pages`` consecutive pages. A row can become a state when each of its pages is free or a
cached page nothing holds (an entry of the device LRU); those entries are evicted first. The
choice is a pure decision, like `DeviceSnapshotSlots.replacement`: the store evicts, then takes
it. Which row is `eviction_order.kv_row_key`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hpc.index.device_lru import DeviceLRU, LruEntry
from vllm_hpc.index.device_pool import DevicePagePool, PageState
from vllm_hpc.index.eviction_order import kv_row_key
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import PageId, RowId


@dataclass(frozen=True, slots=True)
class RowChoice:
    row: RowId
    evict: tuple[LruEntry, ...]
    """The row's cached pages' owners, to evict before the row is taken."""
    unbacked: int
    """How many of them have no host copy: evicting those loses their blocks (§9.4)."""
    newest: int
    """The LRU position of the last of them to go (-1 for none): the rank the choice minimises."""


def choose_kv_row(
    pool: DevicePagePool,
    lru: DeviceLRU,
    protected: frozenset[PageId] = frozenset(),
    lossless_only: bool = False,
) -> RowChoice | None:
    """The KV row a new state should take by `kv_row_key`, or None when every row holds
    something in use.

    ``protected`` pages stay (an admission's own source); ``lossless_only`` skips rows with an
    unbacked page. O(rows) while a whole-free row exists (the key's first, highest first), else
    O(rows + LRU) on the pages of the rows that are entirely free or cached."""
    for row in pool.whole_free_rows():
        return RowChoice(row, (), 0, -1)
    k = pool.row_pages
    rows = [
        RowId(r)
        for r in range(pool.num_rows)
        if pool.row_free(RowId(r)) + pool.row_cached(RowId(r)) == k
    ]
    if not rows:
        return None
    ranks = {_page(entry): (rank, entry) for rank, entry in enumerate(lru.order())}
    choices = (_evictable(pool, lru, ranks, row, protected) for row in rows)
    return min(
        (c for c in choices if c is not None and not (lossless_only and c.unbacked)),
        key=lambda c: kv_row_key(c.newest, c.row),
        default=None,
    )


def _evictable(
    pool: DevicePagePool,
    lru: DeviceLRU,
    ranks: dict[PageId, tuple[int, LruEntry]],
    row: RowId,
    protected: frozenset[PageId],
) -> RowChoice | None:
    evict: list[LruEntry] = []
    unbacked = 0
    newest = -1
    for page in pool.row_range(row):
        if pool.state(PageId(page)) is not PageState.CACHED:
            continue
        ranked = ranks.get(PageId(page))
        if ranked is None or page in protected:
            return None
        rank, entry = ranked
        evict.append(entry)
        unbacked += not lru.is_backed(entry)
        newest = max(newest, rank)
    return RowChoice(row, tuple(evict), unbacked, newest)


def _page(entry: LruEntry) -> PageId:
    page = entry.tail_page if isinstance(entry, Snapshot) else entry.device_page
    assert page is not None, "an LRU entry owns a device page"
    return page
