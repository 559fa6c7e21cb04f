"""Victim selection of the host and the disk tier (§9.3), step by step in
`eviction_order.HOST_EVICTION` and `eviction_order.DISK_EVICTION` order: one policy, run for
each tier.

Only decides; ``CacheStore`` carries the decision out and asks again, so the dead-KV sweep runs
again after every snapshot eviction (the victim's exclusive path has just become dead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.eviction_order import (
    DISK_EVICTION,
    HOST_EVICTION,
    TierStep,
    backed_on_disk,
    disk_value_key,
    first_found,
    value_key,
)
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import Medium, Residency


@dataclass(frozen=True, slots=True)
class BackedCopy:
    """`TierStep.BACKED`: a block's or a snapshot's host copy that the disk holds too."""

    entry: BlockNode | Snapshot


@dataclass(frozen=True, slots=True)
class DeadBlock:
    """`TierStep.DEAD_KV`: a block no snapshot can reach loses its copy on the tier."""

    node: BlockNode


@dataclass(frozen=True, slots=True)
class StaleSnapshot:
    """`TierStep.SUPERSEDED`: the snapshot loses its copy on the tier, L unchanged. The spec
    evicts it entirely; a copy still on another tier is kept here, since it costs this tier
    nothing and the other tiers take superseded snapshots first anyway."""

    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
class ValuedSnapshot:
    """`TierStep.VALUE`: the retained snapshot loses its copy on the tier; the tier's L rises
    to its H."""

    snapshot: Snapshot


TierVictim = BackedCopy | DeadBlock | StaleSnapshot | ValuedSnapshot
Entry = TypeVar("Entry", bound=Hashable)


def tier_copy(node: BlockNode, medium: Medium) -> Residency:
    """The state of ``node``'s copy on the host or the disk."""
    return node.host if medium is Medium.HOST else node.disk


def holds_copy(snapshot: Snapshot, medium: Medium) -> bool:
    """Whether ``snapshot`` has slabs (Filling or resident) on the host or the disk."""
    return snapshot.holds_host if medium is Medium.HOST else snapshot.holds_disk


def snapshot_pinned(snapshot: Snapshot) -> bool:
    return snapshot.restore_pins > 0 or snapshot.disk_pins > 0


def written_behind(snapshot: Snapshot) -> bool:
    """Whether the snapshot's only hold is its write to disk, still in flight: once it lands
    the host copy is backed (`TierStep.BACKED`) and goes losing nothing."""
    return snapshot.image_disk is Residency.FILLING and snapshot.restore_pins == 0


class TierEvictor:
    """The derived sets one slab tier evicts from; ``medium`` is `Medium.HOST` or
    `Medium.DISK`."""

    def __init__(self, medium: Medium) -> None:
        assert medium is not Medium.DEVICE
        self.medium = medium
        self.order = HOST_EVICTION if medium is Medium.HOST else DISK_EVICTION
        self.dead: OrderedDict[BlockNode, None] = OrderedDict()
        """Nodes resident on the tier with no snapshot below and no holds, oldest first."""
        self.backed: OrderedDict[BlockNode | Snapshot, None] = OrderedDict()
        """Unheld host copies the disk holds too, oldest first (the host's only)."""

    def is_dead(self, node: BlockNode) -> bool:
        return (
            tier_copy(node, self.medium) is Residency.RESIDENT
            and node.live_snapshots_below == 0
            and not node.slabs_held
        )

    def is_backed(self, entry: BlockNode | Snapshot) -> bool:
        if self.medium is not Medium.HOST or not backed_on_disk(entry):
            return False
        if isinstance(entry, Snapshot):
            return not snapshot_pinned(entry)
        return not entry.slabs_held

    def sync_node(self, node: BlockNode) -> None:
        _sync(self.dead, node, self.is_dead(node))
        _sync(self.backed, node, self.is_backed(node))

    def sync_snapshot(self, snapshot: Snapshot) -> None:
        _sync(self.backed, snapshot, self.is_backed(snapshot))

    def forget(self, entry: BlockNode | Snapshot) -> None:
        """``entry`` is deleted."""
        if isinstance(entry, BlockNode):
            self.dead.pop(entry, None)
        self.backed.pop(entry, None)

    def next_victim(
        self,
        snapshots: Iterable[Snapshot],
        superseded: Iterable[Snapshot],
        limit: float | None,
    ) -> TierVictim | None:
        """The next victim, or None when nothing may go.

        ``superseded``: every superseded snapshot, oldest supersession first. ``limit``: a write
        stops at `TierStep.VALUE` rather than evict a snapshot worth more than the new one (GDSF
        never inserts what it would evict next), or than one `written_behind`: that one would
        go first by value, and its pin must not make a last copy worth more go in its place
        (#50). The new one stays on the device, declined, and the written one goes once its
        write lands, losing nothing. A block write or a read weighs no value and takes the next.
        """
        return first_found(
            self.order, lambda step: self._victim(step, snapshots, superseded, limit)
        )

    def _victim(
        self,
        step: TierStep,
        snapshots: Iterable[Snapshot],
        superseded: Iterable[Snapshot],
        limit: float | None,
    ) -> TierVictim | None:
        medium = self.medium
        match step:
            case TierStep.BACKED:
                return next((BackedCopy(entry) for entry in self.backed), None)
            case TierStep.DEAD_KV:
                for node in self.dead:
                    # Leaves first: dropping an interior node's last copy deletes its subtree.
                    if node.children is None or len(node.media) > 1:
                        return DeadBlock(node)
            case TierStep.SUPERSEDED:
                for snapshot in superseded:
                    if not snapshot_pinned(snapshot) and holds_copy(snapshot, medium):
                        return StaleSnapshot(snapshot)
            case TierStep.VALUE:
                key = value_key if medium is Medium.HOST else disk_value_key
                waits = limit is not None and medium is Medium.HOST
                retained = (
                    s
                    for s in snapshots
                    if not s.superseded
                    and holds_copy(s, medium)
                    and (not snapshot_pinned(s) or (waits and written_behind(s)))
                )
                best = min(retained, key=key, default=None)
                if best is None or snapshot_pinned(best):
                    return None
                if limit is None or key(best)[0] <= limit:
                    return ValuedSnapshot(best)
        return None


def _sync(members: OrderedDict[Entry, None], entry: Entry, member: bool) -> None:
    if member:
        members.setdefault(entry, None)
    else:
        members.pop(entry, None)
