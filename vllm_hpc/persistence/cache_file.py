"""The prefix cache file (`--prefix-cache-file`, §5.5): header, tables, then slab sections.

Layout (little-endian; D is the first 4 KiB boundary after the header)::

    0   magic (8) | format version (u32) | header bytes (u32) | header CRC-32 (u32)
    20  header: UTF-8 JSON {fingerprint, data_bytes, tables, sections}
    D   tables: the save's records (`tables.encode_tables`), CRC-32 in the header
        per section, 4 KiB-aligned: one slab_bytes record per saved slab, ascending slab
        id, then one CRC-32 per slab and a CRC-32 of that list

Offsets in the header are relative to D, so the header can be written first. A reader decides
from the header, the tables and the slab checksum lists, before it reads any slab bytes, and
reads only the slabs it keeps. Sections are per tensor-parallel rank: each rank's worker holds
its own bytes of every slab; a file holds one section per rank that saved.

Writing goes to a temporary file in the same directory, fsynced and renamed into place, so a
failed or cancelled save leaves the previous file as it was. The engine core lays the save out
(`begin_cache_file`), each rank's worker writes its own section into it (`write_section`), and
the engine core renames it once every rank is done (`commit`).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vllm_hpc.index.saved_cache import SavedCache
from vllm_hpc.index.types import SlabId
from vllm_hpc.persistence.header import (
    PRELUDE,
    HeaderError,
    differing_keys,
    pack_header,
    read_header,
)
from vllm_hpc.persistence.replacement import replace_durably, temporary_beside
from vllm_hpc.persistence.tables import decode_tables, encode_tables

MAGIC = b"VHPCPFX\x00"
FORMAT_VERSION = 1
ALIGN = 4096
PROGRESS_BYTES = 64 << 20
"""Progress is reported about this often, and once at the end."""

Progress = Callable[[int, int], None]
"""``(bytes done, bytes in all)``."""
SlabSource = Callable[[SlabId], bytes]
"""One saved slab's bytes on this section's rank (slab_bytes long)."""
SlabTarget = Callable[[SlabId], memoryview]
"""The writable buffer, slab_bytes long, that one saved slab's bytes are read into."""


@dataclass(frozen=True, slots=True)
class Section:
    """One rank's slab bytes: ``slabs`` records of ``slab_bytes``, then their checksums."""

    rank: int
    offset: int
    """From the start of the data (D)."""
    slab_bytes: int
    checksums: tuple[int, ...] = ()
    """Per slab, in the tables' slab order (filled in by the reader)."""

    def checksums_offset(self, slabs: int) -> int:
        return self.offset + slabs * self.slab_bytes


@dataclass(frozen=True, slots=True)
class CacheFile:
    """A file whose header, fingerprint, tables and checksum lists are valid."""

    path: Path
    saved: SavedCache
    sections: tuple[Section, ...]
    data_offset: int
    """D: where the data starts in the file."""
    identity: tuple[int, int, int, int]
    """(device, inode, size, mtime ns) when opened: whether another open saw the same file."""

    def section(self, rank: int) -> Section | None:
        return next((s for s in self.sections if s.rank == rank), None)

    def read_slabs(
        self,
        rank: int,
        wanted: Iterable[SlabId],
        target: SlabTarget,
        progress: Progress | None = None,
        cancel: Callable[[], bool] = lambda: False,
    ) -> str | None:
        """Read each wanted saved slab of ``rank``'s section straight into the buffer
        ``target`` gives for it (the host tier's own slab: no copy through Python), then check
        it against its checksum; None when all arrived, else why not (the buffers read so far
        hold bytes, the last one damaged ones: the caller drops what the load built).
        ``cancel`` is asked before each slab."""
        section = self.section(rank)
        if section is None:
            return f"no slab section for rank {rank}"
        position = {slab: i for i, slab in enumerate(self.saved.slabs)}
        try:
            order = sorted(position[slab] for slab in set(wanted))
        except KeyError as exc:
            return f"slab {exc} is not in the file"
        size = section.slab_bytes
        meter = _Meter(len(order) * size, progress)
        try:
            with open(self.path, "rb", buffering=0) as file:
                for index in order:
                    if cancel():
                        return "cancelled"
                    buffer = target(self.saved.slabs[index])
                    file.seek(self.data_offset + section.offset + index * size)
                    if _read_into(file, buffer) != size:
                        return "truncated in a slab section"
                    if zlib.crc32(buffer) != section.checksums[index]:
                        return f"bad checksum in rank {rank}'s slab section"
                    meter.add(size)
        except OSError as exc:
            return f"cannot read the file: {exc}"
        meter.done()
        return None


@dataclass(frozen=True, slots=True)
class PendingFile:
    """A save in progress: its temporary file holds the header and tables and has room for
    every rank's section. With tensor parallelism each rank's worker writes its own section
    (`write_section`) into the one temporary file; `commit` renames it into place once all
    did, `abandon` removes it, so a failed or cancelled save leaves the previous file alone."""

    target: Path
    temporary: Path
    data_offset: int
    total: int
    slabs: tuple[SlabId, ...]
    slab_bytes: int
    sections: tuple[Section, ...]

    def section(self, rank: int) -> Section:
        found = next((s for s in self.sections if s.rank == rank), None)
        if found is None:
            raise ValueError(f"the save has no section for rank {rank}")
        return found


def begin_cache_file(
    path: str | os.PathLike[str],
    fingerprint: Mapping[str, Any],
    saved: SavedCache,
    ranks: Iterable[int],
) -> PendingFile:
    """Lay out a save of ``saved`` with one slab section per rank of ``ranks``, and write its
    header and tables to a temporary file beside ``path``, sized for every section."""
    target = Path(path)
    slabs, slab_bytes = tuple(saved.slabs), saved.geometry.slab_bytes
    tables = encode_tables(saved)
    layout, data_bytes = [], _align(len(tables))
    for rank in sorted(set(ranks)):
        layout.append(Section(rank, data_bytes, slab_bytes))
        data_bytes = _align(data_bytes + len(slabs) * slab_bytes + 4 * (len(slabs) + 1))
    header = json.dumps(
        {
            "fingerprint": dict(fingerprint),
            "data_bytes": data_bytes,
            "slabs": len(slabs),
            "tables": {"offset": 0, "bytes": len(tables), "crc32": zlib.crc32(tables)},
            "sections": [
                {"rank": s.rank, "offset": s.offset, "slab_bytes": s.slab_bytes} for s in layout
            ],
        },
        sort_keys=True,
    ).encode()
    data_offset = _align(PRELUDE.size + len(header))
    total = data_offset + data_bytes
    fd, temporary = temporary_beside(target)
    pending = PendingFile(target, temporary, data_offset, total, slabs, slab_bytes, tuple(layout))
    try:
        with os.fdopen(fd, "wb") as file:
            _pad_write(file, pack_header(MAGIC, FORMAT_VERSION, header), data_offset)
            _pad_write(file, tables)
            file.truncate(total)  # every section's room (sparse until written)
    except BaseException:
        abandon(pending)
        raise
    return pending


def write_section(
    pending: PendingFile,
    rank: int,
    source: SlabSource,
    *,
    progress: Progress | None = None,
    cancel: Callable[[], bool] = lambda: False,
) -> bool:
    """Write ``rank``'s slab bytes and their checksums into its section of the temporary file
    and make them durable; False when ``cancel`` answered True (asked before each slab). The
    caller abandons the save on False or an error."""
    section = pending.section(rank)
    meter = _Meter(len(pending.slabs) * pending.slab_bytes, progress)
    with open(pending.temporary, "r+b", buffering=1 << 20) as file:
        file.seek(pending.data_offset + section.offset)
        checksums = []
        for slab in pending.slabs:
            if cancel():
                return False
            record = source(slab)
            if len(record) != pending.slab_bytes:
                raise ValueError(f"slab {slab} has {len(record)} bytes, not {pending.slab_bytes}")
            checksums.append(zlib.crc32(record))
            file.write(record)
            meter.add(pending.slab_bytes)
        listed = struct.pack(f"<{len(checksums)}I", *checksums)
        file.write(listed + struct.pack("<I", zlib.crc32(listed)))
        file.flush()
        os.fsync(file.fileno())
    meter.done()
    return True


def commit(pending: PendingFile) -> int:
    """Rename the save into place once every section is written; returns the file's size."""
    replace_durably(pending.temporary, pending.target)
    return pending.total


def abandon(pending: PendingFile) -> None:
    """Remove the save's temporary file; any previous file at the target stays as it was."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pending.temporary)


def write_cache_file(
    path: str | os.PathLike[str],
    fingerprint: Mapping[str, Any],
    saved: SavedCache,
    sections: Mapping[int, SlabSource],
    *,
    progress: Progress | None = None,
    cancel: Callable[[], bool] = lambda: False,
) -> int | None:
    """Write ``saved`` and, per rank, its slabs' bytes atomically at ``path``, in one process.

    Returns the file's size, or None when ``cancel`` answered True (asked before each slab and
    before the rename). A cancelled or failed save (the error is raised again) removes its
    temporary file and leaves any previous file at ``path`` untouched.
    """
    pending = begin_cache_file(path, fingerprint, saved, sections)
    try:
        for rank in sorted(sections):
            if not write_section(pending, rank, sections[rank], progress=progress, cancel=cancel):
                abandon(pending)
                return None
        if cancel():
            abandon(pending)
            return None
        return commit(pending)
    except BaseException:
        abandon(pending)
        raise


def open_cache_file(
    path: str | os.PathLike[str], fingerprint: Mapping[str, Any] | None
) -> CacheFile | str:
    """The file's validated header, tables and checksum lists, or why it cannot be used.

    Never raises for a bad file: a truncated or damaged one, another engine's (the differing
    fingerprint keys are named), another format version or not a prefix cache file at all.
    ``fingerprint`` None skips that one check: for a reader whose bytes are used only once the
    engine core has checked the same file (a worker's read during start-up).
    """
    target = Path(path)
    try:
        with open(target, "rb") as file:
            return _open(target, file, fingerprint)
    except FileNotFoundError:
        return f"no file at {target}"
    except OSError as exc:
        return f"cannot read the file: {exc}"
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        return f"malformed: {exc!r}"


def _open(target: Path, file: BinaryIO, expected: Mapping[str, Any] | None) -> CacheFile | str:
    stat = os.fstat(file.fileno())
    size = stat.st_size
    try:
        header_raw = read_header(file, MAGIC, FORMAT_VERSION, size, "prefix cache file")
    except HeaderError as exc:
        return str(exc)
    try:
        header = json.loads(header_raw)
        data_offset = _align(PRELUDE.size + len(header_raw))
        expected_size = data_offset + int(header["data_bytes"])
        tables_entry = header["tables"]
        slab_count = int(header["slabs"])
        layout = [
            Section(int(s["rank"]), int(s["offset"]), int(s["slab_bytes"]))
            for s in header["sections"]
        ]
        found = dict(header["fingerprint"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"bad header: {exc!r}"
    if size != expected_size:
        which = "truncated" if size < expected_size else "longer than its header says"
        return f"{which}: {size} bytes, the header says {expected_size}"
    wanted = found if expected is None else json.loads(json.dumps(dict(expected)))
    differing = differing_keys(wanted, found)
    if differing:
        return f"foreign fingerprint: {', '.join(differing)} differ"
    file.seek(data_offset + int(tables_entry["offset"]))
    tables = file.read(int(tables_entry["bytes"]))
    if zlib.crc32(tables) != tables_entry["crc32"]:
        return "bad checksum in the tables"
    try:
        saved = decode_tables(tables)
    except ValueError as exc:
        return str(exc)
    if len(saved.slabs) != slab_count:
        return f"the tables name {len(saved.slabs)} slabs, the header {slab_count}"
    sections = []
    for section in layout:
        if section.slab_bytes != saved.geometry.slab_bytes:
            return f"rank {section.rank}'s slabs are not {saved.geometry.slab_bytes} bytes"
        file.seek(data_offset + section.checksums_offset(slab_count))
        listed = file.read(4 * slab_count)
        (listed_crc,) = struct.unpack("<I", file.read(4))
        if zlib.crc32(listed) != listed_crc:
            return f"bad checksum in rank {section.rank}'s slab checksums"
        checksums = struct.unpack(f"<{slab_count}I", listed)
        sections.append(Section(section.rank, section.offset, section.slab_bytes, checksums))
    identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return CacheFile(target, saved, tuple(sections), data_offset, identity)


class _Meter:
    """Reports progress about every PROGRESS_BYTES, so a large file logs a few lines."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.progress = total, progress
        self.done_bytes = self.reported = 0

    def add(self, count: int) -> None:
        self.done_bytes += count
        if self.progress and self.done_bytes - self.reported >= PROGRESS_BYTES:
            self.reported = self.done_bytes
            self.progress(self.done_bytes, self.total)

    def done(self) -> None:
        if self.progress:
            self.progress(self.total, self.total)


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _pad_write(file: BinaryIO, data: bytes, end: int | None = None) -> None:
    """Write ``data``, then zeros up to file offset ``end`` (default: no padding)."""
    file.write(data)
    if end is not None:
        file.write(bytes(end - file.tell()))


def _read_into(file: Any, buffer: memoryview) -> int:
    """Fill ``buffer`` from ``file``'s position; the bytes read (fewer only at the end)."""
    done = 0
    while done < len(buffer):
        count = file.readinto(buffer[done:])
        if not count:
            break
        done += count
    return done
