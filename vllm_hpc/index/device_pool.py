"""Accounting of device pages by integer id (§5.4); the index never touches their memory.

Each page is in exactly one state (§10.1). Ids run from ``first_id`` so the vLLM binding can keep
id 0 for its null block.

KV pages and Gated DeltaNet states share the page space: the first ``num_rows * row_pages`` pages
form *rows* of ``row_pages`` consecutive pages, and a row is either KV pages or one state (a
running request's or a snapshot's, `StateRows`). A state row's pages are STATE; pages past the
last whole row are only ever KV. KV pages are handed out lowest id first, so free pages gather in
the high rows, where a state can take a whole row without evicting anything.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from enum import IntEnum

from vllm_hpc.index.types import PageId, RowId


class PageState(IntEnum):
    FREE = 0
    ACTIVE = 1
    """Owned by one sequence, private."""
    CACHED = 2
    """Owned by a tree node or a snapshot tail."""
    FILLING = 3
    """Destination of an in-flight restore, owned by the node or tail it fills."""
    STATE = 4
    """Part of a row that holds a state (`StateRows`): not a KV page now."""


class DevicePagePool:
    """Page ids ``first_id .. first_id + capacity - 1``, lowest free id first, grouped in rows."""

    def __init__(self, capacity: int, first_id: int = 0, row_pages: int = 0) -> None:
        if capacity <= 0 or first_id < 0 or row_pages < 0:
            raise ValueError(
                f"need capacity > 0, first_id >= 0 and row_pages >= 0, got "
                f"{capacity}, {first_id}, {row_pages}"
            )
        self.capacity = capacity
        self.first_id = first_id
        self.row_pages = row_pages
        self.num_rows = capacity // row_pages if row_pages else 0
        self._states = bytearray(capacity)
        self._heap = [PageId(p) for p in range(first_id, first_id + capacity)]
        """Min-heap of free ids; a page leaves it only when popped (``_in_heap`` says which)."""
        self._in_heap = bytearray(b"\x01" * capacity)
        self._num_free = capacity
        self._row_free = [row_pages] * self.num_rows
        """FREE pages per row: a row is whole-free at ``row_pages``."""
        self._row_cached = [0] * self.num_rows
        """CACHED pages per row: with the free ones, what a state could take by evicting."""

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def free_pages(self) -> list[PageId]:
        return self.pages_in(PageState.FREE)

    def contains(self, page: int) -> bool:
        return self.first_id <= page < self.first_id + self.capacity

    def state(self, page: PageId) -> PageState:
        if not self.contains(page):
            raise ValueError(f"page {page} is outside the pool's id range")
        return PageState(self._states[page - self.first_id])

    def pages_in(self, state: PageState) -> list[PageId]:
        base = self.first_id
        return [PageId(base + i) for i, s in enumerate(self._states) if s == state]

    def allocate(self, count: int, state: PageState) -> list[PageId]:
        """Pop the ``count`` lowest free pages into ``state``; the caller has made room first."""
        assert state not in (PageState.FREE, PageState.STATE), f"allocate as {state.name}"
        assert count <= self._num_free, "allocation without room"
        pages: list[PageId] = []
        while len(pages) < count:
            page = heapq.heappop(self._heap)
            self._in_heap[page - self.first_id] = 0
            if self._states[page - self.first_id] == PageState.FREE:
                self._set(page, state)
                pages.append(page)
        return pages

    def set_state(self, page: PageId, expected: PageState, state: PageState) -> None:
        assert state not in (PageState.FREE, PageState.STATE), "use free() or take_row()"
        index = page - self.first_id
        assert self._states[index] == expected, f"page {page} is {PageState(self._states[index])}"
        self._set(page, state)

    def free(self, pages: Iterable[PageId]) -> None:
        for page in pages:
            index = page - self.first_id
            state = self._states[index]
            assert state not in (PageState.FREE, PageState.STATE), f"page {page} freed as {state}"
            self._release(page)

    # -- rows -------------------------------------------------------------------------------

    def row_range(self, row: RowId) -> range:
        start = self.first_id + row * self.row_pages
        return range(start, start + self.row_pages)

    def row_free(self, row: RowId) -> int:
        return self._row_free[row]

    def row_cached(self, row: RowId) -> int:
        return self._row_cached[row]

    def whole_free_rows(self) -> Iterator[RowId]:
        """Rows all of whose pages are free, highest first."""
        k = self.row_pages
        return (RowId(r) for r in range(self.num_rows - 1, -1, -1) if self._row_free[r] == k)

    def take_row(self, row: RowId) -> None:
        """Every page of ``row`` (all free) becomes part of a state."""
        for page in self.row_range(row):
            assert self._states[page - self.first_id] == PageState.FREE, f"page {page} in use"
            self._set(PageId(page), PageState.STATE)

    def give_row(self, row: RowId) -> None:
        """A state row's pages become free KV pages."""
        for page in self.row_range(row):
            assert self._states[page - self.first_id] == PageState.STATE, f"page {page} no state"
            self._release(PageId(page))

    # -- the one place a page changes state -------------------------------------------------

    def _set(self, page: PageId, state: PageState) -> None:
        index = page - self.first_id
        old = self._states[index]
        self._states[index] = state
        self._num_free += (state == PageState.FREE) - (old == PageState.FREE)
        row = index // self.row_pages if self.row_pages else self.num_rows
        if row < self.num_rows:
            self._row_free[row] += (state == PageState.FREE) - (old == PageState.FREE)
            self._row_cached[row] += (state == PageState.CACHED) - (old == PageState.CACHED)

    def _release(self, page: PageId) -> None:
        self._set(page, PageState.FREE)
        index = page - self.first_id
        if not self._in_heap[index]:
            self._in_heap[index] = 1
            heapq.heappush(self._heap, page)
