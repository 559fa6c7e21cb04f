"""What the journal's binary entries share (`journal_entries.py`): snapshot kinds by a code of
their own, so renaming an enum member cannot change the format; the code of no slab; and an
in-order reader of fixed-width records and byte runs."""

from __future__ import annotations

import struct
from typing import Any

from vllm_hpc.index.types import SnapshotKind

NO_SLAB = 0xFFFF_FFFF

KIND_CODES = {SnapshotKind.TAP: 0, SnapshotKind.ENDPOINT: 1, SnapshotKind.BOUNDARY: 2}


class ByteReader:
    """Reads fixed-width records and byte runs in order; struct.error past the end."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0

    def take(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def raw(self, size: int) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise struct.error("record runs past its bytes")
        chunk = bytes(self.data[self.at : self.at + size])
        self.at += size
        return chunk

    def rest(self) -> int:
        return len(self.data) - self.at
