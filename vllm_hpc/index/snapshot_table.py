"""Registry of snapshots and the liveness structure derived from them (§5.3, §9.3).

Kept eagerly, because host eviction must decide in O(snapshots) without walking paths:

* ``live_snapshots_below`` / ``retained_snapshots_below`` on every node of a snapshot's path:
  dead KV is a host node with no live snapshot below; a node with exactly one retained
  snapshot below belongs to that snapshot's exclusive path, and ``retained_id_sum`` names it;
* ``ancestor`` / ``dependents`` links: each snapshot's nearest snapshot above it on its path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import SnapshotId


@dataclass(slots=True)
class PathChange:
    """What one liveness update changed, so the caller can resync derived sets and values."""

    crossed: list[BlockNode] = field(default_factory=list)
    """Block nodes whose live count moved between 0 and 1 (dead-KV membership changes)."""
    owner: Snapshot | None = None
    """A retained snapshot whose exclusive path grew or shrank."""
    relinked: list[Snapshot] = field(default_factory=list)
    """Snapshots whose nearest retained ancestor may have changed."""


class SnapshotTable:
    def __init__(self) -> None:
        self.by_id: dict[SnapshotId, Snapshot] = {}
        self.top: set[Snapshot] = set()
        """Snapshots with no snapshot above them (their ancestor is the root)."""
        self._next_id = 0

    def new_id(self) -> SnapshotId:
        self._next_id += 1
        return SnapshotId(self._next_id)

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(self.by_id.values())

    def __contains__(self, snapshot: Snapshot) -> bool:
        return self.by_id.get(snapshot.id) is snapshot

    @staticmethod
    def find(anchor: BlockNode, tail: bytes) -> Snapshot | None:
        """The snapshot at (anchor, tail tokens): there is at most one (§5.3)."""
        for snapshot in anchor.snapshots or ():
            if snapshot.tail == tail:
                return snapshot
        return None

    @staticmethod
    def nearest_above(anchor: BlockNode, tail: bytes) -> Snapshot | None:
        """The deepest snapshot strictly above the position (anchor, tail) on its path."""
        node: BlockNode | None = anchor
        following = tail
        while node is not None:
            best: Snapshot | None = None
            for snapshot in node.snapshots or ():
                is_above = len(snapshot.tail) < len(following) and following.startswith(
                    snapshot.tail
                )
                if is_above and (best is None or len(snapshot.tail) > len(best.tail)):
                    best = snapshot
            if best is not None:
                return best
            following = node.tokens
            node = node.parent
        return None

    @staticmethod
    def nearest_retained(snapshot: Snapshot) -> Snapshot | None:
        above = snapshot.ancestor
        while above is not None and above.superseded:
            above = above.ancestor
        return above

    @staticmethod
    def below(snapshot: Snapshot) -> list[Snapshot]:
        """Snapshots whose nearest retained ancestor is, or passes through, ``snapshot``."""
        result: list[Snapshot] = []
        stack = list(snapshot.dependents)
        while stack:
            dependent = stack.pop()
            result.append(dependent)
            if dependent.superseded:
                stack.extend(dependent.dependents)
        return result

    def add(self, snapshot: Snapshot) -> PathChange:
        anchor = snapshot.anchor
        assert self.find(anchor, snapshot.tail) is None, "duplicate snapshot"
        ancestor = self.nearest_above(anchor, snapshot.tail)
        pool = self.top if ancestor is None else ancestor.dependents
        # Only snapshots anchored in the anchor's subtree can lie below; most new snapshots
        # (a finished request's endpoint) have none there, and the pool can be large.
        below = [d for d in pool if snapshot.covers(d)] if anchor.live_snapshots_below else []
        for dependent in below:
            pool.discard(dependent)
            dependent.ancestor = snapshot
            snapshot.dependents.add(dependent)
        snapshot.ancestor = ancestor
        pool.add(snapshot)
        if anchor.snapshots is None:
            anchor.snapshots = []
        anchor.snapshots.append(snapshot)
        self.by_id[snapshot.id] = snapshot
        change = self._count(snapshot, 1)
        change.relinked = self.below(snapshot)
        return change

    def remove(self, snapshot: Snapshot) -> PathChange:
        relinked = self.below(snapshot)
        change = self._count(snapshot, -1)
        ancestor = snapshot.ancestor
        pool = self.top if ancestor is None else ancestor.dependents
        pool.discard(snapshot)
        for dependent in snapshot.dependents:
            dependent.ancestor = ancestor
            pool.add(dependent)
        snapshot.dependents.clear()
        snapshot.ancestor = None
        anchor = snapshot.anchor
        assert anchor.snapshots is not None
        anchor.snapshots.remove(snapshot)
        if not anchor.snapshots:
            anchor.snapshots = None
        del self.by_id[snapshot.id]
        change.relinked = relinked
        return change

    def set_superseded(self, snapshot: Snapshot, superseded: bool) -> PathChange:
        assert snapshot.superseded != superseded
        change = self._count(snapshot, 0, retained=-1 if superseded else 1)
        snapshot.superseded = superseded
        change.relinked = self.below(snapshot)
        return change

    def _count(self, snapshot: Snapshot, live: int, retained: int | None = None) -> PathChange:
        """Add ``live`` (and ``retained``, by default ``live`` unless superseded) along the path."""
        if retained is None:
            retained = 0 if snapshot.superseded else live
        change = PathChange()
        owner_id = 0
        node: BlockNode | None = snapshot.anchor
        while node is not None:
            if live:
                node.live_snapshots_below += live
                if not node.is_root and node.live_snapshots_below == (1 if live > 0 else 0):
                    change.crossed.append(node)
            if retained:
                # The one other retained snapshot whose exclusive path (the count-1 nodes)
                # this snapshot starts or stops sharing.
                exclusive = not owner_id and not node.is_root
                if exclusive and retained > 0 and node.retained_snapshots_below == 1:
                    owner_id = node.retained_id_sum
                node.retained_snapshots_below += retained
                node.retained_id_sum += retained * snapshot.id
                if exclusive and retained < 0 and node.retained_snapshots_below == 1:
                    owner_id = node.retained_id_sum
            node = node.parent
        if owner_id:
            change.owner = self.by_id[SnapshotId(owner_id)]
        return change
