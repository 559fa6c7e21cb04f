"""The disk tier's journal entries (§2 of docs/notes/disk-tier-plan.md) and their bytes.

Keys are the journal's own counters, one sequence for blocks and snapshots, never reused: they
mean nothing to the index that replays them. A tenant root has no entry and no key: it holds
no bytes, so it is named inline by its ``cache_salt`` (`TenantRoot`) wherever a block hangs from
it or a snapshot is anchored at it, exists while anything does, and is never dropped.

Each entry's payload is a type code, then fixed-width little-endian fields and counted runs.
Kinds are stored by the cache file's codes, so renaming an enum member cannot change the format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NewType

from vllm_hpc.index.types import SlabId, SnapshotKind
from vllm_hpc.persistence.tables import KIND_CODES, NO_SLAB, ByteReader

JournalKey = NewType("JournalKey", int)


@dataclass(frozen=True, slots=True)
class TenantRoot:
    """The root of the tenant whose ``cache_salt`` this is (None: requests without one)."""

    salt: str | None


Parent = JournalKey | TenantRoot
"""What a block hangs from or a snapshot is anchored at: a block's key, or a tenant root."""


@dataclass(frozen=True, slots=True)
class BlockOnDisk:
    """One block's KV record, written whole to one disk slab on every rank."""

    key: JournalKey
    parent: Parent
    tokens: tuple[int, ...]
    extra: bytes
    """The index's extra key (media), opaque here."""
    slab: SlabId
    crcs: tuple[int, ...]
    """CRC-32 of the slab's bytes, one per tensor-parallel rank."""

    @property
    def slabs(self) -> tuple[SlabId, ...]:
        return (self.slab,)


@dataclass(frozen=True, slots=True)
class SnapshotOnDisk:
    """One snapshot's state image (and tail block, when its frontier is inside a block)."""

    key: JournalKey
    kind: SnapshotKind
    anchor: Parent
    tail_tokens: tuple[int, ...]
    image_slabs: tuple[SlabId, ...]
    tail_slab: SlabId | None
    """Set exactly when ``tail_tokens`` is not empty."""
    crcs: tuple[int, ...]
    """Per rank: the CRC-32 of its image slabs' bytes in order, then its tail slab's."""
    hits: int
    """GDSF frequency, kept: the value a restart chooses what to preload by."""

    @property
    def slabs(self) -> tuple[SlabId, ...]:
        tail = () if self.tail_slab is None else (self.tail_slab,)
        return self.image_slabs + tail


@dataclass(frozen=True, slots=True)
class Dropped:
    """The entry under ``key`` is gone (evicted or superseded): its slabs are free."""

    key: JournalKey


Stored = BlockOnDisk | SnapshotOnDisk
Entry = BlockOnDisk | SnapshotOnDisk | Dropped

_BLOCK, _SNAPSHOT, _DROPPED = 1, 2, 3
_KIND_OF_CODE = {code: kind for kind, code in KIND_CODES.items()}
_TAG_KEY = struct.Struct("<BQ")
"""Type code, key: every entry starts so."""
_COUNT = struct.Struct("<I")
_BLOCK_SLAB = struct.Struct("<I")
_SNAPSHOT_HEAD = struct.Struct("<BQI")
"""kind, hits, tail slab (NO_SLAB: none)."""
_PARENT_KEY = struct.Struct("<BQ")
"""0, a block's key."""
_PARENT_ROOT = struct.Struct("<Bi")
"""1, the salt's length in bytes (-1: no salt); then the UTF-8 salt."""
_PARENT_CODE = struct.Struct("<B")


def encode_entry(entry: Entry) -> bytes:
    match entry:
        case BlockOnDisk():
            return b"".join(
                [
                    _TAG_KEY.pack(_BLOCK, entry.key),
                    _encode_parent(entry.parent),
                    _BLOCK_SLAB.pack(entry.slab),
                    _counted("i", entry.tokens),
                    _COUNT.pack(len(entry.extra)),
                    entry.extra,
                    _counted("I", entry.crcs),
                ]
            )
        case SnapshotOnDisk():
            tail_slab = NO_SLAB if entry.tail_slab is None else entry.tail_slab
            return b"".join(
                [
                    _TAG_KEY.pack(_SNAPSHOT, entry.key),
                    _encode_parent(entry.anchor),
                    _SNAPSHOT_HEAD.pack(KIND_CODES[entry.kind], entry.hits, tail_slab),
                    _counted("i", entry.tail_tokens),
                    _counted("I", entry.image_slabs),
                    _counted("I", entry.crcs),
                ]
            )
        case Dropped():
            return _TAG_KEY.pack(_DROPPED, entry.key)


def decode_entry(payload: bytes) -> Entry:
    """The entry ``encode_entry`` wrote; ValueError when the bytes do not frame one."""
    try:
        return _decode(ByteReader(payload))
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"undecodable entry: {exc!r}") from None


def _decode(reader: ByteReader) -> Entry:
    tag, raw_key = reader.take(_TAG_KEY)
    key = JournalKey(raw_key)
    entry: Entry
    if tag == _BLOCK:
        parent = _decode_parent(reader)
        (slab,) = reader.take(_BLOCK_SLAB)
        tokens = _take_counted(reader, "i")
        extra = reader.raw(reader.take(_COUNT)[0])
        crcs = _take_counted(reader, "I")
        entry = BlockOnDisk(key, parent, tokens, extra, SlabId(slab), crcs)
    elif tag == _SNAPSHOT:
        anchor = _decode_parent(reader)
        kind, hits, tail_slab = reader.take(_SNAPSHOT_HEAD)
        tail = _take_counted(reader, "i")
        image = tuple(SlabId(slab) for slab in _take_counted(reader, "I"))
        crcs = _take_counted(reader, "I")
        entry = SnapshotOnDisk(
            key,
            _KIND_OF_CODE[kind],
            anchor,
            tail,
            image,
            None if tail_slab == NO_SLAB else SlabId(tail_slab),
            crcs,
            hits,
        )
    elif tag == _DROPPED:
        entry = Dropped(key)
    else:
        raise struct.error(f"unknown entry type {tag}")
    if reader.rest():
        raise struct.error(f"{reader.rest()} bytes after the entry")
    return entry


def _encode_parent(parent: Parent) -> bytes:
    if not isinstance(parent, TenantRoot):
        return _PARENT_KEY.pack(0, parent)
    if parent.salt is None:
        return _PARENT_ROOT.pack(1, -1)
    salt = parent.salt.encode()
    return _PARENT_ROOT.pack(1, len(salt)) + salt


def _decode_parent(reader: ByteReader) -> Parent:
    (code,) = _PARENT_CODE.unpack_from(reader.data, reader.at)
    if code == 0:
        return JournalKey(reader.take(_PARENT_KEY)[1])
    if code != 1:
        raise struct.error(f"unknown parent type {code}")
    length = reader.take(_PARENT_ROOT)[1]
    return TenantRoot(None if length == -1 else reader.raw(length).decode())


def _counted(code: str, values: tuple[int, ...]) -> bytes:
    return _COUNT.pack(len(values)) + struct.pack(f"<{len(values)}{code}", *values)


def _take_counted(reader: ByteReader, code: str) -> tuple[int, ...]:
    (count,) = reader.take(_COUNT)
    return struct.unpack(f"<{count}{code}", reader.raw(4 * count))
