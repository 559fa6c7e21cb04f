"""The disk tier's bytes in a worker: its rank's slab file and the I/O in and out of it (#50).

One file per tensor-parallel rank (`disk_slab_path`) of fixed-size slabs, each the host tier's
slab size (a 4 KiB multiple), preallocated to the budget at start-up so that a full disk is
refused then, naming the option, and not found by a write later. The index decides which disk
slab holds what; this only moves bytes between disk slabs and host slabs.

The I/O path is the one `docs/notes/disk-io.md` measured: O_DIRECT ``preadv``/``pwritev`` from
a small thread pool (they release the GIL) into page-aligned memory, buffered I/O where the
filesystem refuses O_DIRECT (then ``posix_fadvise(DONTNEED)`` after each read and each write
batch's ``fdatasync``, so the page cache keeps no second copy of the host tier). Adjacent disk
slabs move in one call with a buffer per slab: small I/O is bound by its number of calls.

The unit of checking is a record (a block: one slab; a snapshot: its image slabs, then its tail
slab), as the journal stores it: a write reports each record's CRC-32 over its bytes in order,
and a read checks it. Slabs are checksummed on the pool's threads, in parallel, and chained
with `CrcChain`. The engine thread only submits and polls: nothing here blocks it.

Standard library only (no torch): host slabs arrive as memoryviews (a `HostArena` slab as
``memoryview(arena.slab(i).numpy())``), and `benchmarks/disk_io.py` shares the aligned-I/O
helpers without importing torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import logging
import mmap
import os
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from vllm_hpc.faults import SLOW_DISK_SECONDS, armed

if TYPE_CHECKING:
    from vllm_hpc.index.types import SlabId

logger = logging.getLogger("vllm.vllm_hpc")

ALIGN = 4096
"""O_DIRECT's alignment of offsets, lengths and buffer addresses (a page; at least the logical
block size of every disk seen)."""
GIB = 1 << 30
_MASK = 0xFFFFFFFF
_IOV_MAX = os.sysconf("SC_IOV_MAX")
"""The most buffers one ``preadv``/``pwritev`` takes: a longer run is split."""


class DiskTierError(RuntimeError):
    """The disk tier cannot start; the message names the option to change."""


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as pinned host memory is (O_DIRECT needs the alignment;
    torch's CPU allocator gives only 64 bytes)."""
    return mmap.mmap(-1, nbytes)


def direct_refusal(path: Path, nbytes: int) -> str | None:
    """Why the filesystem refuses O_DIRECT at ``path``, or None: it opens the file O_DIRECT
    (creating it if missing), reads ``nbytes`` at offset 0 into page-aligned memory and writes
    them back, since some filesystems accept the open and refuse the first I/O (EINVAL)."""
    buffer = aligned_buffer(nbytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            os.preadv(fd, [buffer], 0)
            os.pwritev(fd, [buffer], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0, '?')})"
    finally:
        buffer.close()
    return None


def is_aligned(view: memoryview) -> bool:
    """Whether a (writable) buffer starts on an O_DIRECT boundary."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor) % ALIGN == 0
    finally:
        del anchor


def disk_slab_path(directory: str | Path, engine: int, rank: int) -> Path:
    """``DIR/engine{k}/rank{r}.slabs``: engine core ``k``'s (its data-parallel index) slab file
    of tensor-parallel rank ``r``, beside that engine core's journal."""
    return Path(directory) / f"engine{engine}" / f"rank{rank}.slabs"


def disk_journal_path(directory: str | Path, engine: int) -> Path:
    """``DIR/engine{k}/journal``: engine core ``k``'s journal, beside its ranks' slab files
    (written by the engine core, which imports this standard-library module for the name)."""
    return disk_slab_path(directory, engine, 0).with_name("journal")


def io_depth(slab_bytes: int) -> int:
    """Threads per direction: clamp(16 MiB / slab, 4, 16), disk-io.md's starting rule (four
    4 MiB reads reached the disk's bandwidth; small records needed more in flight)."""
    return min(16, max(4, (16 << 20) // slab_bytes))


class CrcChain:
    """The CRC-32 of consecutive slabs' bytes from each slab's own CRC-32, so that slabs are
    checksummed in parallel and a record still gets the one CRC the journal stores.

    ``crc32(a + b) == M(crc32(a)) ^ crc32(b)``, where ``M`` is the linear map that advances the
    CRC register over ``len(b)`` zero bytes (zlib's ``crc32_combine``, which Python does not
    expose). Every slab has the same length, so ``M`` is built once, as 32 columns."""

    def __init__(self, slab_bytes: int) -> None:
        if slab_bytes % ALIGN:
            raise ValueError(f"slab bytes {slab_bytes} are not a multiple of {ALIGN}")
        zeros = bytes(ALIGN)
        # Column i: the raw register e_i after ALIGN zero bytes (zlib inverts in and out).
        page = [zlib.crc32(zeros, ~(1 << i) & _MASK) ^ _MASK for i in range(32)]
        self._columns = _power(page, slab_bytes // ALIGN)

    def chain(self, crcs: Sequence[int]) -> int:
        """The CRC-32 of the slabs whose CRCs these are, concatenated in this order."""
        total = 0
        for crc in crcs:
            total = _apply(self._columns, total) ^ crc
        return total


def _apply(columns: Sequence[int], vector: int) -> int:
    out, index = 0, 0
    while vector:
        if vector & 1:
            out ^= columns[index]
        vector >>= 1
        index += 1
    return out


def _power(columns: list[int], times: int) -> list[int]:
    """The map applied ``times`` times (square and multiply)."""
    result = [1 << i for i in range(32)]
    while times:
        if times & 1:
            result = [_apply(columns, column) for column in result]
        columns = [_apply(columns, column) for column in columns]
        times >>= 1
    return result


class DiskSlabFile:
    """One rank's slab file, preallocated, with a buffered descriptor and, where the filesystem
    allows it, an O_DIRECT one. Its calls block: `DiskStore` runs them on its threads."""

    def __init__(self, path: Path, slab_bytes: int, slab_count: int, direct: bool = True) -> None:
        """Create (or reopen) the file and preallocate it to ``slab_count`` slabs; a larger file
        from a larger budget is cut to it (the journal's replay drops entries beyond it).
        ``direct=False`` skips O_DIRECT (tests; a filesystem known to misbehave)."""
        if slab_bytes <= 0 or slab_bytes % ALIGN:
            raise ValueError(f"disk slabs of {slab_bytes} bytes are not a multiple of {ALIGN}")
        if slab_count <= 0:
            raise ValueError(f"a disk tier of {slab_count} slabs")
        self.path, self.slab_bytes, self.slab_count = path, slab_bytes, slab_count
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise DiskTierError(
                f"hybrid-prefix disk tier: cannot create {path} ({error}): choose a writable "
                "--disk-cache-dir"
            ) from error
        self._direct_fd: int | None = None
        try:
            self._preallocate()
            refused = direct_refusal(path, slab_bytes) if direct else "not asked for"
            if refused is None:
                self._direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except BaseException:
            os.close(self._fd)
            raise
        logger.info(
            "hybrid-prefix disk tier: %s, %d slabs of %.2f MiB (%.2f GiB), %s",
            path,
            slab_count,
            slab_bytes / 2**20,
            self.nbytes / GIB,
            "O_DIRECT" if refused is None else f"buffered I/O (O_DIRECT {refused})",
        )

    @property
    def nbytes(self) -> int:
        return self.slab_bytes * self.slab_count

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT is in use (for page-aligned host slabs)."""
        return self._direct_fd is not None

    def _preallocate(self) -> None:
        """Reserve every slab's blocks now; refuse a budget the filesystem cannot hold before
        allocating any of it (``posix_fallocate`` may fill the disk before it fails)."""
        before = os.fstat(self._fd)
        if before.st_size > self.nbytes:
            os.ftruncate(self._fd, self.nbytes)
        vfs = os.statvfs(self.path.parent)
        free = vfs.f_bavail * vfs.f_frsize
        missing = self.nbytes - min(self.nbytes, before.st_blocks * 512)
        reason = f"{free / GIB:.2f} GiB free" if missing > free else None
        if reason is None:
            try:
                os.posix_fallocate(self._fd, 0, self.nbytes)
            except OSError as error:
                if os.fstat(self._fd).st_size > before.st_size:
                    os.ftruncate(self._fd, before.st_size)
                reason = f"{error.strerror}, {free / GIB:.2f} GiB free"
        if reason is not None:
            raise DiskTierError(
                f"hybrid-prefix disk tier: cannot preallocate {self.nbytes / GIB:.2f} GiB for "
                f"{self.path} ({reason}): lower --disk-cache-gib or choose another "
                "--disk-cache-dir"
            )

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None:
                os.close(fd)
        self._direct_fd = None

    def write_run(self, first: int, views: Sequence[memoryview], direct: bool) -> None:
        """Write ``views`` to consecutive slabs from ``first``, all of them (a short write's rest
        is written again); raises OSError."""
        fd = self._descriptor(direct)
        offset, pending = first * self.slab_bytes, list(views)
        while pending:
            moved = os.pwritev(fd, pending, offset)
            if moved == 0:
                raise OSError(errno.EIO, f"{self.path}: no byte written at {offset}")
            offset += moved
            pending = _advance(pending, moved)

    def read_run(self, first: int, views: Sequence[memoryview], direct: bool) -> int:
        """Read consecutive slabs from ``first`` into ``views``: the bytes read, fewer than asked
        only where the file ends early (a truncated file); raises OSError."""
        fd = self._descriptor(direct)
        offset, pending, total = first * self.slab_bytes, list(views), 0
        while pending:
            moved = os.preadv(fd, pending, offset)
            if moved == 0:
                break
            offset += moved
            total += moved
            pending = _advance(pending, moved)
        return total

    def sync(self, buffered: Sequence[tuple[int, int]] = ()) -> None:
        """Make the written slabs durable (``fdatasync``), then drop the ``buffered`` (first
        slab, count) runs from the page cache."""
        os.fdatasync(self._fd)
        self.forget(buffered)

    def forget(self, runs: Sequence[tuple[int, int]]) -> None:
        """Drop these (first slab, count) runs from the page cache: buffered I/O went through
        it, and the host tier holds the bytes already."""
        for first, count in runs:
            offset, length = first * self.slab_bytes, count * self.slab_bytes
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _descriptor(self, direct: bool) -> int:
        return self._direct_fd if direct and self._direct_fd is not None else self._fd


def _advance(views: list[memoryview], moved: int) -> list[memoryview]:
    """The part of ``views`` after their first ``moved`` bytes."""
    while views and moved >= len(views[0]):
        moved -= len(views[0])
        views = views[1:]
    if views and moved:
        views = [views[0][moved:], *views[1:]]
    return views


@dataclass(frozen=True, slots=True)
class DiskRecord:
    """A record's disk slabs and the host slabs holding (writes) or receiving (reads) its bytes,
    pairwise, in the record's byte order. Host slabs are writable memoryviews (an O_DIRECT
    transfer needs their address)."""

    slabs: tuple[SlabId, ...]
    host: tuple[memoryview, ...]


class ReadFailure(enum.Enum):
    """Why a record read from disk is not usable: the caller drops it and recomputes."""

    CRC_MISMATCH = "crc mismatch"
    SHORT_READ = "short read"
    IO_ERROR = "I/O error"


@dataclass(frozen=True, slots=True)
class RecordFailure:
    """A record a batch could not move (a write batch keeps its first one as its error)."""

    record: int
    """Its index in the batch."""
    reason: ReadFailure
    detail: str


@dataclass(frozen=True, slots=True)
class WriteResult:
    """A write batch that ended: durable with each record's CRC-32, or not written at all."""

    crcs: tuple[int, ...]
    """Per record, in the batch's order, the CRC-32 of its bytes (the journal's); empty on an
    error."""
    nbytes: int
    seconds: float
    """From its first write to its ``fdatasync``'s end."""
    error: str | None = None
    """Why the batch is not durable (some slabs may hold its bytes; they stay free)."""


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A read batch that ended: records not listed in ``failures`` passed their CRC."""

    failures: tuple[RecordFailure, ...]
    nbytes: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failures


Result = TypeVar("Result", WriteResult, ReadResult)


class DiskHandle(Generic[Result]):
    """A batch in flight. `done` and `poll` never block; `wait` does (shutdown, tests)."""

    def __init__(self) -> None:
        self._result: Result | None = None
        self._ended = threading.Event()

    def done(self) -> bool:
        return self._ended.is_set()

    def poll(self) -> Result | None:
        """The result once the batch has ended, else None."""
        return self._result if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> Result:
        if not self._ended.wait(timeout):
            raise TimeoutError(f"disk batch still in flight after {timeout} s")
        assert self._result is not None
        return self._result

    def _end(self, result: Result) -> None:
        self._result = result
        self._ended.set()


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive disk slabs from ``first``, moved by one call; ``places`` says which record
    and which of its slabs each buffer is."""

    first: int
    views: tuple[memoryview, ...]
    places: tuple[tuple[int, int], ...]


class _Batch:
    """A batch's runs as they end on the pool's threads; the last one to end finishes it."""

    def __init__(self, records: Sequence[DiskRecord], runs: int) -> None:
        self.lock = threading.Lock()
        self.remaining = runs
        self.started: float | None = None
        self.crcs: list[list[int]] = [[0] * len(record.slabs) for record in records]
        self.failures: dict[int, RecordFailure] = {}
        self.buffered: list[tuple[int, int]] = []
        """Runs that went through the page cache: (first slab, count)."""

    def start(self) -> None:
        with self.lock:
            if self.started is None:
                self.started = time.perf_counter()

    def fail(self, record: int, reason: ReadFailure, detail: str) -> None:
        with self.lock:
            self.failures.setdefault(record, RecordFailure(record, reason, detail))

    def run_ended(self) -> bool:
        """Count a run as ended: whether it was the last."""
        with self.lock:
            self.remaining -= 1
            return self.remaining == 0

    def seconds(self) -> float:
        return 0.0 if self.started is None else time.perf_counter() - self.started


class DiskStore:
    """Write and read batches of records on one `DiskSlabFile`, off the engine thread.

    Each direction has its own pool (``depth`` threads), so reads, which a request waits for,
    never queue behind background writes, and at most ``max_batches`` batches in flight: a
    submit beyond that returns None and moves nothing, and the caller submits again at a later
    step (a write stays queued in the engine core; a read keeps its request waiting)."""

    def __init__(self, file: DiskSlabFile, depth: int | None = None, max_batches: int = 16):
        depth = depth or io_depth(file.slab_bytes)
        self.file = file
        self.max_batches = max_batches
        self._crc = CrcChain(file.slab_bytes)
        self._pools = {
            "write": ThreadPoolExecutor(depth, "vllm_hpc-disk-write"),
            "read": ThreadPoolExecutor(depth, "vllm_hpc-disk-read"),
        }
        self._in_flight = {"write": 0, "read": 0}
        self._lock = threading.Lock()
        self._closed = False
        self._warned_unaligned = False

    def submit_write(self, records: Sequence[DiskRecord]) -> DiskHandle[WriteResult] | None:
        """Write the records' host slabs to their disk slabs and ``fdatasync`` once; the
        handle's result has each record's CRC-32. The host slabs must not change until it ends.
        None when ``max_batches`` writes are in flight."""
        handle: DiskHandle[WriteResult] = DiskHandle()
        batch_bytes = self._slab_count(records) * self.file.slab_bytes

        def finish(batch: _Batch) -> None:
            error = next((f.detail for f in batch.failures.values()), None)
            if error is None and batch_bytes:
                try:
                    self.file.sync(batch.buffered)
                except OSError as exc:
                    error = f"fdatasync: {exc}"
            crcs = () if error else tuple(self._crc.chain(crcs) for crcs in batch.crcs)
            self._end("write", handle, WriteResult(crcs, batch_bytes, batch.seconds(), error))

        return self._submit("write", records, self._write_run, finish, handle)

    def submit_read(
        self, records: Sequence[DiskRecord], crcs: Sequence[int]
    ) -> DiskHandle[ReadResult] | None:
        """Read the records' disk slabs into their host slabs and check each record against its
        CRC-32 in ``crcs``; failures are in the result, never raised. A failed record's host
        slabs hold whatever arrived. None when ``max_batches`` reads are in flight."""
        if len(crcs) != len(records):
            raise ValueError(f"{len(crcs)} CRCs for {len(records)} records")
        handle: DiskHandle[ReadResult] = DiskHandle()
        batch_bytes = self._slab_count(records) * self.file.slab_bytes

        def finish(batch: _Batch) -> None:
            for index, expected in enumerate(crcs):
                read = self._crc.chain(batch.crcs[index])
                if index not in batch.failures and read != expected:
                    detail = f"expected {expected:08x}, read {read:08x}"
                    batch.fail(index, ReadFailure.CRC_MISMATCH, detail)
            with contextlib.suppress(OSError):  # only a hint to the page cache
                self.file.forget(batch.buffered)
            failures = tuple(sorted(batch.failures.values(), key=lambda f: f.record))
            self._end("read", handle, ReadResult(failures, batch_bytes, batch.seconds()))

        return self._submit("read", records, self._read_run, finish, handle)

    def close(self) -> None:
        """Let every submitted batch end, stop the threads and close the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self.file.close()

    # -- batches ----------------------------------------------------------------------------

    def _slab_count(self, records: Sequence[DiskRecord]) -> int:
        """Check the records (a caller's bug raises here, on the submitting thread)."""
        seen: set[int] = set()
        for record in records:
            if not record.slabs or len(record.slabs) != len(record.host):
                raise ValueError(f"a record of {len(record.slabs)} slabs, {len(record.host)} views")
            for slab, view in zip(record.slabs, record.host, strict=True):
                if not 0 <= slab < self.file.slab_count or slab in seen:
                    raise ValueError(f"disk slab {slab} out of range or twice in a batch")
                if view.nbytes != self.file.slab_bytes or not view.c_contiguous:
                    raise ValueError(f"a host slab of {view.nbytes} bytes (or not contiguous)")
                seen.add(slab)
        return len(seen)

    def _submit(
        self,
        kind: str,
        records: Sequence[DiskRecord],
        run: Callable[[_Batch, _Run], None],
        finish: Callable[[_Batch], None],
        handle: DiskHandle[Result],
    ) -> DiskHandle[Result] | None:
        runs = _runs(records)
        with self._lock:
            if self._closed:
                raise RuntimeError("the disk store is closed")
            if self._in_flight[kind] >= self.max_batches:
                return None
            self._in_flight[kind] += 1
        batch = _Batch(records, len(runs))
        if not runs:
            finish(batch)
            return handle

        def task(one: _Run) -> None:
            batch.start()
            try:
                run(batch, one)
            except Exception as error:  # a bug: still end the batch, as a failure
                for record, _ in one.places:
                    batch.fail(record, ReadFailure.IO_ERROR, f"{type(error).__name__}: {error}")
            if batch.run_ended():
                finish(batch)

        for one in runs:
            self._pools[kind].submit(task, one)
        return handle

    def _end(self, kind: str, handle: DiskHandle[Result], result: Result) -> None:
        with self._lock:
            self._in_flight[kind] -= 1
        handle._end(result)

    def _direct(self, run: _Run, batch: _Batch) -> bool:
        """Whether the run goes O_DIRECT: the file allows it and every buffer is page-aligned;
        otherwise buffered, and dropped from the page cache afterwards."""
        if self.file.direct and all(is_aligned(view) for view in run.views):
            return True
        if self.file.direct and not self._warned_unaligned:
            self._warned_unaligned = True
            logger.warning(
                "hybrid-prefix disk tier: host slabs not page-aligned: buffered I/O for them"
            )
        with batch.lock:
            batch.buffered.append((run.first, len(run.views)))
        return False

    def _write_run(self, batch: _Batch, run: _Run) -> None:
        """Fault points `disk_slow` (sleep first) and `disk_write` (fail before writing)."""
        if armed("disk_slow"):
            time.sleep(SLOW_DISK_SECONDS)
        try:
            if armed("disk_write"):
                raise OSError(errno.EIO, "injected disk write error")
            self.file.write_run(run.first, run.views, self._direct(run, batch))
        except OSError as error:
            for record, _ in run.places:
                batch.fail(record, ReadFailure.IO_ERROR, f"write at slab {run.first}: {error}")
            return
        for view, (record, part) in zip(run.views, run.places, strict=True):
            batch.crcs[record][part] = zlib.crc32(view)

    def _read_run(self, batch: _Batch, run: _Run) -> None:
        """Fault points `disk_slow` (sleep first), `disk_read` (the read fails with EIO) and
        `disk_bitflip` (a bit of each slab read flips before its check)."""
        if armed("disk_slow"):
            time.sleep(SLOW_DISK_SECONDS)
        try:
            if armed("disk_read"):
                raise OSError(errno.EIO, "injected disk read error")
            got = self.file.read_run(run.first, run.views, self._direct(run, batch))
        except OSError as error:
            for record, _ in run.places:
                batch.fail(record, ReadFailure.IO_ERROR, f"read at slab {run.first}: {error}")
            return
        size = self.file.slab_bytes
        for index, (view, (record, part)) in enumerate(zip(run.views, run.places, strict=True)):
            arrived = min(size, max(0, got - index * size))
            if arrived < size:
                slab = run.first + index
                batch.fail(record, ReadFailure.SHORT_READ, f"slab {slab}: {arrived} of {size}")
                continue
            if armed("disk_bitflip"):
                view[0] ^= 1
            batch.crcs[record][part] = zlib.crc32(view)


def _runs(records: Sequence[DiskRecord]) -> list[_Run]:
    """The batch's slabs in disk order, cut into runs of consecutive slabs (at most
    ``_IOV_MAX`` each)."""
    slabs: list[tuple[int, memoryview, tuple[int, int]]] = sorted(
        (
            (slab, view.cast("B"), (record, part))
            for record, item in enumerate(records)
            for part, (slab, view) in enumerate(zip(item.slabs, item.host, strict=True))
        ),
        key=lambda entry: entry[0],
    )
    runs: list[_Run] = []
    start = 0
    for end in range(1, len(slabs) + 1):
        breaks = end == len(slabs) or slabs[end][0] != slabs[end - 1][0] + 1
        if breaks or end - start == _IOV_MAX:
            part = slabs[start:end]
            views = tuple(view for _, view, _ in part)
            runs.append(_Run(part[0][0], views, tuple(place for _, _, place in part)))
            start = end
    return runs
