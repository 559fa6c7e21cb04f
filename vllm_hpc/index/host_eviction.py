"""Host-tier victim selection (§9.3): dead KV, then superseded snapshots, then GDSF.

Only decides; ``CacheStore`` carries the decision out and asks again, so the dead-KV sweep runs
again after every snapshot eviction (the victim's exclusive path has just become dead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import Residency


@dataclass(frozen=True, slots=True)
class DeadBlock:
    """Step 1: a host block no snapshot can reach; it can never produce a hit."""

    node: BlockNode


@dataclass(frozen=True, slots=True)
class StaleSnapshot:
    """Step 2: the oldest superseded snapshot loses its host copy, L unchanged. The spec evicts
    it entirely; a copy still in a device slot is kept here, since it costs the host nothing and
    device slot eviction takes superseded owners first anyway."""

    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
class ValuedSnapshot:
    """Step 3: the retained snapshot with minimum H; L rises to its H."""

    snapshot: Snapshot


HostVictim = DeadBlock | StaleSnapshot | ValuedSnapshot


class HostEvictor:
    def __init__(self) -> None:
        self.dead: OrderedDict[BlockNode, None] = OrderedDict()
        """Host-resident nodes with no snapshot below and no refs or pins, oldest first."""
        self.superseded: OrderedDict[Snapshot, None] = OrderedDict()
        """Every superseded snapshot, in supersession order."""

    @staticmethod
    def is_dead(node: BlockNode) -> bool:
        return node.host is Residency.RESIDENT and node.live_snapshots_below == 0 and not node.held

    def sync_dead(self, node: BlockNode) -> None:
        if self.is_dead(node):
            self.dead.setdefault(node, None)
        else:
            self.dead.pop(node, None)

    def next_victim(self, snapshots: Iterable[Snapshot], limit: float | None) -> HostVictim | None:
        """The next host victim, or None when nothing may go.

        ``limit``: a snapshot image write stops at step 3 rather than evict a snapshot worth more
        than the new one (GDSF never inserts what it would evict next).
        """
        for node in self.dead:
            # Leaves first: dropping a host-only interior node would delete its subtree.
            if node.children is None or node.device is Residency.RESIDENT:
                return DeadBlock(node)
        for snapshot in self.superseded:
            if snapshot.restore_pins == 0 and snapshot.holds_host:
                return StaleSnapshot(snapshot)
        best: Snapshot | None = None
        for snapshot in snapshots:
            if (
                not snapshot.superseded
                and snapshot.restore_pins == 0
                and snapshot.holds_host
                and (best is None or snapshot.priority < best.priority)
            ):
                best = snapshot
        if best is None or (limit is not None and best.priority > limit):
            return None
        return ValuedSnapshot(best)
