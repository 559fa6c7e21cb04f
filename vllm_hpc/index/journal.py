"""A journal of residency changes, for KV cache events (issue #19).

A router outside the engine learns what a replica holds from a stream of events: a block's
copy came or went, a snapshot became restorable from a medium or stopped being so, everything
went. `CacheStore`, the one mutator of residency, reports each node and snapshot it changes;
the journal compares what is resident now with what it last recorded and appends the
difference, so a replay of the journal reproduces the set of resident copies exactly, whatever
path (commit, restore, eviction, subtree deletion, load) the change took. Off by default
(`IndexConfig.record_events`): the store then holds no journal and pays one test per change.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import Medium, SnapshotId


@dataclass(frozen=True, slots=True)
class BlockStored:
    """``node``'s copy on ``medium`` became resident (its parents' copies exist already)."""

    node: BlockNode
    medium: Medium
    tenant: str | None = None
    """The tree root's key (`cache_salt` and more) for a first block; None below it."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """``node``'s resident copy on ``medium`` is gone."""

    node: BlockNode
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every copy and snapshot is gone (a reset or a failed load)."""


@dataclass(frozen=True, slots=True)
class SnapshotPublished:
    """A state after tokens [0, frontier) of ``anchor``'s path plus ``tail`` became
    restorable from ``medium`` alone (image and tail both there)."""

    snapshot: SnapshotId
    anchor: BlockNode
    tail: bytes
    frontier: int
    medium: Medium


@dataclass(frozen=True, slots=True)
class SnapshotRemoved:
    """The snapshot can no longer be restored from ``medium``."""

    snapshot: SnapshotId
    anchor: BlockNode
    tail: bytes
    frontier: int
    medium: Medium


JournalEvent = BlockStored | BlockRemoved | AllCleared | SnapshotPublished | SnapshotRemoved

_NONE: frozenset[Medium] = frozenset()
_ORDER = tuple(Medium)


def node_media(node: BlockNode) -> frozenset[Medium]:
    """The media holding a resident copy of ``node`` now (a Filling copy is not yet one)."""
    return node.media


def snapshot_media(snapshot: Snapshot) -> frozenset[Medium]:
    """The media a request could restore ``snapshot`` from, each alone."""
    return snapshot.media


def _changes(
    before: frozenset[Medium], now: frozenset[Medium]
) -> tuple[list[Medium], list[Medium]]:
    """The media lost and gained, device first, disk last (a consumer sees the same order
    each time)."""
    return [m for m in _ORDER if m in before and m not in now], [
        m for m in _ORDER if m in now and m not in before
    ]


class Journal:
    """Events since the last `drain`, and what they said is resident (to diff against)."""

    def __init__(self) -> None:
        self._events: list[JournalEvent] = []
        self._blocks: dict[BlockNode, frozenset[Medium]] = {}
        self._snapshots: dict[Snapshot, frozenset[Medium]] = {}

    def block(self, node: BlockNode, tenant: str | None) -> None:
        """``node``'s residency may have changed: record what did (``tenant``: its root's key,
        for a first block)."""
        now = node_media(node)
        before = self._blocks.get(node, _NONE)
        if now == before:
            return
        gone, came = _changes(before, now)
        self._events.extend(BlockRemoved(node, medium) for medium in gone)
        self._events.extend(BlockStored(node, medium, tenant) for medium in came)
        if now:
            self._blocks[node] = now
        else:
            del self._blocks[node]

    def snapshot(self, snapshot: Snapshot, deleted: bool = False) -> None:
        """``snapshot``'s copies may have changed (``deleted``: it is gone whatever they say)."""
        now = _NONE if deleted else snapshot_media(snapshot)
        before = self._snapshots.get(snapshot, _NONE)
        if now == before:
            return
        gone, came = _changes(before, now)
        where = (snapshot.id, snapshot.anchor, snapshot.tail, snapshot.frontier)
        self._events.extend(SnapshotRemoved(*where, medium) for medium in gone)
        self._events.extend(SnapshotPublished(*where, medium) for medium in came)
        if now:
            self._snapshots[snapshot] = now
        else:
            del self._snapshots[snapshot]

    def cleared(self) -> None:
        """The index was emptied: one event stands for every removal."""
        self._blocks.clear()
        self._snapshots.clear()
        self._events.append(AllCleared())

    def drain(self) -> list[JournalEvent]:
        """The events since the last call, oldest first; the journal keeps none of them."""
        events, self._events = self._events, []
        return events
