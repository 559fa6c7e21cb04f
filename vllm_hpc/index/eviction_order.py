"""Every order in which the device gives way and the host and disk evict (§9), stated once.

The store (`make_device_room`, `take_state_row`, `take_slot`), the snapshot slots, the state rows,
the device LRU and the tier evictors carry these orders out and hold none of their own; the audit
(`invariants.py`) checks the LRU's lists and the tiers' eviction sets against them.

Two principles run through them: what loses nothing (a copy the tier below also holds, a
superseded snapshot) goes before a last copy (§9.4), and value (GDSF, §9.3) decides only between
last copies, where a new snapshot must be worth as much as the one it replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum
from typing import TypeVar

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import Medium, Residency, RowId

Step = TypeVar("Step")
Found = TypeVar("Found")


def first_found(order: Iterable[Step], take: Callable[[Step], Found]) -> Found | None:
    """Carry out an order given as data: what ``take`` finds at the first step that has any."""
    for step in order:
        found = take(step)
        if found is not None:
            return found
    return None


# -- the device LRU (§9.1) ------------------------------------------------------------------


def has_host_copy(entry: BlockNode | Snapshot) -> bool:
    """Whether evicting a device LRU entry (a node's page, a snapshot's tail page) drops only its
    device copy: the LRU list it belongs to. A disk copy does not count here, unlike for a slot
    (`slot_owner`): a read brings to the host only what the device lacks and its request relies
    on the pages it left there, and taking disk-backed pages first gained no hits (#50)."""
    if isinstance(entry, Snapshot):
        return entry.tail_host is Residency.RESIDENT
    return entry.host is Residency.RESIDENT


LRU_LISTS: tuple[bool, ...] = (True, False)
"""The device LRU's lists in eviction order, by `has_host_copy`: host-backed entries before
unbacked ones, least recently used first within each."""


# -- device snapshot slots (§9.2) ------------------------------------------------------------


class SlotOwner(Enum):
    """What the owner of a device snapshot slot loses with its slot."""

    SUPERSEDED = "superseded"
    """Nothing a request resumes from: a newer snapshot of its lineage serves instead."""
    BACKED = "backed"
    """Only its device copy: a hit restores the image from the host, or reads it from the disk
    first. The disk counts as the host does: the host gives up first what the disk holds too
    (`HOST_EVICTION`), and owners the device took for last copies kept their slots by value, so
    new taps were skipped (#50). Not while a read from disk holds the owner: the read brings
    only what the device lacks, and its request relies on the slot's image."""
    DEVICE_ONLY = "device-only"
    """Its last copy: the snapshot goes, a value eviction (L rises, §9.3)."""


def read_pinned(s: Snapshot) -> bool:
    """Whether a read from disk holds the snapshot: in flight, or landed and kept for the
    request it was planned for (`PrefixIndex.complete_disk_read`)."""
    return s.disk_pins > 0 and s.image_disk is Residency.RESIDENT


def slot_owner(s: Snapshot) -> SlotOwner:
    if s.superseded:
        return SlotOwner.SUPERSEDED
    if s.image_host is Residency.RESIDENT:
        return SlotOwner.BACKED
    if s.image_disk is Residency.RESIDENT and not read_pinned(s):
        return SlotOwner.BACKED
    return SlotOwner.DEVICE_ONLY


def loses_nothing(s: Snapshot) -> bool:
    """Whether dropping the snapshot's device image loses nothing a request resumes from."""
    return slot_owner(s) is not SlotOwner.DEVICE_ONLY


def value_key(s: Snapshot) -> tuple[float, int]:
    """Lowest GDSF value H first, the older on a tie: device-only owners and the host tier's
    retained snapshots go by it."""
    return (s.priority, s.id)


def _within(s: Snapshot, kind: SlotOwner) -> tuple[float, int]:
    """Among owners of one kind: the oldest supersession; the least recently hit, since a copy
    remains below and recency decides; the lowest value, since it is a last copy."""
    if kind is SlotOwner.SUPERSEDED:
        return (s.superseded_at, s.id)
    if kind is SlotOwner.BACKED:
        return (s.last_hit, s.id)
    return value_key(s)


REPLACEMENT: tuple[SlotOwner, ...] = (
    SlotOwner.SUPERSEDED,
    SlotOwner.DEVICE_ONLY,
    SlotOwner.BACKED,
)
"""Whose slot a new tap or endpoint takes when none is free (§9.2). Snapshot against snapshot,
so value decides: a device-only owner goes to one worth as much (`may_replace`), before a
backed owner loses its device copy. With a host tier, device-only owners are the snapshots it
declined or evicted by value: taking backed slots first would leave the slots to them."""

GIVE_WAY: tuple[SlotOwner, ...] = (
    SlotOwner.SUPERSEDED,
    SlotOwner.BACKED,
    SlotOwner.DEVICE_ONLY,
)
"""Whose row a running request's state or KV pages take (§5.4). They must have the room (§9.5)
and have no value to weigh, so what loses nothing goes first."""


def replacement_key(s: Snapshot) -> tuple[int, float, int]:
    kind = slot_owner(s)
    return (REPLACEMENT.index(kind), *_within(s, kind))


def give_way_key(s: Snapshot) -> tuple[int, float, int]:
    kind = slot_owner(s)
    return (GIVE_WAY.index(kind), *_within(s, kind))


def may_replace(s: Snapshot, new_priority: float) -> bool:
    """Whether a new snapshot of estimated value ``new_priority`` may take ``s``'s slot: a last
    copy only if worth no more (GDSF never inserts what it would evict next)."""
    return slot_owner(s) is not SlotOwner.DEVICE_ONLY or s.priority <= new_priority


# -- device room: state rows and KV pages (§5.4) --------------------------------------------


class Room(Enum):
    """Where device room comes from."""

    GIVEN_BACK_ROW = "given-back row"
    """A state row given back while the plan being built may still copy it: another state may
    have it at once, since copies into and out of state rows keep their order within a plan."""
    LOSSLESS_KV_ROW = "lossless KV row"
    """A free row, or a row of cached pages that all have host copies, by `kv_row_key`."""
    KV_ROW = "KV row"
    """The row of free and cached pages the device LRU would empty first (`kv_row_key`)."""
    BACKED_PAGE = "backed page"
    """The least recently used host-backed LRU entry's page."""
    UNBACKED_PAGE = "unbacked page"
    """The least recently used LRU entry without a host copy: its block's subtree goes too."""
    LOSSLESS_SNAPSHOT = "lossless snapshot"
    """The next owner by `GIVE_WAY` while it `loses_nothing`: its slot, and the slot's row."""
    SNAPSHOT = "snapshot"
    """The next owner by `GIVE_WAY`."""
    REPLACED_SNAPSHOT = "replaced snapshot"
    """The next owner by `REPLACEMENT` that `may_replace`: its slot, with the slot's row."""


STATE_ROW_ROOM: tuple[Room, ...] = (
    Room.GIVEN_BACK_ROW,
    Room.LOSSLESS_KV_ROW,
    Room.LOSSLESS_SNAPSHOT,
    Room.KV_ROW,
    Room.SNAPSHOT,
)
"""Where a running request's state row comes from (`CacheStore.take_state_row`): a row given back
in this plan, then what loses nothing, then the cached pages the LRU would drop anyway, then a
last copy by value."""

KV_PAGE_ROOM: tuple[Room, ...] = (
    Room.BACKED_PAGE,
    Room.LOSSLESS_SNAPSHOT,
    Room.UNBACKED_PAGE,
    Room.SNAPSHOT,
)
"""Where KV pages that run short come from (`CacheStore.make_device_room`), a page or a row at a
time: what loses nothing first, a whole snapshot row before a block's last copy. A prefetch asks
for no more than the free and backed pages."""

SNAPSHOT_SLOT_ROOM: tuple[Room, ...] = (
    Room.GIVEN_BACK_ROW,
    Room.LOSSLESS_KV_ROW,
    Room.REPLACED_SNAPSHOT,
    Room.KV_ROW,
)
"""Where a new snapshot's slot comes from (`CacheStore.take_slot`): a free slot with a row that
loses nothing, else an owner's slot, which brings its row, else a free slot with the row the LRU
would empty first. Where states do not share the page space, a free slot needs no row and comes
first."""


def kv_row_key(newest: int, row: RowId) -> tuple[int, int]:
    """The row of KV pages a state takes: the one whose most recently used entry (``newest``, its
    position in the LRU's order; -1 for none) is the oldest, so eviction follows the LRU as
    closely as whole rows allow, and a row of host-backed entries goes before any row that loses
    a last copy. Among rows with nothing to evict, the highest: KV pages are taken lowest first."""
    return (newest, -row)


# -- the host and the disk tier (§9.3) ------------------------------------------------------


def backed_on_disk(entry: BlockNode | Snapshot) -> bool:
    """Whether the host copy of a block, or of a snapshot's image and tail, is on disk too:
    dropping it from the host loses nothing."""
    if isinstance(entry, Snapshot):
        return {Medium.HOST, Medium.DISK} <= entry.media
    return entry.host is Residency.RESIDENT and entry.disk is Residency.RESIDENT


def disk_value_key(s: Snapshot) -> tuple[float, int]:
    """`value_key` by the disk's own GDSF value (its own L and Z)."""
    return (s.disk_priority, s.id)


def most_valuable_on_disk(snapshots: Iterable[Snapshot]) -> list[Snapshot]:
    """The retained snapshots the disk holds, most valuable first: its `TierStep.VALUE` order
    reversed, in which a start-up reads them into the host tier (§5.5)."""
    held = (s for s in snapshots if Medium.DISK in s.media and not s.superseded)
    return sorted(held, key=disk_value_key, reverse=True)


class TierStep(Enum):
    """What the host and the disk tier evict, in `HOST_EVICTION` and `DISK_EVICTION` order."""

    BACKED = "backed"
    """A host copy the disk also holds (`backed_on_disk`), oldest first: nothing is lost, as
    the device LRU drops host-backed pages first."""
    DEAD_KV = "dead KV"
    """A block no snapshot can reach, oldest first: it can never produce a hit."""
    SUPERSEDED = "superseded"
    """A superseded snapshot's copy, oldest supersession first; L stays."""
    VALUE = "value"
    """A retained snapshot's copy by the tier's value key (`value_key`, `disk_value_key`); the
    tier's L rises to its H."""


HOST_EVICTION: tuple[TierStep, ...] = (
    TierStep.BACKED,
    TierStep.DEAD_KV,
    TierStep.SUPERSEDED,
    TierStep.VALUE,
)
"""What the disk holds too, then what can never be hit, then what a newer snapshot replaced,
then by value (§9.3)."""

DISK_EVICTION: tuple[TierStep, ...] = (TierStep.DEAD_KV, TierStep.SUPERSEDED, TierStep.VALUE)
"""The host's order below its first step: nothing lies under the disk to back it."""
