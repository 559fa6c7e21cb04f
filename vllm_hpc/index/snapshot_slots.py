"""The D device snapshot slots and the §9.2 choice of a slot for a new tap or endpoint.

A Device-only owner's slot is its last copy, so value (GDSF) decides there; a host-backed owner
only loses a device copy, so recency decides.

A slot holds its image in a row of device pages (`DevicePagePool`), which the store takes when
the slot is staged and gives back when it is released; D is a cap, not memory set aside. Running
requests and KV pages take rows from snapshots too (`give_way`), by the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import Residency, SlotId


class SlotRule(Enum):
    """Which §9.2 step produced a slot, in order of preference."""

    FREE = 1
    SUPERSEDED = 2
    """Owner superseded, oldest supersession first: keeps its host copy or is deleted."""
    DEVICE_ONLY = 3
    """Owner has no host copy and the lowest priority, at most the new one's: it is lost."""
    HOST_BACKED = 4
    """Owner least recently hit among host-backed ones: it keeps only its host copy."""


@dataclass(frozen=True, slots=True)
class SlotChoice:
    slot: SlotId
    rule: SlotRule
    victim: Snapshot | None


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
    def staging(self) -> set[SlotId]:
        return set(self._staging)

    def owner(self, slot: SlotId) -> Snapshot | None:
        return self._owners[slot]

    def is_staging(self, slot: int) -> bool:
        return slot in self._staging

    def choose(self, new_priority: float, use_free: bool = True) -> SlotChoice | None:
        """The slot a new snapshot of estimated priority ``new_priority`` should take, if any
        (a free one only with ``use_free``: the store may find no row for it).

        A pure decision: the caller evicts the victim, then calls ``stage``.
        """
        if self._free and use_free:
            return SlotChoice(self._free[-1], SlotRule.FREE, None)
        owners = [s for s in self._owners if s is not None and s.restore_pins == 0]
        superseded = [s for s in owners if s.superseded]
        if superseded:
            victim = min(superseded, key=lambda s: (s.superseded_at, s.id))
            return self._choice(victim, SlotRule.SUPERSEDED)
        device_only = [s for s in owners if s.image_host is Residency.ABSENT]
        if device_only:
            victim = min(device_only, key=lambda s: (s.priority, s.id))
            if new_priority >= victim.priority:
                return self._choice(victim, SlotRule.DEVICE_ONLY)
        backed = [s for s in owners if s.image_host is Residency.RESIDENT]
        if backed:
            return self._choice(min(backed, key=lambda s: (s.last_hit, s.id)), SlotRule.HOST_BACKED)
        return None

    def give_way(self, plan: int | None = None, exclude: Snapshot | None = None) -> Snapshot | None:
        """The owner whose slot a running request or KV pages take first: superseded (oldest
        first), then host-backed (least recently hit), then device-only (lowest priority).
        Pinned owners stay. With ``plan`` (the step plan being built), owners published in that
        plan stay too: their capture copy may still write the slot's row."""
        owners = [
            s for s in self._owners if s is not None and s is not exclude and may_give_way(s, plan)
        ]
        if not owners:
            return None
        return min(owners, key=_give_way_order)

    def num_give_way(self, plan: int) -> int:
        """How many owners `give_way(plan)` could hand over, one after the other."""
        return sum(1 for s in self._owners if s is not None and may_give_way(s, plan))

    @staticmethod
    def _choice(victim: Snapshot, rule: SlotRule) -> SlotChoice:
        assert victim.slot is not None
        return SlotChoice(victim.slot, rule, victim)

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


def _give_way_order(s: Snapshot) -> tuple[int, float, int]:
    if s.superseded:
        return (0, s.superseded_at, s.id)
    if s.image_host is Residency.RESIDENT:
        return (1, s.last_hit, s.id)
    return (2, s.priority, s.id)
