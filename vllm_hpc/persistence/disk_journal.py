"""The disk tier's journal (§2 of docs/notes/disk-tier-plan.md): the file, its replay, its
writer and its compaction.

Layout (little-endian)::

    0   prelude (`header.py`): magic, format version, header bytes, header CRC-32
    20  header: block_bytes, image_bytes, slab_bytes (u64 each), TP size (u32), then the
        engine fingerprint's bytes
    H   entries, appended: payload bytes (u32) | CRC-32 of those 4 bytes | payload CRC-32
        (u32) | payload (`journal_entries`)

The length has a CRC of its own, so a damaged entry is told from a damaged length: an entry
whose payload fails its CRC is skipped by its length (or, as the last one, is a torn write); a
length that fails ends the replay, since nothing after it can be framed.

The engine core is the only writer. It appends an entry only once every rank reported the
entry's slabs durable, and makes a step's entries durable together (`flush_durable`): so the
journal never names a slab that is not on disk, and a kill -9 loses at most the entries not
yet flushed. Slabs no live entry names are free.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.types import BLOCK_TOKENS, SlabId
from vllm_hpc.persistence.header import (
    PRELUDE,
    HeaderError,
    HeaderMismatch,
    differing_keys,
    pack_header,
    read_header,
)
from vllm_hpc.persistence.journal_entries import (
    BlockOnDisk,
    Dropped,
    Entry,
    JournalKey,
    Parent,
    Stored,
    TenantRoot,
    decode_entry,
    encode_entry,
)
from vllm_hpc.persistence.replacement import replace_durably, temporary_beside

MAGIC = b"VHPCJNL\x00"
FORMAT_VERSION = 1
MAX_ENTRY_BYTES = 1 << 20
"""No entry is larger (a snapshot of thousands of image slabs is tens of KiB): a length
claiming more is damaged."""
COMPACTION_RATIO = 4
"""The journal is rewritten when it holds more than this many entries per live one."""
_HEADER = struct.Struct("<QQQI")
_LENGTH = struct.Struct("<I")
_FRAME = struct.Struct("<III")
"""payload bytes, CRC-32 of the 4 bytes before, payload CRC-32."""


@dataclass(frozen=True, slots=True)
class JournalHeader:
    """What a journal's slabs are valid for: a replay refuses a journal whose header differs."""

    fingerprint: bytes
    """The engine's fingerprint (`glue/scheduler/fingerprint.py`) as bytes; where both are a
    JSON object, a mismatch names the keys that differ."""
    geometry: HostGeometry
    tensor_parallel_size: int

    def encode(self) -> bytes:
        return _HEADER.pack(*self._fields()) + self.fingerprint

    def _fields(self) -> tuple[int, int, int, int]:
        g = self.geometry
        return g.block_bytes, g.image_bytes, g.slab_bytes, self.tensor_parallel_size

    def check(self, found: bytes) -> None:
        """HeaderMismatch naming each field of the header ``found`` that differs from this one,
        HeaderError when it is too short to be one."""
        if len(found) < _HEADER.size:
            raise HeaderError(f"bad header: {len(found)} bytes")
        names = ("block_bytes", "image_bytes", "slab_bytes", "tensor_parallel_size")
        stored = _HEADER.unpack_from(found)
        differs, details = [], []
        fingerprint = found[_HEADER.size :]
        if fingerprint != self.fingerprint:
            keys = _fingerprint_keys(self.fingerprint, fingerprint)
            differs.append("fingerprint")
            details.append(f"fingerprint ({', '.join(keys)})" if keys else "fingerprint")
        for name, mine, theirs in zip(names, self._fields(), stored, strict=True):
            if mine != theirs:
                differs.append(name)
                details.append(f"{name} {theirs}, this engine's {mine}")
        if differs:
            raise HeaderMismatch(differs, f"another engine's journal: {'; '.join(details)}")


@dataclass(frozen=True, slots=True)
class DroppedEntry:
    """An entry the replay left out, and why (the glue logs it)."""

    offset: int
    """Where its frame starts in the file."""
    key: JournalKey | None
    """None where the entry could not be read."""
    reason: str


@dataclass(frozen=True, slots=True)
class Replay:
    """A journal's live entries, and what its replay left out."""

    live: Mapping[JournalKey, Stored]
    """In journal order: each block's parent and each snapshot's anchor before it."""
    dropped: tuple[DroppedEntry, ...]
    free_slabs: tuple[SlabId, ...]
    """Ascending: the disk slabs no live entry names."""
    entries: int
    """The entries the file holds (live or not), for `needs_compaction`."""
    next_key: JournalKey
    """Above every key the file names: where the writer's counter goes on."""

    @property
    def used_slabs(self) -> frozenset[SlabId]:
        return frozenset(slab for entry in self.live.values() for slab in entry.slabs)


def replay_journal(
    path: str | os.PathLike[str], expected: JournalHeader, slab_count: int
) -> Replay:
    """The live entries of the journal at ``path`` over a disk of ``slab_count`` slabs.

    Later Dropped entries cancel earlier ones; an entry is left out, with its reason, where it
    is damaged, malformed, hangs from an entry that is not live, or claims a slab beyond the
    disk or claimed before it. A torn last entry, or a length that fails its CRC, ends the
    replay. HeaderError (HeaderMismatch where another engine, geometry or format wrote it) when
    the header is not this engine's: the caller starts an empty tier.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        header = read_header(file, MAGIC, FORMAT_VERSION, size, "disk tier journal")
        expected.check(header)
        replayer = _Replayer(expected)
        for offset, frame in _frames(file, PRELUDE.size + len(header), size):
            replayer.apply(offset, frame)
    return replayer.result(slab_count)


def needs_compaction(live: int, total: int) -> bool:
    """Whether a journal of ``total`` entries, ``live`` of them live, is worth rewriting."""
    return total > COMPACTION_RATIO * live


class JournalWriter:
    """Appends entries to a journal `start_journal` wrote; the engine core's only writer.

    Entries wait in memory until `flush_durable`, called once per step after every rank
    reported the slabs of the entries appended durable.
    """

    def __init__(self, path: Path, header: JournalHeader, end: int, entries: int) -> None:
        self.path, self.header = path, header
        self._fd = os.open(path, os.O_WRONLY)
        self._end = end
        self._entries = entries
        self._pending: list[bytes] = []

    @property
    def entries(self) -> int:
        """The entries in the file (live or not; not those still pending)."""
        return self._entries

    def append(self, entry: Entry) -> None:
        self._pending.append(_frame(entry))

    def flush_durable(self) -> None:
        """Write the pending entries and fdatasync. On an error the file is cut back to its
        last durable end (no torn entry hides later ones) and the entries stay pending."""
        if not self._pending:
            return
        data = memoryview(b"".join(self._pending))
        try:
            written = 0
            while written < len(data):
                written += os.pwrite(self._fd, data[written:], self._end + written)
            os.fdatasync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            raise
        self._end += len(data)
        self._entries += len(self._pending)
        self._pending.clear()

    def compact(self, live: Iterable[Stored]) -> None:
        """Flush, then replace the file by one holding only ``live`` (parents first, as
        `Replay.live`). A crash or an error before the rename leaves the old file whole."""
        self.flush_durable()
        end, entries = _write_journal(self.path, self.header, live)
        fd = os.open(self.path, os.O_WRONLY)
        os.close(self._fd)
        self._fd, self._end, self._entries = fd, end, entries

    def close(self) -> None:
        os.close(self._fd)


def start_journal(
    path: str | os.PathLike[str], header: JournalHeader, live: Iterable[Stored] = ()
) -> JournalWriter:
    """Write a journal of ``live`` (parents first) over any file at ``path``, atomically, and
    open it for appending: at start-up, with a replay's live entries or none."""
    target = Path(path)
    end, entries = _write_journal(target, header, live)
    return JournalWriter(target, header, end, entries)


def _write_journal(path: Path, header: JournalHeader, live: Iterable[Stored]) -> tuple[int, int]:
    """Write, fsync and rename into place; the file's size and entry count."""
    fd, temporary = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(pack_header(MAGIC, FORMAT_VERSION, header.encode()))
            entries = 0
            for entry in live:
                file.write(_frame(entry))
                entries += 1
            file.flush()
            os.fsync(file.fileno())
            end = file.tell()
        replace_durably(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    return end, entries


def _frame(entry: Entry) -> bytes:
    payload = encode_entry(entry)
    if len(payload) > MAX_ENTRY_BYTES:
        raise ValueError(f"an entry of {len(payload)} bytes (at most {MAX_ENTRY_BYTES})")
    length = len(payload)
    return _FRAME.pack(length, zlib.crc32(_LENGTH.pack(length)), zlib.crc32(payload)) + payload


def _frames(file: BinaryIO, at: int, size: int) -> Iterator[tuple[int, Entry | str]]:
    """Each frame's offset with its entry, or why it is not read; ends after a frame that
    ends the replay."""
    while at < size:
        head = file.read(_FRAME.size)
        if len(head) < _FRAME.size:
            yield at, f"torn: {len(head)} bytes of a frame head at the end"
            return
        length, length_crc, crc = _FRAME.unpack(head)
        if length_crc != zlib.crc32(head[: _LENGTH.size]) or length > MAX_ENTRY_BYTES:
            unread = size - at
            yield at, f"its length fails its CRC (damaged or torn): {unread} bytes unread"
            return
        payload = file.read(length)
        end = at + _FRAME.size + length
        if len(payload) < length:
            yield at, f"torn: the last entry has {len(payload)} of its {length} bytes"
            return
        if zlib.crc32(payload) != crc:
            last = end == size
            yield at, "torn: the last entry fails its CRC" if last else "fails its CRC, skipped"
            at = end
            continue
        try:
            yield at, decode_entry(payload)
        except ValueError as exc:
            yield at, str(exc)
        at = end


class _Replayer:
    """Applies entries in journal order, then keeps those whose parents and slabs hold."""

    def __init__(self, header: JournalHeader) -> None:
        self.header = header
        self.live: dict[JournalKey, tuple[int, Stored]] = {}
        self.gone: dict[JournalKey, str] = {}
        """How each key that was live went, for the reasons of what hung from it."""
        self.dropped: list[DroppedEntry] = []
        self.entries = 0
        self.next_key = 0

    def apply(self, offset: int, frame: Entry | str) -> None:
        self.entries += 1
        if isinstance(frame, str):
            self.dropped.append(DroppedEntry(offset, None, frame))
            return
        self.next_key = max(self.next_key, frame.key + 1)
        if isinstance(frame, Dropped):
            # A key not live (its entry damaged, or gone with its parent) changes nothing.
            if self.live.pop(frame.key, None) is not None:
                self.gone[frame.key] = f"dropped at offset {offset}"
            return
        parent = _parent(frame)
        if not isinstance(parent, TenantRoot):
            self.next_key = max(self.next_key, parent + 1)
        earlier = self.live.get(frame.key)
        if earlier is not None:  # the live one stays, and what hangs from it
            again = f"key {frame.key} is live already (offset {earlier[0]})"
            self.dropped.append(DroppedEntry(offset, frame.key, again))
            return
        reason = _malformed(frame, self.header)
        if reason is None:
            self.live[frame.key] = (offset, frame)
        else:
            self.drop(offset, frame.key, reason)

    def drop(self, offset: int, key: JournalKey, reason: str) -> None:
        self.dropped.append(DroppedEntry(offset, key, reason))
        self.gone[key] = f"left out at offset {offset}"

    def result(self, slab_count: int) -> Replay:
        kept: dict[JournalKey, Stored] = {}
        owners: dict[SlabId, JournalKey] = {}
        for key, (offset, entry) in self.live.items():
            reason = self.parent_problem(entry, kept) or _slab_problem(entry, owners, slab_count)
            if reason is not None:
                self.drop(offset, key, reason)
                continue
            kept[key] = entry
            owners.update((slab, key) for slab in entry.slabs)
        free = tuple(SlabId(slab) for slab in range(slab_count) if slab not in owners)
        self.dropped.sort(key=lambda d: d.offset)
        return Replay(kept, tuple(self.dropped), free, self.entries, JournalKey(self.next_key))

    def parent_problem(self, entry: Stored, kept: Mapping[JournalKey, Stored]) -> str | None:
        parent = _parent(entry)
        if isinstance(parent, TenantRoot):
            return None
        role = "parent" if isinstance(entry, BlockOnDisk) else "anchor"
        if isinstance(kept.get(parent), BlockOnDisk):
            return None
        if parent in kept:
            return f"its {role} {parent} is a snapshot"
        how = self.gone.get(parent, "not in the journal before it (never written, or damaged)")
        return f"its {role} {parent} is {how}"


def _parent(entry: Stored) -> Parent:
    return entry.parent if isinstance(entry, BlockOnDisk) else entry.anchor


def _malformed(entry: Stored, header: JournalHeader) -> str | None:
    ranks = header.tensor_parallel_size
    if len(entry.crcs) != ranks:
        return f"{len(entry.crcs)} CRCs for {ranks} ranks"
    if isinstance(entry, BlockOnDisk):
        if len(entry.tokens) != BLOCK_TOKENS:
            return f"a block of {len(entry.tokens)} tokens"
        return None
    if len(entry.image_slabs) != header.geometry.image_slabs:
        return f"an image of {len(entry.image_slabs)} slabs, not {header.geometry.image_slabs}"
    if len(entry.tail_tokens) >= BLOCK_TOKENS:
        return f"a tail of {len(entry.tail_tokens)} tokens"
    if (entry.tail_slab is None) != (not entry.tail_tokens):
        return "a tail slab without tail tokens, or tail tokens without one"
    return None


def _slab_problem(
    entry: Stored, owners: Mapping[SlabId, JournalKey], slab_count: int
) -> str | None:
    seen: set[SlabId] = set()
    for slab in entry.slabs:
        if slab >= slab_count:
            return f"slab {slab} is beyond the disk's {slab_count}"
        if slab in owners:
            return f"slab {slab} is claimed by entry {owners[slab]} before it"
        if slab in seen:
            return f"slab {slab} is named twice"
        seen.add(slab)
    return None


def _fingerprint_keys(expected: bytes, found: bytes) -> list[str]:
    """The differing keys where both fingerprints are JSON objects, else none."""
    try:
        wanted, stored = json.loads(expected), json.loads(found)
    except ValueError:
        return []
    if not (isinstance(wanted, dict) and isinstance(stored, dict)):
        return []
    return differing_keys(wanted, stored)
