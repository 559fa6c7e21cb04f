"""The D device snapshot slots, and the owner that gives its slot up (§9.2).

Which owner goes is `eviction_order`'s: `REPLACEMENT` for a new tap or endpoint, `GIVE_WAY` for
a running request's state or KV pages.

A slot holds its image in a row of device pages (`DevicePagePool`), which the store takes when
the slot is staged and gives back when it is released; D is a cap, not memory set aside.
"""

from __future__ import annotations

from vllm_hpc.index.eviction_order import (
    give_way_key,
    may_replace,
    read_pinned,
    replacement_key,
)
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import SlotId


class DeviceSnapshotSlots:
    """Slot ids 0..capacity-1; each is free, staging (a tap being captured) or owned."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"need at least one device snapshot slot, got {capacity}")
        self.capacity = capacity
        self._owners: list[Snapshot | None] = [None] * capacity
        self._staging: set[SlotId] = set()
        self._free: list[SlotId] = [SlotId(s) for s in range(capacity - 1, -1, -1)]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[SlotId]:
        return list(self._free)

    @property
    def next_free(self) -> SlotId:
        """The free slot a capture takes next: the one released last."""
        return self._free[-1]

    @property
    def staging(self) -> set[SlotId]:
        return set(self._staging)

    def owner(self, slot: SlotId) -> Snapshot | None:
        return self._owners[slot]

    def is_staging(self, slot: int) -> bool:
        return slot in self._staging

    def replacement(self, new_priority: float) -> Snapshot | None:
        """The owner whose slot a new snapshot of estimated value ``new_priority`` takes when
        none is free (`REPLACEMENT`), or None: the capture is skipped. Pinned owners stay, and
        so does one a read from disk holds: the read brings only what the device lacks, so its
        request relies on the slot's image, and a tap taking it would have it read again (#50).

        A pure decision: the caller evicts the owner, then stages its slot.
        """
        owners = [
            s
            for s in self._owners
            if s is not None
            and s.restore_pins == 0
            and not read_pinned(s)
            and may_replace(s, new_priority)
        ]
        return min(owners, key=replacement_key, default=None)

    def give_way(self, plan: int | None = None, exclude: Snapshot | None = None) -> Snapshot | None:
        """The owner whose row a running request or KV pages take next (`GIVE_WAY`). Pinned
        owners stay. With ``plan`` (the step plan being built), owners published in that plan
        stay too: their capture copy may still write the slot's row."""
        owners = [
            s for s in self._owners if s is not None and s is not exclude and may_give_way(s, plan)
        ]
        return min(owners, key=give_way_key, default=None)

    def num_give_way(self, plan: int) -> int:
        """How many owners `give_way(plan)` could hand over, one after the other."""
        return sum(1 for s in self._owners if s is not None and may_give_way(s, plan))

    def stage(self, slot: SlotId) -> None:
        """Take a free slot for a capture in progress (O(D), and D is small)."""
        self._free.remove(slot)
        self._staging.add(slot)

    def assign(self, slot: SlotId, snapshot: Snapshot) -> None:
        self._staging.remove(slot)
        self._owners[slot] = snapshot

    def release(self, slot: SlotId) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._staging.discard(slot)
        self._owners[slot] = None
        self._free.append(slot)


def may_give_way(s: Snapshot, plan: int | None) -> bool:
    """Whether an owner's slot may go (`DeviceSnapshotSlots.give_way`): unpinned, and with
    ``plan``, published before the plan being built."""
    return s.restore_pins == 0 and (plan is None or s.published_plan < plan)
