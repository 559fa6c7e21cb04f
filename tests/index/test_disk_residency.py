"""The disk tier's index layer (disk-tier plan §1-§3): its slab pool, write-behind, reads back
into the host, and the eviction orders of both slab tiers."""

from __future__ import annotations

import dataclasses

import pytest

from tests.index.harness import (
    BLOCK,
    Harness,
    JournalReplay,
    load_disk_only,
    make_index,
    snap,
    toks,
)
from vllm_hpc.index import (
    HostGeometry,
    IndexConfig,
    PrefixIndex,
    Readiness,
    Residency,
    Snapshot,
)
from vllm_hpc.index.eviction_order import (
    DISK_EVICTION,
    HOST_EVICTION,
    SlotOwner,
    TierStep,
    slot_owner,
)
from vllm_hpc.index.host_pool import DiskSlabPool, HostSlabPool, SlabPool, SlabUse
from vllm_hpc.index.journal import BlockStored, SnapshotPublished
from vllm_hpc.index.source_choice import choose, source_options
from vllm_hpc.index.types import DiskSlabId, Medium, SnapshotKind

SLAB = 4096
GEOMETRY = HostGeometry(block_bytes=1000, image_bytes=4000)


def tapped(h: Harness, seed: int, blocks: int = 2) -> tuple[list[int], Snapshot]:
    """One request with a tap 7 tokens past ``blocks`` blocks, and one block below it that no
    snapshot reaches (dead KV)."""
    prompt = toks(seed, (blocks + 1) * BLOCK + 5)
    (publication,) = h.run(prompt, taps=[blocks * BLOCK + 7])
    assert publication is not None
    return prompt, publication.snapshot


def to_disk(h: Harness) -> None:
    for write in h.index.plan_disk_writes(1 << 30):
        h.index.complete_disk_write(write)
    h.check()


def off_device(h: Harness, snapshot: Snapshot) -> None:
    """Push every cached page and the snapshot's slot off the device."""
    index = h.index
    grabbed = index.allocate_pages(index.available_pages)
    assert grabbed is not None
    index.free_pages(grabbed)
    if snapshot.slot is not None:
        index.store.drop_snapshot_image_device(snapshot)
    h.check()


def disk_only(h: Harness, snapshot: Snapshot) -> None:
    off_device(h, snapshot)
    store = h.index.store
    assert store.make_host_room(store.slabs.capacity)
    h.check()
    assert snapshot.media == {Medium.DISK}


# -- the pools ------------------------------------------------------------------------------


def test_host_and_disk_share_one_allocator_and_only_the_host_has_chunks() -> None:
    host, disk = HostSlabPool(10 * SLAB, GEOMETRY), DiskSlabPool(10 * SLAB, GEOMETRY)
    assert isinstance(host, SlabPool) and isinstance(disk, SlabPool)
    assert host.chunk_slabs == (10,) and not hasattr(disk, "chunk_slabs")
    taken = disk.allocate(3, SlabUse.IMAGE)
    assert taken == [DiskSlabId(0), DiskSlabId(1), DiskSlabId(2)]
    assert disk.num_in_use(SlabUse.IMAGE) == 3 and disk.num_free == 7
    disk.free(taken)
    assert disk.num_free == 10 and not DiskSlabPool(0, GEOMETRY).enabled


def test_the_disk_budget_is_checked_naming_its_field() -> None:
    with pytest.raises(ValueError, match=r"IndexConfig\.disk_budget_bytes .* use 0"):
        DiskSlabPool(2 * SLAB, GEOMETRY)  # one snapshot with its tail plus a block is 3 slabs
    with pytest.raises(ValueError, match=r"IndexConfig\.disk_budget_bytes must not be negative"):
        DiskSlabPool(-1, GEOMETRY)
    with pytest.raises(ValueError, match=r"IndexConfig\.disk_budget_bytes needs a host tier"):
        IndexConfig(device_pages=8, geometry=GEOMETRY, disk_budget_bytes=10 * SLAB)
    config = IndexConfig(device_pages=8, geometry=GEOMETRY, host_budget_bytes=10 * SLAB)
    assert config.disk_budget_bytes == 0 and not PrefixIndex(config).store.disk_slabs.enabled


def test_the_orders_are_stated_once() -> None:
    assert (TierStep.BACKED, *DISK_EVICTION) == HOST_EVICTION
    assert DISK_EVICTION == (TierStep.DEAD_KV, TierStep.SUPERSEDED, TierStep.VALUE)


# -- write-behind ---------------------------------------------------------------------------


def test_a_write_takes_the_snapshot_and_its_path_but_never_dead_kv() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20, record_events=True))
    replay = JournalReplay()
    _, snapshot = tapped(h, 1)
    replay.check(h.index)
    (write,) = h.index.plan_disk_writes(1 << 30)
    path = snapshot.anchor.path()
    assert [copy.node for copy in write.blocks] == path  # the third block has no snapshot below
    assert write.image_slabs == snapshot.image_slabs and write.tail is not None
    assert snapshot.image_disk is Residency.FILLING and all(
        n.disk is Residency.FILLING for n in path
    )
    h.check()
    assert h.index.plan_disk_writes(1 << 30) == []  # in flight already
    h.index.complete_disk_write(write)
    h.check()
    assert Medium.DISK in snapshot.media and all(Medium.DISK in n.media for n in path)
    dead = snapshot.anchor.child_list()[0]
    assert dead.disk is Residency.ABSENT and dead.disk_slab is None
    events = h.index.drain_events()
    disk_blocks = [e.node for e in events if isinstance(e, BlockStored)]
    assert disk_blocks == path and all(e.medium is Medium.DISK for e in events)
    assert [type(e) for e in events][-1] is SnapshotPublished
    replay.apply(events)
    replay.check(h.index)
    assert h.index.stats.disk_writes == 1


def test_writes_go_most_valuable_first_within_the_byte_bound() -> None:
    h = Harness(make_index(host_slabs=30, disk_slabs=30))
    _, low = tapped(h, 1, blocks=1)
    _, high = tapped(h, 2, blocks=3)
    h.index.store.touch(high, hit=True)
    assert high.priority > low.priority
    # The high one needs 3 blocks, an image and a tail: 5 slabs; the low one 3.
    (first,) = h.index.plan_disk_writes(5 * SLAB)
    assert first.snapshot is high
    (second,) = h.index.plan_disk_writes(3 * SLAB)
    assert second.snapshot is low
    h.check()


def test_a_disk_write_pins_host_copies_but_no_device_page() -> None:
    h = Harness(make_index(pages=16, host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 3)
    (write,) = h.index.plan_disk_writes(1 << 30)
    store = h.index.store
    path = snapshot.anchor.path()
    assert all(n.restore_pins == 0 and n.disk_pins == 1 and n in store.lru for n in path)
    assert snapshot in store.lru and snapshot.restore_pins == 0
    off_device(h, snapshot)  # the device may drop everything meanwhile
    assert all(n.device is Residency.ABSENT for n in path)
    assert not store.make_host_room(store.slabs.capacity)  # the host copies stay
    assert snapshot.image_host is Residency.RESIDENT
    h.index.complete_disk_write(write)
    h.check()


def test_a_failed_write_frees_its_disk_slabs() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 4)
    (write,) = h.index.plan_disk_writes(1 << 30)
    h.index.fail_disk_write(write)
    h.check()
    store = h.index.store
    assert store.disk_slabs.num_free == 20 and not snapshot.holds_disk
    assert all(n.disk is Residency.ABSENT and n.disk_pins == 0 for n in snapshot.anchor.path())
    assert h.index.stats.disk_writes_failed == 1
    (again,) = h.index.plan_disk_writes(1 << 30)  # queued again
    h.index.complete_disk_write(again)
    h.check()


def test_no_disk_tier_writes_nothing() -> None:
    h = Harness(make_index(host_slabs=20))
    tapped(h, 5)
    assert h.index.plan_disk_writes(1 << 30) == []
    with pytest.raises(ValueError, match="max_bytes"):
        h.index.plan_disk_writes(-1)


# -- host eviction: backed copies first ---------------------------------------------------


def test_host_copies_on_disk_are_evicted_first_and_nothing_is_lost() -> None:
    # Host: 3 blocks + image + tail = 5 of 7 slabs; disk holds the snapshot and its path.
    h = Harness(make_index(host_slabs=7, disk_slabs=20))
    prompt, snapshot = tapped(h, 6)
    to_disk(h)
    store = h.index.store
    assert set(store.host.backed) == {*snapshot.anchor.path(), snapshot}
    h.run(toks(7, 3 * BLOCK))  # its write needs 3 slabs, 2 are free: one backed copy goes
    stats = h.index.stats
    assert stats.host_backed_evicted >= 1 and stats.host_dead_reclaimed == 0
    assert stats.host_gdsf_evicted == 0 and snapshot in store.snapshots
    assert store.value.inflation == 0.0
    disk_only(h, snapshot)
    assert snapshot in store.snapshots  # it lives on disk alone
    match = h.index.match(h.index.prepare_prompt([*prompt[: 2 * BLOCK + 7], 1]))
    assert match.candidates == [snapshot]


def test_a_slot_owner_on_disk_gives_its_slot_up_as_a_host_backed_one_does() -> None:
    """#50: the host gives up first what the disk holds too, so a slot owner whose only other
    copy is on disk must count as backed, not as a last copy: else the device keeps it by value,
    a new tap finds no slot and is skipped, and a slot given up for nothing raises L."""
    h = Harness(make_index(slots=1, host_slabs=20, disk_slabs=20))
    _, kept = tapped(h, 30)
    store = h.index.store
    store.touch(kept, hit=True)  # worth more than the tap below: a last copy would stay
    to_disk(h)
    assert store.make_host_room(store.slabs.capacity)
    h.check()
    assert kept.media == {Medium.DEVICE, Medium.DISK} and kept.slot is not None
    (new,) = h.run(toks(31, BLOCK + 5), taps=[BLOCK])
    assert new is not None and h.index.stats.taps_skipped_no_slot == 0
    assert kept.slot is None and kept in store.snapshots and Medium.DISK in kept.media
    assert store.value.inflation == 0.0  # nothing was lost


def test_a_slot_a_read_relies_on_stays_while_its_request_waits() -> None:
    """A read brings to the host only what the device lacks: here the path, the image being in
    a slot. While the read holds it, its owner counts as a last copy (a running request's row
    takes it last) and no new tap takes its slot (else its request would read it again); once
    the request is admitted it is backed by the disk again."""
    h = Harness(make_index(slots=1, host_slabs=20, disk_slabs=20))
    index, store = h.index, h.index.store
    prompt = toks(52, 3 * BLOCK)
    (snapshot,) = map(snap, h.run(prompt, taps=[2 * BLOCK]))
    to_disk(h)
    assert store.make_host_room(store.slabs.capacity)
    grabbed = index.allocate_pages(index.available_pages)  # the path's pages go
    assert grabbed is not None
    index.free_pages(grabbed)
    h.check()
    assert snapshot.slot is not None and all(
        n.media == {Medium.DISK} for n in snapshot.anchor.path()
    )
    read = index.plan_disk_read(snapshot)
    assert read is not None and read.blocks and not read.image_slabs
    index.complete_disk_read(read, keep=True)
    h.check()
    assert slot_owner(snapshot) is SlotOwner.DEVICE_ONLY
    (skipped,) = h.run(toks(53, BLOCK + 5), taps=[BLOCK])
    assert skipped is None and snapshot.slot is not None
    quote = index.quote(index.match(index.prepare_prompt(prompt)), lambda f: 0)
    assert quote.source is not None and quote.source.snapshot is snapshot
    assert quote.source.disk_bytes == 0  # no second read
    index.release_disk_read(read)
    assert slot_owner(snapshot) is SlotOwner.BACKED
    (new,) = h.run(toks(54, BLOCK + 5), taps=[BLOCK])
    assert new is not None and snapshot.slot is None
    h.check()


def test_a_snapshot_write_stops_at_a_cheaper_one_written_behind() -> None:
    """#50: the least valuable host snapshot is the one host eviction would take, and the
    write-behind pins it while its write is in flight; a write-through weighing value stops
    there rather than take a last copy worth more, which the host tier alone would have kept.
    Once the write lands, the written one goes first and loses nothing."""
    h = Harness(make_index(host_slabs=8, disk_slabs=40, slots=8))
    store = h.index.store
    _, cheap = tapped(h, 40, blocks=1)
    (write,) = h.index.plan_disk_writes(1 << 30)
    _, dear = tapped(h, 41, blocks=1)
    store.touch(dear, hit=True)
    assert cheap.priority < dear.priority and store.slabs.num_free == 0
    assert not store.make_host_room(3, limit=1.0)  # the two dead blocks went, then it stops
    h.check()
    assert Medium.HOST in dear.media and h.index.stats.host_gdsf_evicted == 0
    h.index.complete_disk_write(write)
    assert store.make_host_room(5, limit=1.0)  # and the written one's three slabs
    h.check()
    assert Medium.HOST in dear.media and cheap.media == {Medium.DEVICE, Medium.DISK}
    assert h.index.stats.host_gdsf_evicted == 0 and store.value.inflation == 0.0


def test_room_that_weighs_no_value_takes_the_next_snapshot_past_one_written_behind() -> None:
    h = Harness(make_index(host_slabs=8, disk_slabs=40, slots=8))
    store = h.index.store
    _, cheap = tapped(h, 42, blocks=1)
    (write,) = h.index.plan_disk_writes(1 << 30)
    _, dear = tapped(h, 43, blocks=1)
    assert store.make_host_room(3)  # a block write or a read: it needs the room now
    h.check()
    assert Medium.HOST not in dear.media and Medium.HOST in cheap.media
    h.index.complete_disk_write(write)
    h.check()


# -- reads back into the host ---------------------------------------------------------------


def test_a_disk_only_snapshot_is_read_back_then_restored_from_the_host() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    prompt, snapshot = tapped(h, 8)
    to_disk(h)
    disk_only(h, snapshot)
    index = h.index
    resume = [*prompt[: 2 * BLOCK + 7], 1, 2]
    match = index.match(index.prepare_prompt(resume))
    quote = index.quote(match, lambda f: 1)
    assert quote.readiness is Readiness.READY and quote.source is not None
    assert quote.source.snapshot is snapshot and quote.source.disk_bytes == 7000
    with pytest.raises(ValueError, match="needs a disk read first"):
        index.acquire(quote)
    without = index.quote(match, lambda f: 1, disk=False)
    assert without.source is not None and without.source.snapshot is None
    read = index.plan_disk_read(snapshot)
    assert read is not None
    assert [c.node for c in read.blocks] == snapshot.anchor.path()
    assert len(read.image_slabs) == 1 and read.tail is not None
    assert read.image_disk_slabs == snapshot.image_disk_slabs
    assert index.plan_disk_read(snapshot) is None  # landing already
    h.check()
    landing = index.quote(index.match(index.prepare_prompt(resume)), lambda f: 1)
    assert landing.source is not None and landing.source.snapshot is None  # nothing else serves
    index.complete_disk_read(read)
    h.check()
    assert snapshot.media == {Medium.HOST, Medium.DISK}
    admission = h.admit(resume)
    assert admission.source is snapshot and index.stats.hits_host == 1
    assert index.stats.disk_reads == 1


def test_a_kept_read_stays_on_the_host_until_its_request_releases_it() -> None:
    """A landed read's copies are disk-backed, which host eviction takes first (§9.3): kept
    for the request waiting for them, they stay until it is admitted or leaves."""
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 14)
    to_disk(h)
    disk_only(h, snapshot)
    index, store = h.index, h.index.store
    read = index.plan_disk_read(snapshot)
    assert read is not None
    index.complete_disk_read(read, keep=True)
    h.check()
    assert index.holds_read(read) and snapshot.disk_pins == 1
    assert not store.make_host_room(store.slabs.capacity)  # pinned: nothing of it goes
    assert snapshot.media == {Medium.HOST, Medium.DISK}
    assert all(Medium.HOST in node.media for node in snapshot.anchor.path())
    assert not index.reset()  # a kept read is a pin held
    h.check()
    index.release_disk_read(read)
    h.check()
    assert not index.holds_read(read) and snapshot.disk_pins == 0
    with pytest.raises(ValueError, match="not kept"):
        index.release_disk_read(read)
    assert store.make_host_room(store.slabs.capacity)
    assert snapshot.media == {Medium.DISK}


def test_a_read_landed_unkept_is_unpinned_at_once() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 15)
    to_disk(h)
    disk_only(h, snapshot)
    read = h.index.plan_disk_read(snapshot)
    assert read is not None
    h.index.complete_disk_read(read)
    h.check()
    assert not h.index.holds_read(read) and snapshot.disk_pins == 0


def test_a_read_takes_only_what_is_on_disk_alone() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 9)
    to_disk(h)
    assert h.index.plan_disk_read(snapshot) is None  # all of it is on the host too
    store = h.index.store
    first = snapshot.anchor.path()[0]
    store.drop_snapshot_host(snapshot)  # the image stays in its slot, the tail on the device
    h.check()
    assert h.index.plan_disk_read(snapshot) is None
    store.drop_snapshot_tail_device(snapshot)
    read = h.index.plan_disk_read(snapshot)
    # The tail comes with its image: the journal checks them as one record.
    assert read is not None and read.blocks == () and len(read.image_slabs) == 1
    assert read.tail is not None and first.host is Residency.RESIDENT
    h.index.complete_disk_read(read)
    h.check()
    assert snapshot.tail_host is snapshot.image_host is Residency.RESIDENT


def test_a_failed_read_frees_its_host_slabs_and_keeps_the_disk_copy() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 10)
    to_disk(h)
    disk_only(h, snapshot)
    free = h.index.store.slabs.num_free
    read = h.index.plan_disk_read(snapshot)
    assert read is not None
    h.index.fail_disk_read(read)
    h.check()
    assert h.index.store.slabs.num_free == free and snapshot.media == {Medium.DISK}
    assert h.index.stats.disk_reads_failed == 1
    with pytest.raises(ValueError, match="unknown or already completed"):
        h.index.complete_disk_read(read)


def test_a_damaged_block_goes_with_what_hangs_from_it_and_a_shallower_source_serves() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    prompt, snapshot = tapped(h, 12)
    to_disk(h)
    disk_only(h, snapshot)
    first, second = snapshot.anchor.path()
    read = h.index.plan_disk_read(snapshot)
    assert read is not None
    disk_free = h.index.store.disk_slabs.num_free
    assert h.index.fail_disk_read(read, [second]) == 1
    h.check()
    assert snapshot not in h.index.store.snapshots and second.disk is Residency.ABSENT
    assert first.media == {Medium.DISK}  # undamaged: kept
    assert h.index.store.disk_slabs.num_free == disk_free + 3  # the block, image and tail
    assert h.index.stats.disk_records_dropped == 1
    match = h.index.match(h.index.prepare_prompt([*prompt[: 2 * BLOCK + 7], 1]))
    assert match.candidates == []


def test_a_damaged_snapshot_record_goes_and_its_path_stays() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 13)
    to_disk(h)
    disk_only(h, snapshot)
    path = snapshot.anchor.path()
    read = h.index.plan_disk_read(snapshot)
    assert read is not None
    assert h.index.fail_disk_read(read, [snapshot]) == 1
    h.check()
    assert snapshot not in h.index.store.snapshots
    assert all(node.host is Residency.ABSENT for node in path)  # the read's slabs went back


def test_a_disk_source_is_chosen_only_where_it_beats_a_shallower_one_by_its_read() -> None:
    """Reads cost the disk's time on top of the restore: a host source nearly as deep wins,
    a much shallower one loses."""
    h = Harness(make_index(host_slabs=40, disk_slabs=40))
    prompt = toks(14, 7 * BLOCK + 5)
    (shallow, deep) = h.run(prompt, taps=[BLOCK + 3, 6 * BLOCK + 3])
    assert shallow is not None and deep is not None
    to_disk(h)
    off_device(h, deep.snapshot)
    store = h.index.store
    store.drop_snapshot_host(deep.snapshot)
    for node in deep.snapshot.anchor.path()[2:]:
        store.drop_node_host(node)
    h.check()
    match = h.index.match(h.index.prepare_prompt(prompt))
    quote = h.index.quote(match, lambda f: 1)
    assert quote.source is not None
    assert quote.source.snapshot is deep.snapshot  # five blocks' prefill cost more than the read
    expected = 4 * 1000 + 4000 + 1000  # its disk-only blocks, image and tail
    assert quote.source.disk_bytes == expected
    cost = store.value.cost
    read = cost.disk_read_seconds(expected) + cost.restore_seconds(quote.source.host_bytes)
    frontier = 6 * BLOCK + 3
    prefill = cost.prefill_seconds(frontier, len(prompt) - frontier)
    assert quote.source.seconds == pytest.approx(read + prefill)
    slow = dataclasses.replace(cost, disk_read_bytes_per_s=1.0)
    options = source_options(match, store.lru, slow, store.value.geometry)
    assert [o.snapshot for o in options] == [deep.snapshot, shallow.snapshot, None]
    assert choose(options).snapshot is shallow.snapshot


def test_a_read_larger_than_the_host_tier_is_no_source_and_a_shallower_one_serves() -> None:
    """A read lands in host slabs: one that needs more than the host tier has could never
    land, so its snapshot is no source (a request waiting for it would wait forever)."""
    index = make_index(host_slabs=5, disk_slabs=40)
    prompt = toks(16, 7 * BLOCK)
    shallow, deep = load_disk_only(index, prompt, [2 * BLOCK, 6 * BLOCK])
    index.check_invariants()
    match = index.match(index.prepare_prompt(prompt))
    assert match.candidates == [shallow, deep]
    quote = index.quote(match, lambda f: 1)  # deep: 6 blocks and an image, 7 slabs of 5
    assert quote.source is not None and quote.source.snapshot is shallow
    assert quote.source.disk_bytes == 2 * 1000 + 4000
    assert index.plan_disk_read(deep) is None and index.stats.disk_reads_declined == 1
    read = index.plan_disk_read(shallow)
    assert read is not None and len(read.blocks) == 2
    index.check_invariants()


def test_a_read_refuses_a_path_only_the_device_holds() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    _, snapshot = tapped(h, 11)
    to_disk(h)
    h.index.store.drop_snapshot_host(snapshot)
    h.index.store.drop_snapshot_image_device(snapshot)
    store = h.index.store
    first = snapshot.anchor.path()[0]
    store.drop_node_disk(first)
    store.drop_node_host(first)  # the device alone holds it, and may drop it during a read
    h.check()
    assert first.media == {Medium.DEVICE} and h.index.plan_disk_read(snapshot) is None


# -- disk eviction ----------------------------------------------------------------------------


def test_disk_evicts_dead_kv_then_superseded_then_by_its_own_value() -> None:
    h = Harness(make_index(host_slabs=40, disk_slabs=12))
    prompt = toks(12, 3 * BLOCK + 5)
    old, new = h.run(prompt, taps=[BLOCK, 3 * BLOCK])  # the second supersedes the first
    assert old is not None and new is not None and old.snapshot.superseded
    _, other = tapped(h, 13, blocks=1)  # 1 block, image and tail: 3 slabs
    to_disk(h)  # the retained ones: 3 blocks + image, then 3 slabs
    store = h.index.store
    assert store.disk_slabs.num_free == 12 - 7 and not old.snapshot.holds_disk
    # A dead block on disk: the new snapshot goes, and its exclusive path is dead KV.
    _, big = tapped(h, 14, blocks=5)
    store.touch(big, hit=True)
    store.touch(big, hit=True)
    (write,) = h.index.plan_disk_writes(1 << 30)  # needs 5 blocks + image + tail = 7 slabs
    h.index.complete_disk_write(write)
    h.check()
    stats = h.index.stats
    assert stats.disk_gdsf_evicted >= 1 and store.value.disk_inflation > 0.0
    assert store.value.inflation == 0.0  # the host's L is its own
    assert not (new.snapshot.holds_disk and other.holds_disk)
    assert big.holds_disk


def test_superseded_snapshots_leave_the_disk_first() -> None:
    h = Harness(make_index(host_slabs=40, disk_slabs=8))
    prompt = toks(15, 3 * BLOCK + 5)
    (old,) = h.run(prompt, taps=[BLOCK + 3])
    assert old is not None
    to_disk(h)  # 1 block + image + tail
    store = h.index.store
    store.set_superseded(old.snapshot, True)
    _, fresh = tapped(h, 16, blocks=5)  # 5 blocks + image + tail = 7 slabs: needs 2 more
    (write,) = h.index.plan_disk_writes(1 << 30)
    h.index.complete_disk_write(write)
    h.check()
    stats = h.index.stats
    assert stats.disk_superseded_evicted == 1 and stats.disk_gdsf_evicted == 0
    assert stats.disk_dead_reclaimed == 0  # its block stays: the snapshot lives on the host
    assert old.snapshot in store.snapshots and not old.snapshot.holds_disk
    assert store.value.disk_inflation == 0.0 and fresh.holds_disk


def test_dead_disk_kv_goes_before_any_snapshot() -> None:
    h = Harness(make_index(host_slabs=40, disk_slabs=10))
    _, gone = tapped(h, 17)
    _, kept = tapped(h, 18)
    to_disk(h)  # 2 x (2 blocks + image + tail) = 8 of 10 slabs
    store = h.index.store
    store.delete_snapshot(gone)  # its path on disk reaches no snapshot now
    h.check()
    assert set(store.disk.dead) == set(gone.anchor.path())
    assert store.disk_slabs.num_free == 4  # its image and tail went with it
    assert store.make_disk_room(6)
    h.check()
    assert h.index.stats.disk_dead_reclaimed == 2 and h.index.stats.disk_gdsf_evicted == 0
    assert kept.holds_disk and not store.disk.dead


# -- rebuilt from the journal at start-up ----------------------------------------------------


def test_journaled_entries_come_back_disk_only_and_pass_the_audit() -> None:
    h = Harness(make_index(host_slabs=20, disk_slabs=20))
    prompt, snapshot = tapped(h, 30)
    to_disk(h)
    path = snapshot.anchor.path()
    fresh = Harness(make_index(host_slabs=20, disk_slabs=20))
    index = fresh.index
    parent = None
    for node in path:
        assert node.disk_slab is not None
        parent = index.load_disk_block(parent, node.tokens, node.extra, node.disk_slab)
    assert snapshot.tail_disk_slab is not None
    loaded = index.load_disk_snapshot(
        parent,
        kind=snapshot.kind,
        tail=snapshot.tail,
        image_slabs=snapshot.image_disk_slabs,
        tail_slab=snapshot.tail_disk_slab,
        hits=3,
    )
    fresh.check()
    assert loaded.media == {Medium.DISK} and loaded.hits == 3
    assert all(node.media == {Medium.DISK} for node in loaded.anchor.path())
    assert index.store.disk_slabs.num_free == 20 - len(path) - 2
    quote = index.quote(
        index.match(index.prepare_prompt([*prompt[: 2 * BLOCK + 7], 1])), lambda f: 1
    )
    assert quote.source is not None and quote.source.snapshot is loaded  # after a read
    assert index.plan_disk_read(loaded) is not None


def test_a_journaled_entry_that_does_not_fit_is_refused_unchanged() -> None:
    index = make_index(host_slabs=20, disk_slabs=20)
    block = bytes(4 * BLOCK)
    node = index.load_disk_block(None, block, 0, DiskSlabId(3), cache_salt="a")
    with pytest.raises(ValueError, match="in the index already"):
        index.load_disk_block(None, block, 0, DiskSlabId(4), cache_salt="a")
    with pytest.raises(ValueError, match="not free"):
        index.load_disk_block(node, block, 0, DiskSlabId(3))
    with pytest.raises(ValueError, match="tail"):
        index.load_disk_snapshot(
            node,
            kind=SnapshotKind.ENDPOINT,
            tail=b"",
            image_slabs=[DiskSlabId(5)],
            tail_slab=DiskSlabId(6),
            hits=0,
        )
    with pytest.raises(ValueError, match="not free"):
        index.load_disk_snapshot(
            None,
            kind=SnapshotKind.ENDPOINT,
            tail=bytes(8),
            image_slabs=[DiskSlabId(5)],
            tail_slab=DiskSlabId(3),
            hits=0,
            cache_salt="b",
        )
    assert index.store.tree.root("b") is None  # no idle root left behind
    assert index.store.disk_slabs.num_free == 19
    index.check_invariants()


def test_the_disk_pool_lists_the_slabs_it_freed() -> None:
    pool = DiskSlabPool(10 * SLAB, GEOMETRY)
    taken = pool.allocate(3, SlabUse.NODE)
    assert taken is not None
    pool.free(taken[:2])
    pool.free(taken[2:])
    assert pool.take_freed() == taken and pool.take_freed() == []
