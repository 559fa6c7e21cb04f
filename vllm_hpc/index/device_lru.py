"""The device LRU of unheld cached pages (§9.1).

Two recency lists, by whether an entry has a host copy, consumed in `eviction_order.LRU_LISTS`
order. ``OrderedDict`` is a C-implemented hash-linked list: O(1) append, removal and pop from
the head.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.eviction_order import LRU_LISTS, has_host_copy
from vllm_hpc.index.snapshot import Snapshot

LruEntry = BlockNode | Snapshot
"""A node's device page, or a snapshot's device tail page."""


class DeviceLRU:
    """Head = least recently used. Membership is kept by ``CacheStore`` (§10 of invariants)."""

    def __init__(self) -> None:
        self._lists: dict[bool, OrderedDict[LruEntry, None]] = {
            backed: OrderedDict() for backed in LRU_LISTS
        }
        self._backed, self._unbacked = self._lists[True], self._lists[False]

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

    def place(self, entry: LruEntry) -> bool:
        """Keep ``entry`` in the list `has_host_copy` names: its position if already there, else
        appended at the MRU end. True when it joined the backed list just now."""
        backed = has_host_copy(entry)
        target, other = self._lists[backed], self._lists[not backed]
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

    def oldest(self, backed: bool) -> LruEntry | None:
        """The least recently used entry of one list, without removing it."""
        entries = self._lists[backed]
        return next(iter(entries)) if entries else None

    def order(self) -> list[LruEntry]:
        """All entries in eviction order."""
        return list(chain.from_iterable(self._lists.values()))
