"""The disk tier's worker store (`glue/worker/disk_store.py`) on a real file, with torch CPU
tensors as host slabs: round trips, CRC-32s as the journal stores them, damage found per
record, the O_DIRECT fallback, refusals that name the option, the bound on batches in flight
and the drain on close. No engine."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hpc import faults
from vllm_hpc.glue.worker import disk_store
from vllm_hpc.glue.worker.disk_store import (
    ALIGN,
    CrcChain,
    DiskRecord,
    DiskSlabFile,
    DiskStore,
    DiskTierError,
    ReadFailure,
    disk_slab_path,
    io_depth,
    is_aligned,
)
from vllm_hpc.index import SlabId

SLAB = 4 * ALIGN
SLABS = 32


class Host:
    """Host slabs as the arena hands them out: uint8 tensors, page-aligned (mmap-backed, as
    pinned memory is) unless ``aligned`` is False (torch's allocator, shifted off a page)."""

    def __init__(self, count: int, aligned: bool = True) -> None:
        if aligned:
            self._memory = mmap.mmap(-1, count * SLAB)
            self.tensor = torch.frombuffer(self._memory, dtype=torch.uint8)
        else:
            self.tensor = torch.empty(count * SLAB + ALIGN, dtype=torch.uint8)[64:-64]
            self.tensor = self.tensor[: count * SLAB]
        self.tensor.zero_()

    def slab(self, index: int) -> torch.Tensor:
        return self.tensor[index * SLAB : (index + 1) * SLAB]

    def view(self, index: int) -> memoryview:
        return memoryview(self.slab(index).numpy())

    def fill(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tensor.copy_(torch.randint(0, 256, self.tensor.shape, generator=generator))

    def record(self, host: list[int], disk: list[int]) -> DiskRecord:
        return DiskRecord(tuple(SlabId(s) for s in disk), tuple(self.view(h) for h in host))

    def record_bytes(self, host: list[int]) -> bytes:
        return b"".join(self.slab(h).numpy().tobytes() for h in host)


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., DiskStore]]:
    """Stores on ``tmp_path/rank0.slabs`` of `SLABS` slabs, closed at the end."""
    stores: list[DiskStore] = []

    def make(direct: bool = True, **kwargs: Any) -> DiskStore:
        file = DiskSlabFile(tmp_path / "rank0.slabs", SLAB, SLABS, direct=direct)
        stores.append(DiskStore(file, **kwargs))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


# Records: host slabs -> disk slabs. On disk they make the runs {2, 3} (two records), {5, 6, 7}
# (one record) and {10}; slabs 10 and 2 are one record, in the opposite order to the disk's.
LAYOUT = [([0], [3]), ([1, 2, 3], [5, 6, 7]), ([4, 5], [10, 2])]


def _write(store: DiskStore, host: Host, layout: list[tuple[list[int], list[int]]]) -> Any:
    handle = store.submit_write([host.record(h, d) for h, d in layout])
    assert handle is not None
    return handle.wait(10)


def _read(
    store: DiskStore, host: Host, layout: list[tuple[list[int], list[int]]], crcs: Any
) -> Any:
    handle = store.submit_read([host.record(h, d) for h, d in layout], crcs)
    assert handle is not None
    return handle.wait(10)


def _slab_per_record(store: DiskStore, count: int, seed: int) -> tuple[Host, Host, Any, Any]:
    """Random host slabs written as records of one slab each (host slab i to disk slab i): the
    source, an empty target, the layout and the CRCs."""
    source, target = Host(count), Host(count)
    source.fill(seed)
    layout = [([i], [i]) for i in range(count)]
    return source, target, layout, _write(store, source, layout).crcs


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count calls of ``os.<name>`` (buffers per call)."""
    calls: list[int] = []
    real = getattr(os, name)

    def counted(fd: int, buffers: list[memoryview], *rest: Any) -> Any:
        calls.append(len(buffers))
        return real(fd, buffers, *rest)

    monkeypatch.setattr(os, name, counted)
    return calls


def test_records_round_trip_with_adjacent_slabs_in_one_call_and_the_journals_crcs(
    open_store: Callable[..., DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    source, target = Host(8), Host(8)
    source.fill(1)
    writes = _counting(monkeypatch, "pwritev")
    written = _write(store, source, LAYOUT)
    assert written.error is None and written.nbytes == 6 * SLAB
    # One CRC-32 per record over its bytes in the record's order, as the journal stores it.
    assert written.crcs == tuple(zlib.crc32(source.record_bytes(h)) for h, _ in LAYOUT)
    assert sorted(writes) == [1, 2, 3]  # one call per run
    reads = _counting(monkeypatch, "preadv")
    read = _read(store, target, LAYOUT, written.crcs)
    assert read.ok and read.nbytes == 6 * SLAB
    assert sorted(reads) == [1, 2, 3]
    assert torch.equal(target.tensor[: 6 * SLAB], source.tensor[: 6 * SLAB])


def test_crc_chain_is_the_crc_of_the_concatenated_slabs() -> None:
    for slab_bytes in (ALIGN, 3 * ALIGN, 1 << 20):
        parts = [os.urandom(slab_bytes) for _ in range(4)]
        chain = CrcChain(slab_bytes)
        assert chain.chain([zlib.crc32(p) for p in parts]) == zlib.crc32(b"".join(parts))
        assert chain.chain([zlib.crc32(parts[0])]) == zlib.crc32(parts[0])


def test_a_bit_flipped_in_the_file_fails_only_its_record(
    open_store: Callable[..., DiskStore], tmp_path: Path
) -> None:
    store = open_store()
    source, target, layout, crcs = _slab_per_record(store, 8, seed=2)
    with open(tmp_path / "rank0.slabs", "r+b") as file:
        file.seek(4 * SLAB + 1000)
        byte = file.read(1)[0]
        file.seek(4 * SLAB + 1000)
        file.write(bytes([byte ^ 0x10]))
        file.flush()
        os.fsync(file.fileno())
    read = _read(store, target, layout, crcs)
    assert [(f.record, f.reason) for f in read.failures] == [(4, ReadFailure.CRC_MISMATCH)]
    for i in (0, 1, 2, 3, 5, 6, 7):
        assert torch.equal(target.slab(i), source.slab(i))


def test_a_truncated_file_reports_short_reads(
    open_store: Callable[..., DiskStore], tmp_path: Path
) -> None:
    store = open_store()
    source, target, layout, crcs = _slab_per_record(store, 4, seed=3)
    os.truncate(tmp_path / "rank0.slabs", 2 * SLAB + 100)
    read = _read(store, target, layout, crcs)
    assert [(f.record, f.reason) for f in read.failures] == [
        (2, ReadFailure.SHORT_READ),
        (3, ReadFailure.SHORT_READ),
    ]
    assert "100 of" in read.failures[0].detail
    assert torch.equal(target.tensor[: 2 * SLAB], source.tensor[: 2 * SLAB])


def test_a_filesystem_that_refuses_o_direct_gets_buffered_io_dropped_from_the_page_cache(
    open_store: Callable[..., DiskStore],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(disk_store, "direct_refusal", lambda path, n: "Invalid argument (EINVAL)")
    advised: list[tuple[int, int, int]] = []
    real = os.posix_fadvise

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    with caplog.at_level(logging.INFO, logger="vllm.vllm_hpc"):
        store = open_store()
    assert not store.file.direct
    assert "buffered I/O (O_DIRECT Invalid argument (EINVAL))" in caplog.text
    source, target = Host(8), Host(8)
    source.fill(4)
    written = _write(store, source, LAYOUT)
    dropped = {(offset, length) for offset, length, advice in advised}
    assert {(5 * SLAB, 3 * SLAB), (10 * SLAB, SLAB)} <= dropped
    assert all(advice == os.POSIX_FADV_DONTNEED for *_, advice in advised)
    advised.clear()
    assert _read(store, target, LAYOUT, written.crcs).ok
    assert len(advised) == 3  # one per run read
    assert torch.equal(target.tensor[: 6 * SLAB], source.tensor[: 6 * SLAB])


def test_o_direct_where_the_filesystem_allows_it_and_unaligned_host_slabs_go_buffered(
    open_store: Callable[..., DiskStore], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    allowed = disk_store.direct_refusal(tmp_path / "probe", SLAB) is None
    store = open_store()
    assert store.file.direct == allowed
    assert is_aligned(Host(1).view(0)) and not is_aligned(Host(1, aligned=False).view(0))
    source, target = Host(8, aligned=False), Host(8, aligned=False)
    source.fill(5)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_hpc"):
        written = _write(store, source, LAYOUT)
    assert ("not page-aligned" in caplog.text) == allowed
    assert _read(store, target, LAYOUT, written.crcs).ok
    assert torch.equal(target.tensor[: 6 * SLAB], source.tensor[: 6 * SLAB])


def test_a_budget_the_filesystem_cannot_hold_is_refused_naming_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "engine0" / "rank0.slabs"
    with pytest.raises(DiskTierError, match="--disk-cache-gib"):
        DiskSlabFile(path, SLAB, (1 << 50) // SLAB)  # a PiB: refused before allocating
    assert path.stat().st_size == 0

    def full(fd: int, offset: int, length: int) -> None:
        os.ftruncate(fd, length // 2)  # what a partial allocation may leave
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match=r"No space left on device.*--disk-cache-gib"):
        DiskSlabFile(path, SLAB, SLABS)
    assert path.stat().st_size == 0


def test_a_directory_that_cannot_be_created_is_refused_naming_the_option(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierError, match="--disk-cache-dir"):
        DiskSlabFile(disk_slab_path(tmp_path / "file", 0, 0), SLAB, SLABS)


def test_a_restart_reopens_the_slabs_and_a_smaller_budget_cuts_the_file(
    tmp_path: Path,
) -> None:
    path = disk_slab_path(tmp_path, 1, 2)
    assert path == tmp_path / "engine1" / "rank2.slabs"
    source, target = Host(2), Host(2)
    source.fill(6)
    layout = [([0], [0]), ([1], [SLABS - 1])]
    first = DiskStore(DiskSlabFile(path, SLAB, SLABS))
    crcs = _write(first, source, layout).crcs
    first.close()
    assert path.stat().st_size == SLABS * SLAB
    second = DiskStore(DiskSlabFile(path, SLAB, SLABS))
    assert _read(second, target, layout, crcs).ok
    second.close()
    assert torch.equal(target.tensor, source.tensor)
    DiskSlabFile(path, SLAB, SLABS // 2).close()
    assert path.stat().st_size == SLABS // 2 * SLAB


def test_many_batches_in_flight_at_once(open_store: Callable[..., DiskStore]) -> None:
    store = open_store(depth=4, max_batches=SLABS)
    source, target = Host(SLABS), Host(SLABS)
    source.fill(7)
    order = torch.randperm(SLABS, generator=torch.Generator().manual_seed(8)).tolist()
    layouts = [[([h], [d])] for h, d in enumerate(order)]
    writes = [store.submit_write([source.record(h, d) for h, d in one]) for one in layouts]
    results = [handle.wait(10) for handle in writes if handle is not None]
    assert len(results) == SLABS and all(r.error is None for r in results)
    reads = [
        store.submit_read([target.record(h, d) for h, d in one], r.crcs)
        for one, r in zip(layouts, results, strict=True)
    ]
    assert all(handle is not None and handle.wait(10).ok for handle in reads)
    assert torch.equal(target.tensor, source.tensor)


def test_a_full_store_refuses_a_batch_without_blocking_and_close_drains(
    open_store: Callable[..., DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "_ARMED", frozenset({"disk_slow"}))
    monkeypatch.setattr(disk_store, "SLOW_DISK_SECONDS", 0.3)  # long enough on a busy machine
    store = open_store(depth=1, max_batches=2)
    source = Host(4)
    source.fill(9)
    handles = [store.submit_write([source.record([i], [i])]) for i in range(3)]
    assert handles[2] is None  # two in flight: the caller submits again at a later step
    first = handles[0]
    assert first is not None and not first.done() and first.poll() is None
    assert first.wait(10).error is None
    retried = store.submit_write([source.record([2], [2])])
    assert retried is not None
    store.close()  # waits for the batches still in flight
    assert retried.done() and handles[1] is not None and handles[1].done()
    assert retried.poll() is not None and retried.poll().crcs == (zlib.crc32(source.view(2)),)
    with pytest.raises(RuntimeError, match="closed"):
        store.submit_write([source.record([3], [3])])


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("disk_read", ReadFailure.IO_ERROR), ("disk_bitflip", ReadFailure.CRC_MISMATCH)],
)
def test_injected_read_faults_fail_every_record_and_raise_nothing(
    open_store: Callable[..., DiskStore],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    reason: ReadFailure,
) -> None:
    store = open_store()
    source, target = Host(8), Host(8)
    source.fill(10)
    crcs = _write(store, source, LAYOUT).crcs
    monkeypatch.setattr(faults, "_ARMED", frozenset({fault}))
    read = _read(store, target, LAYOUT, crcs)
    assert [(f.record, f.reason) for f in read.failures] == [(i, reason) for i in range(3)]


def test_an_injected_write_error_reports_the_batch_not_durable(
    open_store: Callable[..., DiskStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "_ARMED", frozenset({"disk_write"}))
    store = open_store()
    source = Host(8)
    written = _write(store, source, LAYOUT)
    assert written.crcs == () and written.error is not None and "injected" in written.error


def test_a_malformed_batch_raises_on_the_submitting_thread(
    open_store: Callable[..., DiskStore],
) -> None:
    store = open_store()
    host = Host(2)
    with pytest.raises(ValueError, match="twice"):
        store.submit_write([host.record([0], [1]), host.record([1], [1])])
    with pytest.raises(ValueError, match="out of range"):
        store.submit_write([host.record([0], [SLABS])])
    with pytest.raises(ValueError, match="CRCs"):
        store.submit_read([host.record([0], [0])], [])
    assert io_depth(4 << 20) == 4 and io_depth(SLAB) == 16
