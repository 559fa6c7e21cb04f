"""The prefix cache file (§5.5): round trip, damage of every kind, atomic and cancelled saves."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.index.harness import BLOCK, Harness, make_index, toks
from vllm_hpc.index import SavedCache, SlabId
from vllm_hpc.persistence import (
    FORMAT_VERSION,
    CacheFile,
    abandon,
    begin_cache_file,
    commit,
    open_cache_file,
    remove_temporaries,
    write_cache_file,
    write_section,
)

FINGERPRINT = {
    "model": "tiny-qwen3.5",
    "dtype": "bfloat16",
    "block_size": 64,
    "state_shapes": [[4, 8, 8], [3, 16]],
    "tensor_parallel": {"size": 1, "rank": 0},
    "vllm": "0.32.0",
    "vllm_hpc": "0.1.0",
}
SLAB = 4096


def build_save(seed: int = 0) -> SavedCache:
    """Two conversations sharing two blocks (the second hit once), one short one with a tail."""
    index = make_index(host_slabs=20)
    h = Harness(index)
    shared = toks(seed + 5, 2 * BLOCK)
    h.run([*shared, *toks(seed + 6, 2 * BLOCK)], taps=[4 * BLOCK])
    second = [*shared, *toks(seed + 7, 2 * BLOCK)]
    h.run(second, taps=[4 * BLOCK])
    h.run(toks(seed + 8, BLOCK + 20), taps=[BLOCK + 9], salt="tenant")
    h.finish(h.admit([*second, 1]).lease)
    saved = index.export_saved()
    assert len(saved.snapshots) == 3
    return saved


def slab_bytes_of(slab: SlabId, rank: int = 0) -> bytes:
    """Distinct, checkable bytes for each saved slab and rank."""
    seed = hashlib.sha256(f"{rank}:{slab}".encode()).digest()
    return (seed * (SLAB // len(seed)))[:SLAB]


def write(path: Path, saved: SavedCache, **kwargs) -> int | None:
    return write_cache_file(path, FINGERPRINT, saved, {0: slab_bytes_of}, **kwargs)


def opened(path: Path) -> CacheFile:
    result = open_cache_file(path, FINGERPRINT)
    assert isinstance(result, CacheFile), result
    return result


def into(buffers: dict[SlabId, bytearray], key: Any = None) -> Any:
    """A read target: a new buffer per saved slab, kept in ``buffers`` under ``key(slab)``."""

    def target(slab: SlabId) -> memoryview:
        buffer = buffers.setdefault(slab if key is None else key(slab), bytearray(SLAB))
        return memoryview(buffer)

    return target


def read_all(cache: CacheFile, rank: int = 0) -> tuple[dict[SlabId, bytearray], str | None]:
    got: dict[SlabId, bytearray] = {}
    reason = cache.read_slabs(rank, cache.saved.slabs, into(got))
    return got, reason


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    saved = build_save()
    progress: list[tuple[int, int]] = []
    size = write(path, saved, progress=lambda done, total: progress.append((done, total)))
    assert size == path.stat().st_size and progress[-1] == (len(saved.slabs) * SLAB,) * 2
    cache = opened(path)
    assert cache.saved == saved
    reads: list[tuple[int, int]] = []
    got: dict[SlabId, bytearray] = {}
    reason = cache.read_slabs(0, saved.slabs, into(got), lambda d, t: reads.append((d, t)))
    assert reason is None and reads[-1] == (len(saved.slabs) * SLAB,) * 2
    assert got == {slab: slab_bytes_of(slab) for slab in saved.slabs}
    assert os.listdir(tmp_path) == ["cache.bin"]


def test_a_restart_loads_the_file_into_a_smaller_host_tier(tmp_path: Path) -> None:
    """Header and tables first, then only the kept slabs, each to its new slab."""
    path = tmp_path / "cache.bin"
    saved = build_save()
    write(path, saved)
    cache = opened(path)
    fresh = make_index(host_slabs=7)
    loaded = fresh.load_saved(cache.saved)
    assert 0 < loaded.snapshots < loaded.saved_snapshots
    arena: dict[SlabId, bytearray] = {}
    reason = cache.read_slabs(0, loaded.slabs, into(arena, loaded.slabs.__getitem__))
    assert reason is None and len(arena) == len(loaded.slabs) <= 7
    assert arena == {new: slab_bytes_of(old) for old, new in loaded.slabs.items()}
    fresh.check_invariants()


def test_one_section_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    saved = build_save()
    sources = {rank: (lambda slab, rank=rank: slab_bytes_of(slab, rank)) for rank in (0, 1)}
    write_cache_file(path, FINGERPRINT, saved, sources)
    cache = opened(path)
    assert [s.rank for s in cache.sections] == [0, 1]
    for rank in (0, 1):
        got, reason = read_all(cache, rank)
        assert reason is None and got == {s: slab_bytes_of(s, rank) for s in saved.slabs}
    assert read_all(cache, 2)[1] == "no slab section for rank 2"


def test_ranks_write_their_own_sections_into_one_save(tmp_path: Path) -> None:
    """Tensor parallelism: the engine core lays the save out, each rank's worker writes its own
    section (in any order, from its own process), and only the commit replaces the previous
    file; an abandoned save leaves it as it was and no temporary file behind."""
    path = tmp_path / "cache.bin"
    write(path, build_save(seed=1))
    previous = path.read_bytes()
    saved = build_save()
    pending = begin_cache_file(path, FINGERPRINT, saved, range(2))
    for rank in (1, 0):
        assert write_section(pending, rank, lambda slab, rank=rank: slab_bytes_of(slab, rank))
    assert path.read_bytes() == previous
    assert commit(pending) == path.stat().st_size
    cache = opened(path)
    for rank in (0, 1):
        got, reason = read_all(cache, rank)
        assert reason is None and got == {s: slab_bytes_of(s, rank) for s in saved.slabs}

    pending = begin_cache_file(path, FINGERPRINT, build_save(seed=2), range(2))
    assert not write_section(pending, 0, slab_bytes_of, cancel=lambda: True)
    abandon(pending)
    assert os.listdir(tmp_path) == ["cache.bin"] and opened(path).saved == saved
    with pytest.raises(ValueError, match="no section for rank 2"):
        pending.section(2)


def test_truncated_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    write(path, build_save())
    whole = path.read_bytes()
    data_offset = opened(path).data_offset
    for cut in (0, 5, 19, 20, 40, data_offset, data_offset + 100, len(whole) // 2, len(whole) - 1):
        path.write_bytes(whole[:cut])
        reason = open_cache_file(path, FINGERPRINT)
        assert isinstance(reason, str), cut
        expected = "not a prefix cache file" if cut < 20 else "truncated"
        assert reason.startswith(expected), (cut, reason)


def test_a_file_truncated_after_opening_fails_the_slab_read(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    write(path, build_save())
    cache = opened(path)
    os.truncate(path, cache.data_offset + cache.sections[0].offset + SLAB + 10)
    assert read_all(cache)[1] == "truncated in a slab section"


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_flipped_bits_are_detected(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    saved = build_save()
    write(path, saved)
    whole = path.read_bytes()
    cache = opened(path)
    section = cache.sections[0]
    cases = {
        25: "bad checksum in the header",
        cache.data_offset + 100: "bad checksum in the tables",
        cache.data_offset + section.checksums_offset(len(saved.slabs)) + 2: (
            "bad checksum in rank 0's slab checksums"
        ),
    }
    for offset, reason in cases.items():
        path.write_bytes(whole)
        flip(path, offset)
        assert open_cache_file(path, FINGERPRINT) == reason
    # A slab's damage shows when that slab is read, before the load can use it.
    path.write_bytes(whole)
    flip(path, cache.data_offset + section.offset + 3 * SLAB + 77)
    damaged = opened(path)
    got, reason = read_all(damaged)
    # Read into its buffer, then refused: the load that owns the buffers drops them all.
    assert reason == "bad checksum in rank 0's slab section" and len(got) == 4
    assert damaged.read_slabs(0, saved.slabs[4:], into({})) is None


def test_a_foreign_fingerprint_names_the_differing_keys(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    write(path, build_save())
    other = {**FINGERPRINT, "model": "another", "block_size": 16, "kv_cache_dtype": "fp8"}
    reason = open_cache_file(path, other)
    assert reason == "foreign fingerprint: block_size, kv_cache_dtype, model differ"
    # Tuples compare as the lists JSON keeps.
    same = {**FINGERPRINT, "state_shapes": ((4, 8, 8), (3, 16))}
    assert isinstance(open_cache_file(path, same), CacheFile)


def test_another_format_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    write(path, build_save())
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, 8, FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))
    assert open_cache_file(path, FINGERPRINT) == (
        f"format version {FORMAT_VERSION + 1}, this build reads {FORMAT_VERSION}"
    )


def test_files_not_of_ours_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.bin"
    for content in (b"", b"hello world, not a cache file at all" * 10):
        path.write_bytes(content)
        assert open_cache_file(path, FINGERPRINT) == "not a prefix cache file"
    assert open_cache_file(tmp_path / "missing", FINGERPRINT) == f"no file at {tmp_path}/missing"
    assert open_cache_file(tmp_path, FINGERPRINT).startswith("cannot read the file")


def previous_file(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "cache.bin"
    write(path, build_save(seed=100))
    return path, path.read_bytes()


def test_a_failing_write_leaves_the_previous_file(tmp_path: Path) -> None:
    path, before = previous_file(tmp_path)
    saved = build_save()

    def failing(slab: SlabId) -> bytes:
        if slab == saved.slabs[4]:
            raise OSError(28, "No space left on device")
        return slab_bytes_of(slab)

    with pytest.raises(OSError, match="No space"):
        write_cache_file(path, FINGERPRINT, saved, {0: failing})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["cache.bin"]
    with pytest.raises(ValueError, match="bytes, not 4096"):
        write_cache_file(path, FINGERPRINT, saved, {0: lambda slab: b"short"})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["cache.bin"]


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_leaves_the_previous_file(tmp_path: Path) -> None:
    """A file-size limit below the new file's size: the write fails with EFBIG."""
    path, before = previous_file(tmp_path)
    script = f"""
import resource, signal
from pathlib import Path
from typing import Any
from tests.persistence.test_cache_file import build_save, write
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
try:
    write(Path({str(path)!r}), build_save())
except OSError as exc:
    print("failed:", exc.errno)
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "failed: 27"  # EFBIG
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["cache.bin"]


@pytest.mark.parametrize("after", [0, 3, 11])
def test_cancel_abandons_the_save(tmp_path: Path, after: int) -> None:
    """Asked before each slab and before the rename (11 slabs: the rename's turn)."""
    path, before = previous_file(tmp_path)
    saved = build_save()
    assert len(saved.slabs) == 11
    asked = []

    def cancel() -> bool:
        asked.append(1)
        return len(asked) > after

    assert write(path, saved, cancel=cancel) is None
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["cache.bin"]
    assert len(asked) == after + 1


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_a_save_killed_leaves_the_previous_file_and_a_temporary_the_next_start_removes(
    tmp_path: Path,
) -> None:
    """kill -9 in the middle of a save: no cleanup runs, the previous file is intact and the
    temporary beside it is what `remove_temporaries` finds (and nothing else)."""
    path, before = previous_file(tmp_path)
    (tmp_path / "other.tmp").write_bytes(b"not ours")
    script = f"""
import os, signal
from pathlib import Path
from typing import Any
from tests.persistence.test_cache_file import build_save, slab_bytes_of, FINGERPRINT
from vllm_hpc.persistence import write_cache_file
written = []
def source(slab):
    written.append(slab)
    if len(written) == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return slab_bytes_of(slab)
write_cache_file(Path({str(path)!r}), FINGERPRINT, build_save(), {{0: source}})
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True)
    assert done.returncode == -9, done.stderr
    assert path.read_bytes() == before
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 3 and left[0].startswith(".cache.bin.") and left[0].endswith(".tmp")
    assert [p.name for p in remove_temporaries(path)] == [left[0]]
    assert sorted(os.listdir(tmp_path)) == ["cache.bin", "other.tmp"]
    assert isinstance(open_cache_file(path, FINGERPRINT), CacheFile)
