"""The disk tier's journal: round trip, torn tails, bit flips, header mismatches, slab claims,
compaction (and a crash in it), and random append/drop sequences against a dict model."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_hpc.persistence.disk_journal as disk_journal
from vllm_hpc.index import BLOCK_TOKENS, HostGeometry, SlabId, SnapshotKind
from vllm_hpc.persistence import (
    BlockOnDisk,
    Dropped,
    Entry,
    HeaderError,
    HeaderMismatch,
    JournalHeader,
    JournalKey,
    Parent,
    Replay,
    SnapshotOnDisk,
    Stored,
    TenantRoot,
    needs_compaction,
    remove_temporaries,
    replay_journal,
    start_journal,
)

FINGERPRINT = {"model": "tiny-qwen3.5", "dtype": "bfloat16", "block_tokens": 64, "vllm": "0.32"}
GEOMETRY = HostGeometry(block_bytes=6000, image_bytes=20000)  # 8 KiB slabs, 3 per image
HEADER = JournalHeader(json.dumps(FINGERPRINT, sort_keys=True).encode(), GEOMETRY, 2)
SLABS = 16
ROOT = TenantRoot(None)


def block(key: int, parent: Parent | int, slab: int) -> BlockOnDisk:
    up = parent if isinstance(parent, TenantRoot) else JournalKey(parent)
    tokens = tuple(key * 7 + i - 3 for i in range(BLOCK_TOKENS))
    return BlockOnDisk(
        JournalKey(key),
        up,
        tokens,
        key.to_bytes(2, "little"),
        SlabId(slab),
        (key, ~key & 0xFFFF_FFFF),
    )


def snapshot(
    key: int,
    anchor: Parent | int,
    image: Sequence[int],
    tail: int = 0,
    tail_slab: int | None = None,
) -> SnapshotOnDisk:
    up = anchor if isinstance(anchor, TenantRoot) else JournalKey(anchor)
    return SnapshotOnDisk(
        JournalKey(key),
        list(SnapshotKind)[key % 3],
        up,
        tuple(range(tail)),
        tuple(SlabId(s) for s in image),
        None if tail_slab is None else SlabId(tail_slab),
        (0xFFFF_FFFF, key),
        key * 3,
    )


def drop(key: int) -> Dropped:
    return Dropped(JournalKey(key))


ENTRIES: list[Entry] = [
    block(0, ROOT, 0),
    block(1, 0, 1),
    snapshot(2, 1, [2, 3, 4]),
    block(3, TenantRoot("tenant"), 5),
    snapshot(4, TenantRoot("é"), [6, 7, 8], tail=9, tail_slab=9),
    drop(2),
    snapshot(5, 3, [2, 3, 4], tail=1, tail_slab=10),  # reuses the dropped snapshot's slabs
    block(6, 1, 11),
]
LIVE = [0, 1, 3, 4, 5, 6]


def write(path: Path, entries: Iterable[Entry]) -> None:
    writer = start_journal(path, HEADER)
    for entry in entries:
        writer.append(entry)
    writer.flush_durable()
    writer.close()


def replay(path: Path, slabs: int = SLABS) -> Replay:
    return replay_journal(path, HEADER, slabs)


def by_key(entries: Iterable[Entry]) -> dict[JournalKey, Stored]:
    return {e.key: e for e in entries if not isinstance(e, Dropped)}


def expected_live(keys: Iterable[int]) -> dict[JournalKey, Stored]:
    every = by_key(ENTRIES)
    return {JournalKey(k): every[JournalKey(k)] for k in keys}


def frame_offsets(path: Path) -> list[int]:
    """Where each entry's frame starts, and the file's end."""
    data = path.read_bytes()
    at = 20 + struct.unpack_from("<I", data, 12)[0]
    offsets = []
    while at < len(data):
        offsets.append(at)
        at += 12 + struct.unpack_from("<I", data, at)[0]
    return [*offsets, at]


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write(path, ENTRIES)
    done = replay(path)
    assert done.live == expected_live(LIVE) and list(done.live) == LIVE
    assert done.dropped == () and done.entries == len(ENTRIES) and done.next_key == 7
    used = {0, 1, 5, 6, 7, 8, 9, 2, 3, 4, 10, 11}
    assert done.used_slabs == used and done.free_slabs == tuple(
        s for s in range(SLABS) if s not in used
    )
    assert os.listdir(tmp_path) == ["journal"]


def test_entries_wait_in_memory_until_flush_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    syncs: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        syncs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    writer = start_journal(path, HEADER)
    for entry in ENTRIES[:3]:
        writer.append(entry)
    assert replay(path).live == {} and writer.entries == 0 and syncs == []
    writer.flush_durable()
    writer.flush_durable()  # nothing pending: no write, no sync
    assert replay(path).live == expected_live([0, 1, 2]) and writer.entries == 3 and len(syncs) == 1
    writer.close()


def test_a_failed_flush_cuts_the_file_back_and_keeps_the_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half a batch written, then ENOSPC: no torn entry stays to hide the next flush."""
    path = tmp_path / "journal"
    writer = start_journal(path, HEADER)
    writer.append(ENTRIES[0])
    writer.flush_durable()
    size = path.stat().st_size
    real = os.pwrite

    def half_then_full(fd: int, data: memoryview, offset: int) -> int:
        if len(data) > 100:
            return real(fd, data[: len(data) // 2], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", half_then_full)
    for entry in ENTRIES[1:]:
        writer.append(entry)
    with pytest.raises(OSError, match="No space"):
        writer.flush_durable()
    assert path.stat().st_size == size and writer.entries == 1
    monkeypatch.setattr(os, "pwrite", real)
    writer.flush_durable()
    writer.close()
    assert replay(path).live == expected_live(LIVE) and replay(path).entries == len(ENTRIES)


def test_a_torn_last_entry_is_dropped_at_every_byte(tmp_path: Path) -> None:
    """Cut anywhere in the last entry, or its end never written (zeros): the rest replays."""
    path = tmp_path / "journal"
    write(path, ENTRIES)
    whole = path.read_bytes()
    start, end = frame_offsets(path)[-2:]
    assert end == len(whole)
    for cut in range(start, end):
        for torn in (whole[:cut], whole[:cut] + bytes(end - cut)):
            path.write_bytes(torn)
            done = replay(path)
            assert done.live == expected_live(LIVE[:-1]), cut
            if len(torn) == start:
                assert done.dropped == ()
                continue
            (dropped,) = done.dropped
            assert dropped.offset == start and dropped.key is None, cut
            assert dropped.reason.startswith(("torn", "its length fails its CRC")), dropped


def flip(data: bytes, offset: int) -> bytes:
    flipped = bytearray(data)
    flipped[offset] ^= 0x10
    return bytes(flipped)


@pytest.mark.parametrize("index", range(len(ENTRIES) - 1))
def test_a_bit_flip_drops_that_entry_and_what_hangs_from_it(tmp_path: Path, index: int) -> None:
    """Every byte of entry ``index``'s CRC and payload in turn; the entries after it replay."""
    path = tmp_path / "journal"
    write(path, ENTRIES)
    whole = path.read_bytes()
    offsets = frame_offsets(path)
    damaged = ENTRIES[index]
    lost = {
        0: [0, 1, 6],  # the root block: all of its conversation
        1: [1, 6],
        2: [],  # a dropped snapshot: nothing changes
        3: [3, 5],
        4: [4],
        5: [5],  # Dropped(2) is lost: snapshot 2 lives on and snapshot 5 cannot reuse its slabs
        6: [5],
    }[index]
    expected = {k: e for k, e in expected_live([*LIVE, 2]).items() if k not in lost}
    if index != 5:
        expected.pop(JournalKey(2))
    for at in range(offsets[index] + 8, offsets[index + 1]):
        path.write_bytes(flip(whole, at))
        done = replay(path)
        assert done.live == expected, at
        assert done.entries == len(ENTRIES)
        first, *rest = done.dropped
        assert first == disk_journal.DroppedEntry(offsets[index], None, "fails its CRC, skipped")
        assert {d.key for d in rest} == set(lost) - {damaged.key}
    if index == 5:
        assert "slab 2 is claimed by entry 2 before it" in done.dropped[1].reason
    if index == 3:
        assert done.dropped[1].reason == (
            "its anchor 3 is not in the journal before it (never written, or damaged)"
        )


def test_a_damaged_length_ends_the_replay(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write(path, ENTRIES)
    whole = path.read_bytes()
    offsets = frame_offsets(path)
    for at in range(offsets[3], offsets[3] + 8):
        path.write_bytes(flip(whole, at))
        done = replay(path)
        assert done.live == expected_live([0, 1, 2]) and done.entries == 4
        (dropped,) = done.dropped
        unread = len(whole) - offsets[3]
        assert (
            dropped.reason == f"its length fails its CRC (damaged or torn): {unread} bytes unread"
        )


def test_entries_that_do_not_hold_are_left_out_with_their_reason(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    wrong_ranks = BlockOnDisk(
        JournalKey(12), ROOT, block(12, ROOT, 12).tokens, b"", SlabId(12), (1,)
    )
    entries: list[Entry] = [
        *ENTRIES,
        block(7, 2, 12),  # under a dropped snapshot
        block(8, 5, 12),  # under a snapshot
        block(9, 40, 12),  # under a key never written
        snapshot(10, 0, [10, 12, 13]),  # slab 10 is snapshot 5's tail
        block(11, 10, 12),  # under the snapshot left out
        wrong_ranks,
        block(13, 0, 16),  # beyond the disk
        snapshot(14, 0, [12, 13, 12]),
        snapshot(15, 0, [12, 13]),
        snapshot(16, 0, [12, 13, 14], tail=1),
        block(1, ROOT, 15),  # a live key again
        drop(6),
        block(17, 6, 12),  # under a block dropped before it
        block(18, 0, 12),  # keeps slab 12: every claim above was left out
    ]
    write(path, entries)
    done = replay(path)
    assert done.live == {**expected_live(LIVE[:-1]), JournalKey(18): entries[-1]}
    assert done.next_key == 41
    reasons = {d.key: d.reason for d in done.dropped}
    assert reasons == {
        7: "its parent 2 is dropped at offset " + str(frame_offsets(path)[5]),
        8: "its parent 5 is a snapshot",
        9: "its parent 40 is not in the journal before it (never written, or damaged)",
        10: "slab 10 is claimed by entry 5 before it",
        11: f"its parent 10 is left out at offset {frame_offsets(path)[11]}",
        12: "1 CRCs for 2 ranks",
        13: "slab 16 is beyond the disk's 16",
        14: "slab 12 is named twice",
        15: "an image of 2 slabs, not 3",
        16: "a tail slab without tail tokens, or tail tokens without one",
        1: f"key 1 is live already (offset {frame_offsets(path)[1]})",
        17: f"its parent 6 is dropped at offset {frame_offsets(path)[19]}",
    }


def test_header_mismatches_are_named(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write(path, ENTRIES)
    other = {**FINGERPRINT, "model": "another", "kv_cache_dtype": "fp8"}
    cases = [
        (
            JournalHeader(json.dumps(other).encode(), GEOMETRY, 2),
            ("fingerprint",),
            "fingerprint (kv_cache_dtype, model)",
        ),
        (JournalHeader(b"opaque", GEOMETRY, 2), ("fingerprint",), "fingerprint;"),
        (
            JournalHeader(HEADER.fingerprint, HostGeometry(9000, 20000), 2),
            ("block_bytes", "slab_bytes"),
            "block_bytes 6000, this engine's 9000",
        ),
        (
            JournalHeader(HEADER.fingerprint, GEOMETRY, 4),
            ("tensor_parallel_size",),
            "tensor_parallel_size 2, this engine's 4",
        ),
    ]
    for header, differs, detail in cases:
        with pytest.raises(HeaderMismatch) as raised:
            replay_journal(path, header, SLABS)
        assert raised.value.differs == differs
        assert detail in str(raised.value) + ";"
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, 2)
    path.write_bytes(bytes(data))
    with pytest.raises(HeaderMismatch, match="format version 2, this build reads 1") as raised:
        replay(path)
    assert raised.value.differs == ("format version",)


def test_files_not_a_journal_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write(path, ENTRIES)
    whole = path.read_bytes()
    cases = {
        b"": "not a disk tier journal",
        b"VHPCPFX\x00" + whole[8:]: "not a disk tier journal",
        whole[:30]: "truncated",
        flip(whole, 25): "bad checksum in the header",
    }
    for content, reason in cases.items():
        path.write_bytes(content)
        with pytest.raises(HeaderError, match=reason):
            replay(path)


def test_needs_compaction() -> None:
    assert not needs_compaction(live=10, total=40)
    assert needs_compaction(live=10, total=41)
    assert needs_compaction(live=0, total=1) and not needs_compaction(live=0, total=0)


def churn() -> list[Entry]:
    """Block 0 stays; blocks 1.. come and go on slab 1."""
    entries: list[Entry] = [block(0, ROOT, 0)]
    for key in range(1, 30):
        entries += [block(key, 0, 1), drop(key)]
    return [*entries, block(30, 0, 1)]


def test_compaction_keeps_the_live_entries(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write(path, churn())
    before = replay(path)
    assert needs_compaction(len(before.live), before.entries)
    writer = start_journal(path, HEADER, before.live.values())
    after = replay(path)
    assert after.live == before.live and after.entries == 2 == writer.entries
    assert after.free_slabs == before.free_slabs and after.next_key == 31
    writer.append(block(31, 30, 2))
    writer.append(drop(0))  # what hangs from it goes too
    writer.compact([])  # flushes first; the caller's live set is empty
    assert replay(path).live == {} and writer.entries == 0
    writer.close()
    assert os.listdir(tmp_path) == ["journal"]


def test_a_failed_compaction_leaves_the_journal_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    writer = start_journal(path, HEADER)
    for entry in churn():
        writer.append(entry)
    writer.flush_durable()
    before = path.read_bytes()

    def full(temporary: Path, target: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_journal, "replace_durably", full)
    with pytest.raises(OSError, match="No space"):
        writer.compact(replay(path).live.values())
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["journal"]
    writer.append(block(31, 30, 2))  # the writer goes on with the old file
    writer.flush_durable()
    writer.close()
    assert list(replay(path).live) == [0, 30, 31]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_a_compaction_killed_before_its_rename_leaves_the_old_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    write(path, churn())
    before = path.read_bytes()
    script = f"""
import os, signal
from pathlib import Path
import vllm_hpc.persistence.disk_journal as disk_journal
from tests.persistence.test_disk_journal import HEADER, replay
from vllm_hpc.persistence import JournalWriter

def killed(temporary, target):
    os.kill(os.getpid(), signal.SIGKILL)

disk_journal.replace_durably = killed
path = Path({str(path)!r})
done = replay(path)
JournalWriter(path, HEADER, path.stat().st_size, done.entries).compact(done.live.values())
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    ran = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True)
    assert ran.returncode == -signal.SIGKILL, ran.stderr
    assert path.read_bytes() == before
    (temporary,) = remove_temporaries(path)
    assert temporary.name.startswith(".journal.") and os.listdir(tmp_path) == ["journal"]
    assert list(replay(path).live) == [0, 30]


class Model:
    """The journal's meaning: live entries by key; a drop takes what hangs from it too."""

    def __init__(self) -> None:
        self.live: dict[JournalKey, Stored] = {}
        self.next_key = 0
        self.free = list(range(SLABS))

    def add(self, choice: int, is_block: bool) -> Stored | None:
        blocks = [k for k, e in self.live.items() if isinstance(e, BlockOnDisk)]
        parents: list[Parent] = [ROOT, TenantRoot("a"), *blocks]
        parent = parents[choice % len(parents)]
        need = 1 if is_block else 3
        if len(self.free) < need:
            return None
        slabs, self.free = self.free[:need], self.free[need:]
        key, self.next_key = self.next_key, self.next_key + 1
        entry = block(key, parent, slabs[0]) if is_block else snapshot(key, parent, slabs)
        self.live[entry.key] = entry
        return entry

    def drop(self, choice: int) -> Dropped | None:
        if not self.live:
            return None
        key = list(self.live)[choice % len(self.live)]
        gone = {key}
        for k, e in self.live.items():  # parents come first
            if (e.parent if isinstance(e, BlockOnDisk) else e.anchor) in gone:
                gone.add(k)
        for k in gone:
            self.free += self.live.pop(k).slabs
        return Dropped(key)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["block", "snapshot", "drop", "flush", "compact"]), st.integers(0, 50)
        ),
        max_size=60,
    ),
    cut=st.integers(0, 400),
)
def test_random_appends_and_drops_replay_as_the_model(
    tmp_path: Path, steps: list[tuple[str, int]], cut: int
) -> None:
    """Any sequence replays to the model at its last flush, whatever torn bytes follow it."""
    path = tmp_path / "journal"
    model = Model()
    writer = start_journal(path, HEADER)
    durable: dict[JournalKey, Stored] = {}
    for op, choice in steps:
        if op == "flush":
            writer.flush_durable()
            durable = dict(model.live)
        elif op == "compact":
            writer.compact(model.live.values())
            durable = dict(model.live)
        else:
            entry = model.drop(choice) if op == "drop" else model.add(choice, op == "block")
            if entry is not None:
                writer.append(entry)
    writer.close()
    done = replay(path)
    assert done.live == durable
    # Only what hung from a dropped entry is reported: it went with it.
    assert all(" is dropped at offset " in d.reason for d in done.dropped)
    assert done.free_slabs == tuple(s for s in range(SLABS) if s not in done.used_slabs)
    # A crash in a write leaves part of an entry: it is dropped.
    torn = disk_journal._frame(block(99, ROOT, 0))
    with open(path, "ab") as file:
        file.write(torn[: cut % len(torn)])
    assert replay(path).live == durable
