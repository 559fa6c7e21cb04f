"""The device LRU of unheld cached pages (§9.1).

Two recency lists: host-backed entries (evicting one only drops a device copy) are always
consumed before unbacked ones (evicting one loses the last copy, §9.4). ``OrderedDict`` is a
C-implemented hash-linked list: O(1) append, removal and pop from the head.
"""

from __future__ import annotations

from collections import OrderedDict

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot

LruEntry = BlockNode | Snapshot
"""A node's device page, or a snapshot's device tail page."""


class DeviceLRU:
    """Head = least recently used. Membership is kept by ``CacheStore`` (§10 of invariants)."""

    def __init__(self) -> None:
        self._backed: OrderedDict[LruEntry, None] = OrderedDict()
        self._unbacked: OrderedDict[LruEntry, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._backed) + len(self._unbacked)

    def __contains__(self, entry: LruEntry) -> bool:
        return entry in self._backed or entry in self._unbacked

    @property
    def num_backed(self) -> int:
        """Entries whose eviction drops only a device copy."""
        return len(self._backed)

    def is_backed(self, entry: LruEntry) -> bool:
        return entry in self._backed

    def place(self, entry: LruEntry, backed: bool) -> bool:
        """Keep ``entry`` in the list matching ``backed``: its position if already there, else
        appended at the MRU end. True when it joined the backed list just now."""
        target, other = (self._backed, self._unbacked) if backed else (self._unbacked, self._backed)
        if entry in target:
            return False
        other.pop(entry, None)
        target[entry] = None
        return backed

    def remove(self, entry: LruEntry) -> None:
        if entry in self._backed:
            del self._backed[entry]
        else:
            self._unbacked.pop(entry, None)

    def victim(self) -> LruEntry | None:
        """The next entry to evict, without removing it."""
        for entries in (self._backed, self._unbacked):
            if entries:
                return next(iter(entries))
        return None

    def order(self) -> list[LruEntry]:
        """All entries in eviction order."""
        return [*self._backed, *self._unbacked]
