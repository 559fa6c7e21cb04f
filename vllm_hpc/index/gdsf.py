"""GreedyDual-Size-Frequency valuation of snapshots (§9.3).

    H(s) = L_s + F(s) · C(s) / Z(s)
    C(s) = max(0, prefill_seconds(F_a, F_s - F_a) - restore_seconds(image_bytes))
           a = nearest retained snapshot above s on its path (F_a = 0 for the root)
    Z(s) = image_bytes + tail_bytes + exclusive_path_bytes(s)
    F(s) = 1 + hits(s)

L_s is the inflation value L when s was published or last hit. L only rises: recomputing C or Z
for a neighbour's sake can leave an H below L, so evicting it must not lower L.

The disk tier values by the same formula with its own L (raised by its own value victims,
stamped at a hit and when a copy lands on disk) and its own Z (the exclusive path bytes it
holds on disk): `Snapshot.disk_priority`.
"""

from __future__ import annotations

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.cost_model import CostModel
from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.snapshot_table import SnapshotTable
from vllm_hpc.index.types import BLOCK_TOKENS, Medium


class GdsfValuation:
    def __init__(self, cost: CostModel, geometry: HostGeometry) -> None:
        self.cost = cost
        self.geometry = geometry
        self.inflation = 0.0
        """L: rises to the priority of each value-based victim."""
        self.disk_inflation = 0.0
        """The disk tier's L: rises to the disk priority of each of its value victims."""

    def inflate(self, victim_priority: float) -> None:
        self.inflation = max(self.inflation, victim_priority)

    def inflate_disk(self, victim_priority: float) -> None:
        self.disk_inflation = max(self.disk_inflation, victim_priority)

    def stamp(self, snapshot: Snapshot) -> None:
        """Record both Ls at publication or hit: the snapshot's aging bases."""
        snapshot.base_l = self.inflation
        snapshot.disk_base_l = self.disk_inflation

    def stamp_disk(self, snapshot: Snapshot) -> None:
        """The snapshot entered the disk tier: GDSF values an insertion at the current L."""
        snapshot.disk_base_l = self.disk_inflation
        self._reprioritize(snapshot)

    def saved_seconds(self, frontier: int, base: int) -> float:
        """C: prefill from ``base`` to ``frontier`` that a restore of the image saves."""
        prefill = self.cost.prefill_seconds(base, frontier - base)
        return max(0.0, prefill - self.cost.restore_seconds(self.geometry.image_bytes))

    def own_bytes(self, has_tail: bool) -> int:
        return self.geometry.image_bytes + (self.geometry.block_bytes if has_tail else 0)

    def exclusive_path_bytes(self, snapshot: Snapshot) -> tuple[int, int]:
        """Host and disk bytes of the path nodes below which ``snapshot`` is the only retained
        one."""
        if snapshot.superseded:
            return 0, 0
        host = disk = 0
        node: BlockNode | None = snapshot.anchor
        while node is not None and not node.is_root and node.retained_snapshots_below == 1:
            host += node.host_slab is not None
            disk += node.disk_slab is not None
            node = node.parent
        return host * self.geometry.block_bytes, disk * self.geometry.block_bytes

    def revalue(self, snapshot: Snapshot) -> None:
        """Recompute C, Z and H from the current tree."""
        above = SnapshotTable.nearest_retained(snapshot)
        base = 0 if above is None else above.frontier
        snapshot.cost = self.saved_seconds(snapshot.frontier, base)
        own = self.own_bytes(bool(snapshot.tail))
        host, disk = self.exclusive_path_bytes(snapshot)
        snapshot.size, snapshot.disk_size = own + host, own + disk
        self._reprioritize(snapshot)

    def resize(self, snapshot: Snapshot, medium: Medium, delta_bytes: int) -> None:
        """A node of the snapshot's exclusive path gained or lost its copy on ``medium``."""
        if medium is Medium.HOST:
            snapshot.size += delta_bytes
        else:
            snapshot.disk_size += delta_bytes
        self._reprioritize(snapshot)

    def disk_estimate(self, snapshot: Snapshot) -> float:
        """The disk H of a retained snapshot written now: inserted at the disk's L, with its
        exclusive path on disk (a disk write brings the whole path)."""
        blocks = 0
        node: BlockNode | None = snapshot.anchor
        while node is not None and not node.is_root and node.retained_snapshots_below == 1:
            blocks += 1
            node = node.parent
        size = self.own_bytes(bool(snapshot.tail)) + blocks * self.geometry.block_bytes
        return self.disk_inflation + (1 + snapshot.hits) * snapshot.cost / size

    def estimate(self, frontier: int, previous: int, has_tail: bool) -> float:
        """H of a snapshot not yet published (§9.2): no hits, and the blocks since the
        sequence's previous snapshot counted as its own."""
        blocks = frontier // BLOCK_TOKENS - previous // BLOCK_TOKENS
        size = self.own_bytes(has_tail) + blocks * self.geometry.block_bytes
        return self.inflation + self.saved_seconds(frontier, previous) / size

    @staticmethod
    def _reprioritize(snapshot: Snapshot) -> None:
        gain = (1 + snapshot.hits) * snapshot.cost
        snapshot.priority = snapshot.base_l + gain / snapshot.size
        snapshot.disk_priority = snapshot.disk_base_l + gain / snapshot.disk_size
