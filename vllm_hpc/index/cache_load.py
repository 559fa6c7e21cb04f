"""Rebuilding a save's entries host-only at start-up (§5.5).

A host tier smaller than the save keeps whole snapshots, greedily by the GDSF density without
its time-dependent base: (1 + hits) × the prefill a restore saves from the root, per byte of
image, tail and anchor path. Each comes with exactly the path blocks it needs; a block that an
earlier choice brought already costs nothing. The entries come back host-only, so their first
requests restore through the ordinary host path.

A save that the host tier holds whole goes back into the slabs its file order names (saved
slab ``k`` of the file into slab ``k``: `file_placement`), so each worker can read the file
into its host tier while the engine still starts, before the index is built, and the load then
only claims those slabs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.gdsf import GdsfValuation
from vllm_hpc.index.host_pool import HostGeometry, SlabUse
from vllm_hpc.index.saved_cache import SavedBlock, SavedCache, SavedSnapshot, frontier_of
from vllm_hpc.index.store import CacheStore
from vllm_hpc.index.types import BLOCK_BYTES_PACKED, BLOCK_TOKENS, TOKEN_BYTES, NodeId, SlabId


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """The snapshots a host tier keeps of a save, and their path blocks."""

    snapshots: tuple[SavedSnapshot, ...]
    """In the save's order (ascending frontier)."""
    blocks: tuple[SavedBlock, ...]
    """Parents first."""
    slabs: int
    """Host slabs the plan takes."""


@dataclass(frozen=True, slots=True)
class LoadedCache:
    """What a load rebuilt, and where each saved slab's bytes now belong."""

    slabs: dict[SlabId, SlabId]
    """Saved slab id -> the slab that receives its bytes: only the slabs the plan keeps."""
    snapshots: int
    blocks: int
    bytes: int
    """Host bytes of the kept slabs: what the reader copies."""
    saved_snapshots: int
    saved_blocks: int
    saved_bytes: int
    """The host tier the whole save needs."""

    @property
    def complete(self) -> bool:
        return self.snapshots == self.saved_snapshots


def restore_density(snapshot: SavedSnapshot, path_blocks: int, value: GdsfValuation) -> float:
    """(1 + hits) × the prefill a restore saves from the root, per byte of image, tail and
    ``path_blocks`` anchor path blocks."""
    size = value.own_bytes(bool(snapshot.tail)) + path_blocks * value.geometry.block_bytes
    return (1 + snapshot.hits) * value.saved_seconds(snapshot.frontier, 0) / size


def plan_host_restore(saved: SavedCache, free_slabs: int, value: GdsfValuation) -> RestorePlan:
    """Choose whole snapshots by density that fit ``free_slabs``, skipping any that do not
    fit and trying the rest, so a smaller one can still use the room left."""
    parents = {block.id: block.parent for block in saved.blocks}
    geometry = value.geometry

    def path(anchor: NodeId) -> list[NodeId]:
        nodes = []
        while anchor in parents:
            nodes.append(anchor)
            anchor = parents[anchor]
        return nodes

    paths = {s.id: path(s.anchor) for s in saved.snapshots}
    order = sorted(
        saved.snapshots,
        key=lambda s: (-restore_density(s, len(paths[s.id]), value), s.frontier, s.id),
    )
    taken: set[NodeId] = set()
    chosen = set()
    left = free_slabs
    for snapshot in order:
        new = [node for node in paths[snapshot.id] if node not in taken]
        need = len(new) + geometry.snapshot_slabs(bool(snapshot.tail))
        if need <= left:
            left -= need
            taken.update(new)
            chosen.add(snapshot.id)
    return RestorePlan(
        snapshots=tuple(s for s in saved.snapshots if s.id in chosen),
        blocks=tuple(b for b in saved.blocks if b.id in taken),
        slabs=free_slabs - left,
    )


def file_placement(saved: SavedCache) -> dict[SlabId, SlabId]:
    """Where a whole save's slabs go: each into the slab of its position in the file."""
    return {slab: SlabId(position) for position, slab in enumerate(saved.slabs)}


def load_saved(store: CacheStore, saved: SavedCache) -> LoadedCache:
    """Rebuild the planned part of ``saved`` in the empty ``store``, host-only, parents first.

    Raises ValueError, before changing anything, for records that do not describe a save of
    this geometry. The caller writes each saved slab's bytes into its new slab before any
    request, and empties the index if it cannot.
    """
    assert not store.tree.roots, "loading into an index that holds entries"
    check_saved(saved, store.value.geometry)
    plan = plan_host_restore(saved, store.slabs.num_free, store.value)
    salts = {root.id: root.cache_salt for root in saved.roots}
    nodes: dict[NodeId, BlockNode] = {}

    def node(saved_id: NodeId) -> BlockNode:
        if saved_id in salts:
            return store.tree.root_for(salts[saved_id])
        return nodes[saved_id]

    slabs = _place(store, saved, plan)
    for block in plan.blocks:
        nodes[block.id] = store.add_host_node(
            node(block.parent), block.tokens, block.extra, slabs[block.slab]
        )
    for snapshot in plan.snapshots:
        image = [slabs[slab] for slab in snapshot.image_slabs]
        tail = None if snapshot.tail_slab is None else slabs[snapshot.tail_slab]
        store.add_host_snapshot(
            node(snapshot.anchor), snapshot.tail, snapshot.kind, image, tail, snapshot.hits
        )
    slab_bytes = store.value.geometry.slab_bytes
    return LoadedCache(
        slabs=slabs,
        snapshots=len(plan.snapshots),
        blocks=len(plan.blocks),
        bytes=len(slabs) * slab_bytes,
        saved_snapshots=len(saved.snapshots),
        saved_blocks=len(saved.blocks),
        saved_bytes=len(saved.slabs) * slab_bytes,
    )


def _place(store: CacheStore, saved: SavedCache, plan: RestorePlan) -> dict[SlabId, SlabId]:
    """Saved slab -> its slab here, each claimed for its use: the file's placement for a whole
    save, otherwise ascending free slabs per use (consecutive runs copy as one)."""
    uses = {
        SlabUse.NODE: [block.slab for block in plan.blocks],
        SlabUse.IMAGE: [slab for s in plan.snapshots for slab in s.image_slabs],
        SlabUse.TAIL: [s.tail_slab for s in plan.snapshots if s.tail_slab is not None],
    }
    whole = plan.slabs == len(saved.slabs)
    placement = file_placement(saved) if whole else {}
    slabs: dict[SlabId, SlabId] = {}
    for use, kept in uses.items():
        if whole:
            taken = [placement[slab] for slab in kept]
            store.slabs.take(taken, use)
        else:
            allocated = store.slabs.allocate(len(kept), use)
            assert allocated is not None, "the plan took more slabs than were free"
            taken = allocated
        slabs.update(zip(kept, taken, strict=True))
    return slabs


def check_saved(saved: SavedCache, geometry: HostGeometry) -> None:
    """Raise ValueError unless ``saved`` is a well-formed save of ``geometry``'s slabs: parents
    listed before children, no twin entries, each copy in slabs of its own."""
    if saved.geometry != geometry:
        raise ValueError(f"saved host geometry {saved.geometry} differs from {geometry}")
    depth = {root.id: -1 for root in saved.roots}
    if len(depth) != len(saved.roots) or len({r.cache_salt for r in saved.roots}) != len(depth):
        raise ValueError("two saved roots share an id or a cache_salt")
    keys: Counter[tuple[NodeId, bytes, int]] = Counter()
    for block in saved.blocks:
        if block.parent not in depth or block.id in depth:
            raise ValueError(f"saved block {block.id} is listed before its parent or twice")
        if len(block.tokens) != BLOCK_BYTES_PACKED or not 0 <= block.extra < 1 << 64:
            raise ValueError(f"saved block {block.id} is not {BLOCK_TOKENS} tokens and a key")
        depth[block.id] = depth[block.parent] + 1
        keys[block.parent, block.tokens, block.extra] += 1
    anchors: Counter[tuple[NodeId, bytes]] = Counter()
    for s in saved.snapshots:
        if s.anchor not in depth:
            raise ValueError(f"saved snapshot {s.id} is anchored on no saved block")
        tail_len, rest = divmod(len(s.tail), TOKEN_BYTES)
        if (
            rest
            or tail_len >= BLOCK_TOKENS
            or (s.tail_slab is None) != (tail_len == 0)
            or len(s.image_slabs) != geometry.image_slabs
            or s.frontier != frontier_of(depth[s.anchor], s.tail)
            or s.frontier < 1
            or s.hits < 0
        ):
            raise ValueError(f"saved snapshot {s.id} is malformed")
        anchors[s.anchor, s.tail] += 1
    slabs = saved.slabs
    if (
        any(count > 1 for count in (*keys.values(), *anchors.values()))
        or len(set(slabs)) != len(slabs)
        or len({s.id for s in saved.snapshots}) != len(saved.snapshots)
    ):
        raise ValueError("the save holds twin blocks, twin snapshots or a slab twice")
