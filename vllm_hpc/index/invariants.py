"""A from-scratch audit of the index (§10): rebuild every derived structure and compare.

Slow (O(nodes · depth + snapshots²)) and meant for tests and debugging, like a sanity check
after each operation sequence. Raises ``InvariantError`` naming the first broken invariant.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.device_lru import LruEntry
from vllm_hpc.index.device_pool import PageState
from vllm_hpc.index.eviction_order import has_host_copy
from vllm_hpc.index.host_eviction import TierEvictor
from vllm_hpc.index.host_pool import CHUNK_LIMIT_BYTES, Id, SlabPool, SlabUse
from vllm_hpc.index.lease import Lease
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.store import SCRATCH_ROW, CacheStore
from vllm_hpc.index.transfers import BlockWrite, DiskRead, DiskWrite, Prefetch, Transfer
from vllm_hpc.index.types import (
    BLOCK_BYTES_PACKED,
    DiskSlabId,
    InvariantError,
    Medium,
    PageId,
    Residency,
    RowId,
    SlabId,
    SlotId,
)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantError(message)


def _ancestors(node: BlockNode) -> Iterable[BlockNode]:
    """``node`` and every node above it, root included."""
    current: BlockNode | None = node
    while current is not None:
        yield current
        current = current.parent


def check_invariants(store: CacheStore, leases: set[Lease], in_flight: set[Transfer]) -> None:
    nodes = _check_tree(store)
    snapshots = list(store.snapshots)
    _check_snapshots(store, nodes, snapshots)
    _check_holds(nodes, snapshots, leases, in_flight)
    _check_liveness(store, nodes, snapshots)
    _check_device(store, nodes, snapshots)
    _check_host(store, nodes, snapshots)
    _check_disk(store, nodes, snapshots)


def _check_tree(store: CacheStore) -> list[BlockNode]:
    """Structure and exact identity (§10.2, §10.5); returns every node, roots included."""
    hasher = store.tree.hasher
    nodes: list[BlockNode] = []
    for root in store.tree.roots:
        _expect(root.depth == -1 and root.parent is None, "malformed root")
        _expect(bool(root.children or root.snapshots or root.held), "an idle root was kept")
        for node in store.tree.subtree(root):
            nodes.append(node)
            keys = Counter((c.tokens, c.extra) for c in node.child_list())
            _expect(all(k == 1 for k in keys.values()), f"node {node.id} has twin children")
            for key, head in (node.children or {}).items():
                chained: BlockNode | None = head
                while chained is not None:
                    _expect(chained.parent is node, f"node {chained.id} under a foreign parent")
                    _expect(chained.lookup_hash == key, f"node {chained.id} under a wrong hash")
                    chained = chained.next_same_hash
            if node.is_root:
                continue
            parent = node.parent
            assert parent is not None
            _expect(node.depth == parent.depth + 1, f"node {node.id} has a wrong depth")
            _expect(len(node.tokens) == BLOCK_BYTES_PACKED, f"node {node.id} is not 64 tokens")
            _expect(
                node.lookup_hash == hasher(parent.lookup_hash, node.tokens, node.extra),
                f"node {node.id} has a stale lookup hash",
            )
            _expect(bool(node.media), f"node {node.id} has no resident copy on any tier")
            _expect(
                (node.device_page is None) == (node.device is Residency.ABSENT)
                and (node.host_slab is None) == (node.host is Residency.ABSENT)
                and (node.disk_slab is None) == (node.disk is Residency.ABSENT),
                f"node {node.id} has a location without a state or the reverse",
            )
            _expect(
                node.active_refs == 0 or node.device is not Residency.ABSENT,
                f"node {node.id} is on an active path without a device copy",
            )
    return nodes


def _check_snapshots(store: CacheStore, nodes: list[BlockNode], snapshots: list[Snapshot]) -> None:
    """Registration, uniqueness and validity (§5.3, §10.4)."""
    in_tree = set(nodes)
    listed = [s for node in nodes for s in node.snapshots or ()]
    _expect(Counter(listed) == Counter(snapshots), "anchor lists and snapshot table disagree")
    keys = Counter((s.anchor, s.tail) for s in snapshots)
    _expect(all(k == 1 for k in keys.values()), "two snapshots share (anchor, tail)")
    image_slabs = store.value.geometry.image_slabs
    for s in snapshots:
        _expect(s.anchor in in_tree, f"snapshot {s.id} anchored outside the tree")
        _expect(s.tail_len < 64 and len(s.tail) % 4 == 0, f"snapshot {s.id} has a bad tail")
        _expect(bool(s.image_media), f"snapshot {s.id} has no resident image on any tier")
        _expect(
            len(s.image_slabs) == (0 if s.image_host is Residency.ABSENT else image_slabs)
            and len(s.image_disk_slabs) == (0 if s.image_disk is Residency.ABSENT else image_slabs),
            f"snapshot {s.id} image slabs do not match its state",
        )
        _expect(bool(s.tail_media), f"snapshot {s.id} has no resident tail on any tier")
        _expect(
            (s.tail_page is None) == (s.tail_device is Residency.ABSENT)
            and (s.tail_slab is None) == (s.tail_host is Residency.ABSENT)
            and (s.tail_disk_slab is None) == (s.tail_disk is Residency.ABSENT),
            f"snapshot {s.id} has a tail location without a state or the reverse",
        )
        _expect(
            bool(s.tail) or (s.tail_page is None and s.tail_slab is None and not s.tail_disk_slab),
            f"snapshot {s.id} has tail copies but no tail",
        )
        _expect(
            not s.tail or s.tail_disk is s.image_disk,
            f"snapshot {s.id}'s disk copy is not its image and tail together",
        )
        _expect(
            (s in store.superseded) == s.superseded,
            f"snapshot {s.id} superseded flag and order disagree",
        )
        _expect(s.slot is None or store.slots.owner(s.slot) is s, f"slot of {s.id} not owned")
    ticks = [s.superseded_at for s in store.superseded]
    _expect(ticks == sorted(ticks), "superseded snapshots are not oldest supersession first")


def _check_holds(
    nodes: list[BlockNode],
    snapshots: list[Snapshot],
    leases: set[Lease],
    in_flight: set[Transfer],
) -> None:
    """Refs come from open leases, pins from in-flight transfers, disk pins from in-flight disk
    transfers (which pin no device page) and from landed reads kept for their waiting request
    (`PrefixIndex.complete_disk_read`); all path-closed (§10.3)."""
    refs: Counter[BlockNode] = Counter()
    for lease in leases:
        refs.update([lease.root, *lease.path])
    pins: Counter[BlockNode] = Counter()
    snapshot_pins: Counter[Snapshot] = Counter()
    disk_pins: Counter[BlockNode] = Counter()
    snapshot_disk_pins: Counter[Snapshot] = Counter()
    for transfer in in_flight:
        if isinstance(transfer, BlockWrite | Prefetch):
            pins.update(_ancestors(transfer.pinned))
        elif isinstance(transfer, DiskWrite | DiskRead):
            snapshot_disk_pins[transfer.snapshot] += 1
            disk_pins.update(_ancestors(transfer.snapshot.anchor))
        else:
            snapshot_pins[transfer.snapshot] += 1
            pins.update(_ancestors(transfer.snapshot.anchor))
    for node in nodes:
        _expect(
            node.active_refs == refs[node],
            f"node {node.id} refs {node.active_refs} != {refs[node]}",
        )
        _expect(
            node.restore_pins == pins[node] and node.disk_pins == disk_pins[node],
            f"node {node.id} pins {node.restore_pins}, {node.disk_pins} (disk) != "
            f"{pins[node]}, {disk_pins[node]}",
        )
        _expect(
            _pinned_if_filling(
                node.device, node.host, node.disk, node.restore_pins, node.disk_pins
            ),
            f"node {node.id} is Filling but unpinned",
        )
    for s in snapshots:
        _expect(
            s.restore_pins == snapshot_pins[s] and s.disk_pins == snapshot_disk_pins[s],
            f"snapshot {s.id} pins do not match transfers",
        )
        _expect(
            _pinned_if_filling(
                s.tail_device, s.image_host, s.image_disk, s.restore_pins, s.disk_pins
            )
            and _pinned_if_filling(
                s.tail_device, s.tail_host, s.tail_disk, s.restore_pins, s.disk_pins
            ),
            f"snapshot {s.id} is Filling but unpinned",
        )


def _pinned_if_filling(
    device: Residency, host: Residency, disk: Residency, pins: int, disk_pins: int
) -> bool:
    """A Filling copy has its transfer's pin: a device copy a restore's or prefetch's; a host
    copy a write-through's or a disk read's; a disk copy a disk write's."""
    return (
        (device is not Residency.FILLING or pins > 0)
        and (host is not Residency.FILLING or pins > 0 or disk_pins > 0)
        and (disk is not Residency.FILLING or disk_pins > 0)
    )


def _check_liveness(store: CacheStore, nodes: list[BlockNode], snapshots: list[Snapshot]) -> None:
    """Path counts, ancestor links and GDSF values against a recomputation (§9.3)."""
    live: Counter[BlockNode] = Counter()
    retained: dict[BlockNode, list[Snapshot]] = {node: [] for node in nodes}
    for s in snapshots:
        for node in _ancestors(s.anchor):
            live[node] += 1
            if not s.superseded:
                retained[node].append(s)
    for node in nodes:
        owners = retained[node]
        _expect(
            node.live_snapshots_below == live[node]
            and node.retained_snapshots_below == len(owners)
            and node.retained_id_sum == sum(s.id for s in owners),
            f"node {node.id} liveness counts differ from a recount",
        )
    for s in snapshots:
        above = [t for t in snapshots if t.covers(s)]
        nearest = max(above, key=lambda t: t.frontier, default=None)
        _expect(s.ancestor is nearest, f"snapshot {s.id} has a wrong ancestor link")
        _expect(
            s.dependents == {t for t in snapshots if t.ancestor is s},
            f"snapshot {s.id} has wrong dependents",
        )
        _expect(
            bool(s.media - {Medium.DISK}) or all(n.media for n in s.anchor.path()),
            f"a path block of disk-only snapshot {s.id} has no copy on any tier",
        )
        kept = [t for t in above if not t.superseded]
        base = max((t.frontier for t in kept), default=0)
        exclusive = (
            []
            if s.superseded
            else [n for n in _ancestors(s.anchor) if not n.is_root and retained[n] == [s]]
        )
        value = store.value
        block_bytes = value.geometry.block_bytes
        own = value.own_bytes(bool(s.tail))
        size = own + sum(n.host_slab is not None for n in exclusive) * block_bytes
        disk_size = own + sum(n.disk_slab is not None for n in exclusive) * block_bytes
        cost = value.saved_seconds(s.frontier, base)
        priority = s.base_l + (1 + s.hits) * cost / size
        disk_priority = s.disk_base_l + (1 + s.hits) * cost / disk_size
        _expect(
            s.size == size
            and s.disk_size == disk_size
            and s.cost == cost
            and math.isclose(s.priority, priority)
            and math.isclose(s.disk_priority, disk_priority),
            f"snapshot {s.id} GDSF value differs from a recomputation",
        )
    _expect(
        store.snapshots.top == {s for s in snapshots if s.ancestor is None},
        "top-level snapshot set differs from a recomputation",
    )
    _expect(min(store.value.inflation, store.value.disk_inflation) >= 0.0, "L below zero")


def _check_device(store: CacheStore, nodes: list[BlockNode], snapshots: list[Snapshot]) -> None:
    """Page ownership (§10.1), the LRU membership rule (§9.1) and slot partition."""
    owned: dict[int, PageState] = {}
    pages: list[int] = []
    for page, residency in [
        *((n.device_page, n.device) for n in nodes),
        *((s.tail_page, s.tail_device) for s in snapshots),
    ]:
        if page is not None:
            pages.append(page)
            resident = residency is Residency.RESIDENT
            owned[page] = PageState.CACHED if resident else PageState.FILLING
    _expect(len(pages) == len(owned), "a device page has two owners")
    pool = store.pages
    for state in (PageState.CACHED, PageState.FILLING):
        expected = {p for p, s in owned.items() if s is state}
        _expect(set(pool.pages_in(state)) == expected, f"{state.name} pages differ from owners")
    _expect(pool.num_free == len(pool.pages_in(PageState.FREE)), "free count differs")
    counted = sum(len(pool.pages_in(state)) for state in PageState)
    _expect(counted == pool.capacity, "free + active + cached + filling pages != capacity")
    expected_lru: dict[LruEntry, bool] = {}
    for node in nodes:
        if not node.is_root and node.device is Residency.RESIDENT and not node.held:
            expected_lru[node] = has_host_copy(node)
    for s in snapshots:
        if s.tail_device is Residency.RESIDENT and s.restore_pins == 0:
            expected_lru[s] = has_host_copy(s)
    order = store.lru.order()
    _expect(len(order) == len(expected_lru), "device LRU size differs from the rule")
    for entry in order:
        _expect(
            entry in expected_lru and store.lru.is_backed(entry) == expected_lru[entry],
            "device LRU membership or list differs from the rule",
        )
    slots = store.slots
    owners = {s.slot for s in snapshots if s.slot is not None}
    staging = slots.staging
    free_slots = slots.free_slots
    _expect(
        len(free_slots) == len(set(free_slots))
        and len(owners) + len(staging) + len(free_slots) == slots.capacity
        and not (owners & staging or owners & set(free_slots) or staging & set(free_slots)),
        "device snapshot slots are not partitioned into free, staging and owned",
    )
    if pool.num_rows:
        _check_rows(store, owners | staging)


def _check_rows(store: CacheStore, slots_in_use: set[SlotId]) -> None:
    """State rows (§5.4): every STATE page is in exactly one row that holds a state
    (the scratch, a running request's, a staged or owned slot's, or one in quarantine), and the
    per-row counts match a recount."""
    pool = store.pages
    held = [SCRATCH_ROW, *store.active_rows, *store.slot_rows.values(), *store.quarantine]
    _expect(len(held) == len(set(held)), "a state row has two holders")
    _expect(
        set(store.slot_rows) == slots_in_use, "slot rows differ from the staged and owned slots"
    )
    expected = {page for row in held for page in pool.row_range(row)}
    _expect(set(pool.pages_in(PageState.STATE)) == expected, "STATE pages differ from state rows")
    for r in range(pool.num_rows):
        row = RowId(r)
        states = [pool.state(PageId(p)) for p in pool.row_range(row)]
        _expect(
            pool.row_free(row) == states.count(PageState.FREE)
            and pool.row_cached(row) == states.count(PageState.CACHED),
            f"row {r}'s page counts differ from a recount",
        )


def _check_host(store: CacheStore, nodes: list[BlockNode], snapshots: list[Snapshot]) -> None:
    """Slab ownership (§10.1), chunk geometry (§5.4), the dead-KV set (§9.3) and the set of
    host copies the disk backs."""
    pool = store.slabs
    owners: list[tuple[SlabId | None, SlabUse]] = [
        *((n.host_slab, SlabUse.NODE) for n in nodes),
        *((slab, SlabUse.IMAGE) for s in snapshots for slab in s.image_slabs),
        *((s.tail_slab, SlabUse.TAIL) for s in snapshots),
    ]
    _check_slabs(pool, "host", owners)
    slab_bytes = pool.geometry.slab_bytes
    _expect(sum(pool.chunk_slabs) == pool.capacity, "chunks do not cover the pool")
    _expect(
        all(count * slab_bytes <= CHUNK_LIMIT_BYTES for count in pool.chunk_slabs),
        "a chunk exceeds 4 GiB",
    )
    in_tree = set(nodes)
    _expect(
        all(n in in_tree and n.device is Residency.RESIDENT for n in store.prefetched),
        "a prefetched block is no longer a device-resident node",
    )
    _check_tier_sets(store.host, nodes)
    entries: list[BlockNode | Snapshot] = [*nodes, *snapshots]
    backed = {e for e in entries if store.host.is_backed(e)}
    _expect(set(store.host.backed) == backed, "backed host copies differ from a recomputation")


def _check_disk(store: CacheStore, nodes: list[BlockNode], snapshots: list[Snapshot]) -> None:
    """Disk slab ownership (one owner per disk slab) and the disk's dead-KV set."""
    owners: list[tuple[DiskSlabId | None, SlabUse]] = [
        *((n.disk_slab, SlabUse.NODE) for n in nodes),
        *((slab, SlabUse.IMAGE) for s in snapshots for slab in s.image_disk_slabs),
        *((s.tail_disk_slab, SlabUse.TAIL) for s in snapshots),
    ]
    _check_slabs(store.disk_slabs, "disk", owners)
    _check_tier_sets(store.disk, nodes)
    _expect(not store.disk.backed, "the disk tier has backed copies")


def _check_tier_sets(tier: TierEvictor, nodes: list[BlockNode]) -> None:
    dead = {n for n in nodes if not n.is_root and tier.is_dead(n)}
    _expect(set(tier.dead) == dead, f"{tier.medium.value} dead-KV set differs from a recomputation")


def _check_slabs(pool: SlabPool[Id], tier: str, owners: list[tuple[Id | None, SlabUse]]) -> None:
    """One owner per slab, each slab's use as its owner says, free + used = capacity."""
    expected: dict[Id, SlabUse] = {}
    slabs: list[Id] = []
    for slab, use in owners:
        if slab is not None:
            slabs.append(slab)
            expected[slab] = use
    _expect(len(slabs) == len(expected), f"a {tier} slab has two owners")
    free: list[Id] = pool.free_slabs
    _expect(len(free) == len(set(free)), f"{tier} free list holds a slab twice")
    _expect(not set(free) & set(expected), f"a {tier} slab is both free and owned")
    _expect(len(free) + len(expected) == pool.capacity, f"{tier} free + used slabs != capacity")
    for slab, want in expected.items():
        _expect(pool.use(slab) is want, f"{tier} slab {slab} is not used as its owner says")
    _expect(all(pool.use(f) is SlabUse.FREE for f in free), f"a free {tier} slab is in use")
    for use in (SlabUse.NODE, SlabUse.IMAGE, SlabUse.TAIL):
        count = sum(1 for u in expected.values() if u is use)
        _expect(pool.num_in_use(use) == count, f"{tier} {use.name} slab count differs")
