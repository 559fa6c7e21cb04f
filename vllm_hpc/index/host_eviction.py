"""Host-tier victim selection (§9.3), step by step in `eviction_order.HOST_EVICTION` order.

Only decides; ``CacheStore`` carries the decision out and asks again, so the dead-KV sweep runs
again after every snapshot eviction (the victim's exclusive path has just become dead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.eviction_order import HOST_EVICTION, HostStep, first_found, value_key
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import Residency


@dataclass(frozen=True, slots=True)
class DeadBlock:
    """`HostStep.DEAD_KV`: a host block no snapshot can reach."""

    node: BlockNode


@dataclass(frozen=True, slots=True)
class StaleSnapshot:
    """`HostStep.SUPERSEDED`: the snapshot loses its host copy, L unchanged. The spec evicts
    it entirely; a copy still in a device slot is kept here, since it costs the host nothing and
    device slot eviction takes superseded owners first anyway."""

    snapshot: Snapshot


@dataclass(frozen=True, slots=True)
class ValuedSnapshot:
    """`HostStep.VALUE`: the retained snapshot loses its host copy; L rises to its H."""

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

        ``limit``: a snapshot image write stops at `HostStep.VALUE` rather than evict a snapshot
        worth more than the new one (GDSF never inserts what it would evict next).
        """
        return first_found(HOST_EVICTION, lambda step: self._victim(step, snapshots, limit))

    def _victim(
        self, step: HostStep, snapshots: Iterable[Snapshot], limit: float | None
    ) -> HostVictim | None:
        match step:
            case HostStep.DEAD_KV:
                for node in self.dead:
                    # Leaves first: dropping a host-only interior node would delete its subtree.
                    if node.children is None or node.device is Residency.RESIDENT:
                        return DeadBlock(node)
            case HostStep.SUPERSEDED:
                for snapshot in self.superseded:
                    if snapshot.restore_pins == 0 and snapshot.holds_host:
                        return StaleSnapshot(snapshot)
            case HostStep.VALUE:
                retained = (
                    s
                    for s in snapshots
                    if not s.superseded and s.restore_pins == 0 and s.holds_host
                )
                best = min(retained, key=value_key, default=None)
                if best is not None and (limit is None or best.priority <= limit):
                    return ValuedSnapshot(best)
        return None
