"""Accounting of device KV pages by integer id (§5.4); the index never touches their memory.

Each page is in exactly one state (§10.1). Ids run from ``first_id`` so the vLLM binding can keep
id 0 for its null block.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

from vllm_hpc.index.types import PageId


class PageState(IntEnum):
    FREE = 0
    ACTIVE = 1
    """Owned by one sequence, private."""
    CACHED = 2
    """Owned by a tree node or a snapshot tail."""
    FILLING = 3
    """Destination of an in-flight restore, owned by the node or tail it fills."""


class DevicePagePool:
    """Page ids ``first_id .. first_id + capacity - 1`` with an O(1) free stack."""

    def __init__(self, capacity: int, first_id: int = 0) -> None:
        if capacity <= 0 or first_id < 0:
            raise ValueError(f"need capacity > 0 and first_id >= 0, got {capacity}, {first_id}")
        self.capacity = capacity
        self.first_id = first_id
        self._states = bytearray(capacity)
        self._free = [PageId(p) for p in range(first_id + capacity - 1, first_id - 1, -1)]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> list[PageId]:
        return list(self._free)

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
        """Pop ``count`` free pages into ``state``; the caller has made room first."""
        assert state is not PageState.FREE and count <= len(self._free), "allocation without room"
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._states[page - self.first_id] = state
        return pages

    def set_state(self, page: PageId, expected: PageState, state: PageState) -> None:
        assert state is not PageState.FREE, "use free() to free a page"
        index = page - self.first_id
        assert self._states[index] == expected, f"page {page} is {PageState(self._states[index])}"
        self._states[index] = state

    def free(self, pages: Iterable[PageId]) -> None:
        for page in pages:
            index = page - self.first_id
            assert self._states[index] != PageState.FREE, f"page {page} freed twice"
            self._states[index] = PageState.FREE
            self._free.append(page)
