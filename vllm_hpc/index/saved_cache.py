"""What a save of the host tier keeps (§5.5): typed records of its entries, parents first.

A save keeps every retained (not superseded) snapshot whose image, tail and anchor path are
host-resident, and exactly the blocks of those paths. Dead KV, superseded snapshots and
device-only blocks stay behind: after a restart nothing could resume from them. The records
name each copy by its host slab, so the worker can write the slabs' bytes beside them; ids are
the saving index's own and mean nothing to the index that loads them.

One kind of device-only content is written out: the stop's flush (`plan_save`). A host tier
under pressure gives up the host images of snapshots still complete in a device slot (§9.3)
while their anchor paths stay on the host, and can end holding paths and no snapshot. At a
stop the device goes, so such snapshots are first written from their slots into host slabs
that nothing saved uses, most valuable first, and saved with the rest.

Values that a load recomputes from the loading index (lookup hashes, GDSF cost and size) and
recency (ticks, the aging base L) are not kept; a load starts them afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.store import CacheStore
from vllm_hpc.index.transfers import SnapshotWrite
from vllm_hpc.index.types import (
    BLOCK_TOKENS,
    TOKEN_BYTES,
    NodeId,
    Residency,
    SlabId,
    SnapshotId,
    SnapshotKind,
)


@dataclass(frozen=True, slots=True)
class SavedRoot:
    """A tenant root: the ``cache_salt`` (tenant key) its blocks and snapshots hang from."""

    id: NodeId
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class SavedBlock:
    """One block with its host copy; its parent is a root or a block listed before it."""

    id: NodeId
    parent: NodeId
    tokens: bytes
    """64 packed int32 tokens."""
    extra: int
    """The media key of §5.1 (0 for a text block)."""
    slab: SlabId


@dataclass(frozen=True, slots=True)
class SavedSnapshot:
    id: SnapshotId
    anchor: NodeId
    """A listed block, or a root when the frontier is below 64."""
    kind: SnapshotKind
    tail: bytes
    """The packed tokens after the anchor's last block."""
    image_slabs: tuple[SlabId, ...]
    tail_slab: SlabId | None
    """Set exactly when ``tail`` is not empty."""
    frontier: int
    """Redundant with the anchor's depth and the tail: a load checks it."""
    hits: int
    """GDSF frequency, kept: the value a load chooses by (§9.3)."""


@dataclass(frozen=True, slots=True)
class SavedCache:
    """The entries of one save, parents before children, and the geometry of their slabs."""

    geometry: HostGeometry
    roots: tuple[SavedRoot, ...]
    blocks: tuple[SavedBlock, ...]
    """Parents first (ascending depth)."""
    snapshots: tuple[SavedSnapshot, ...]
    """Ascending frontier."""

    @property
    def slabs(self) -> list[SlabId]:
        """Every slab the records name, ascending: the order a file lays their bytes in."""
        named = [block.slab for block in self.blocks]
        for snapshot in self.snapshots:
            named.extend(snapshot.image_slabs)
            if snapshot.tail_slab is not None:
                named.append(snapshot.tail_slab)
        return sorted(named)


def saveable(snapshot: Snapshot) -> bool:
    """Retained, with its image, tail and whole anchor path resident on the host."""
    if snapshot.superseded or snapshot.image_host is not Residency.RESIDENT:
        return False
    if snapshot.tail and snapshot.tail_host is not Residency.RESIDENT:
        return False
    return all(node.host is Residency.RESIDENT for node in snapshot.anchor.path())


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What a save writes: its records, and the device-only snapshots it first writes from
    their slots into the host slabs those records name for them."""

    saved: SavedCache
    flushes: tuple[SnapshotWrite, ...]


def flushable(snapshot: Snapshot) -> bool:
    """Retained and complete only on the device (its image in a slot and its tail, if any, on a
    device page; neither on the host), with its whole anchor path on the host."""
    if snapshot.superseded or not snapshot.complete_on_device or snapshot.holds_host:
        return False
    return all(node.host is Residency.RESIDENT for node in snapshot.anchor.path())


def export_saved(store: CacheStore) -> SavedCache:
    """The records of what a save keeps; reads the store, changes nothing."""
    return _records(
        store, {s: (s.image_slabs, s.tail_slab) for s in store.snapshots if saveable(s)}
    )


def plan_save(store: CacheStore) -> SavePlan:
    """The records of a save at a stop, with the flush: each flushable snapshot, highest GDSF
    priority first, gets host slabs that no saved image, tail or path uses (free ones, or ones
    holding what the save leaves out), while enough remain. Reads the store, changes nothing:
    the slabs it reuses hold content that the stop discards with the index, so the caller
    writes the flushes only as the cache's last act."""
    chosen = {s: (s.image_slabs, s.tail_slab) for s in store.snapshots if saveable(s)}
    used: set[SlabId] = set()
    for snapshot, (image, tail) in chosen.items():
        used.update(_path_slabs(snapshot), image, () if tail is None else (tail,))
    spare = {SlabId(x) for x in range(store.slabs.capacity)} - used
    ascending = sorted(spare)
    overwritten: set[SlabId] = set()
    """Slabs a flush takes: a later candidate whose path needs one is left out."""
    flushes: list[SnapshotWrite] = []
    image_slabs = store.value.geometry.image_slabs
    candidates = sorted(
        (s for s in store.snapshots if flushable(s)), key=lambda s: (-s.priority, s.id)
    )
    for snapshot in candidates:
        path = set(_path_slabs(snapshot))
        need = image_slabs + (1 if snapshot.tail else 0)
        if path & overwritten or len(spare) - len(path & spare) < need:
            continue
        taken = list(islice((x for x in ascending if x in spare and x not in path), need))
        image, tail = tuple(taken[:image_slabs]), taken[image_slabs] if snapshot.tail else None
        assert snapshot.slot is not None
        flushes.append(SnapshotWrite(snapshot, snapshot.slot, image, snapshot.tail_page, tail))
        chosen[snapshot] = (image, tail)
        spare -= path | set(taken)
        overwritten.update(taken)
    return SavePlan(_records(store, chosen), tuple(flushes))


def _path_slabs(snapshot: Snapshot) -> list[SlabId]:
    slabs = [node.host_slab for node in snapshot.anchor.path()]
    assert all(slab is not None for slab in slabs)
    return [SlabId(slab) for slab in slabs if slab is not None]


def _records(
    store: CacheStore, kept: dict[Snapshot, tuple[tuple[SlabId, ...], SlabId | None]]
) -> SavedCache:
    """The save's records of ``kept`` (each with the host slabs of its image and tail)."""
    snapshots = sorted(kept, key=lambda s: (s.frontier, s.id))
    roots: dict[BlockNode, SavedRoot] = {}
    blocks: dict[BlockNode, SavedBlock] = {}
    for snapshot in snapshots:
        for node in snapshot.anchor.path():
            if node not in blocks:
                assert node.parent is not None and node.host_slab is not None
                blocks[node] = SavedBlock(
                    node.id, node.parent.id, node.tokens, node.extra, node.host_slab
                )
        root = _root_of(snapshot.anchor)
        if root not in roots:
            roots[root] = SavedRoot(root.id, store.tree.salt_of(root))
    ordered = sorted(blocks.items(), key=lambda item: (item[0].depth, item[0].id))
    return SavedCache(
        geometry=store.value.geometry,
        roots=tuple(roots.values()),
        blocks=tuple(block for _, block in ordered),
        snapshots=tuple(_saved_snapshot(s, *kept[s]) for s in snapshots),
    )


def _saved_snapshot(
    snapshot: Snapshot, image_slabs: tuple[SlabId, ...], tail_slab: SlabId | None
) -> SavedSnapshot:
    return SavedSnapshot(
        id=snapshot.id,
        anchor=snapshot.anchor.id,
        kind=snapshot.kind,
        tail=snapshot.tail,
        image_slabs=image_slabs,
        tail_slab=tail_slab,
        frontier=snapshot.frontier,
        hits=snapshot.hits,
    )


def _root_of(node: BlockNode) -> BlockNode:
    while node.parent is not None:
        node = node.parent
    return node


def frontier_of(depth: int, tail: bytes) -> int:
    """The frontier of a snapshot anchored at ``depth`` (-1 for a root) with ``tail``."""
    return (depth + 1) * BLOCK_TOKENS + len(tail) // TOKEN_BYTES
