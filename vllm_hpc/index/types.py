"""Identifiers and small enums shared by every module of the index.

Distinct ``NewType`` ids keep a page id from being passed where a slab id is expected; mypy
catches the mix-up, the runtime pays nothing.
"""

from __future__ import annotations

from enum import Enum
from typing import NewType

BLOCK_TOKENS = 64
"""Tokens per KV block; the unit of identity (§5.1)."""


def pages_for(tokens: int) -> int:
    """KV pages (blocks) that hold ``tokens`` tokens: the last one may be partial."""
    return -(-tokens // BLOCK_TOKENS)


TOKEN_BYTES = 4
"""Tokens are stored packed as signed 32-bit integers (``array('i')``)."""

BLOCK_BYTES_PACKED = BLOCK_TOKENS * TOKEN_BYTES

NodeId = NewType("NodeId", int)
SnapshotId = NewType("SnapshotId", int)
PageId = NewType("PageId", int)
SlabId = NewType("SlabId", int)
DiskSlabId = NewType("DiskSlabId", int)
"""A slab of the disk tier's file: a host slab's size, a separate id space."""
SlotId = NewType("SlotId", int)
RowId = NewType("RowId", int)
"""A row of consecutive device pages that holds one Gated DeltaNet state (`DevicePagePool`)."""
Tick = NewType("Tick", int)

TICK_ZERO = Tick(0)


class Medium(Enum):
    """A tier a copy lives on."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class Residency(Enum):
    """State of one copy (device, host or disk) of a node, tail or image (§5.2).

    FILLING means a transfer is writing the copy: readers must wait and nobody may free it.
    """

    ABSENT = 0
    FILLING = 1
    RESIDENT = 2


def resident_media(device: Residency, host: Residency, disk: Residency) -> frozenset[Medium]:
    """The tiers whose copy is resident (a Filling copy is not yet one)."""
    states = (device, host, disk)
    return frozenset(
        m for m, state in zip(Medium, states, strict=True) if state is Residency.RESIDENT
    )


class SnapshotKind(Enum):
    """Why a snapshot exists; decides how supersession treats it (§9.3)."""

    TAP = "tap"
    """A planned tap in a prompt (flexible or exact)."""
    ENDPOINT = "endpoint"
    """Taken when a request finishes or is cancelled, at its exact frontier (§7.7)."""
    BOUNDARY = "boundary"
    """A tap at a client breakpoint or structural boundary: conversations may share it."""


class InvariantError(AssertionError):
    """An internal invariant of the index does not hold: a bug in the index, not the caller."""
