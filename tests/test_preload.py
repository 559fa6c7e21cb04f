"""The workers' read of the prefix cache file during start-up (§5.5), on a CPU host tier.

The read goes into the slabs of the save's file order; a later load of the whole save claims
exactly those slabs, and only a load of the same file into that placement uses the bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from test_host_arena import cpu_arena

from tests.index.harness import BLOCK, Harness, make_index, toks
from vllm_hpc.glue.worker.host_arena import HostArena
from vllm_hpc.glue.worker.preload import Preload, PreloadResult
from vllm_hpc.index import PrefixIndex, SavedCache, SlabId, file_placement
from vllm_hpc.persistence import CacheFile, open_cache_file, write_cache_file

FINGERPRINT = {"model": "tiny-qwen3.5", "vllm_hpc": "test"}


def _index(arena: HostArena) -> PrefixIndex:
    geometry = arena.grid.geometry
    return make_index(
        host_slabs=40, block_bytes=geometry.block_bytes, image_bytes=geometry.image_bytes
    )


def _save(arena: HostArena) -> SavedCache:
    """Two conversations sharing a block, saved from an index of the arena's geometry."""
    index = _index(arena)
    h = Harness(index)
    shared = toks(1, BLOCK)
    h.run([*shared, *toks(2, BLOCK)], taps=[2 * BLOCK])
    h.run([*shared, *toks(3, BLOCK + 10)], taps=[2 * BLOCK + 10])
    saved = index.export_saved()
    assert len(saved.snapshots) == 2
    return saved


def _record(slab: SlabId, size: int, version: int = 0) -> bytes:
    seed = hashlib.sha256(f"{version}:{slab}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _write(path: Path, saved: SavedCache, version: int = 0) -> CacheFile:
    size = saved.geometry.slab_bytes
    write_cache_file(path, FINGERPRINT, saved, {0: lambda s: _record(s, size, version)})
    opened = open_cache_file(path, FINGERPRINT)
    assert isinstance(opened, CacheFile), opened
    return opened


def _read(path: Path) -> tuple[HostArena, SavedCache, PreloadResult, CacheFile]:
    """A save written to ``path``, a worker's read of it, and the engine core's open of it."""
    arena = cpu_arena(capacity=40)
    saved = _save(arena)
    checked = _write(path, saved)
    read, _ = Preload(str(path), arena, rank=0).finish()
    return arena, saved, read, checked


def test_a_whole_save_is_read_into_the_slabs_its_load_claims(tmp_path: Path) -> None:
    arena, saved, read, checked = _read(tmp_path / "cache.bin")
    assert read.refused is None and read.nbytes == len(saved.slabs) * arena.grid.slab_bytes
    for position, slab in enumerate(saved.slabs):
        assert arena.slab(position).numpy().tobytes() == _record(slab, arena.grid.slab_bytes)
    # The engine core loads the file it checked whole: into the placement read.
    fresh = _index(arena)
    loaded = fresh.load_saved(checked.saved)
    fresh.check_invariants()
    assert loaded.slabs == file_placement(saved) == read.placement
    assert read.covers(checked, loaded.slabs)


def test_a_part_of_a_save_or_another_file_does_not_use_the_read(tmp_path: Path) -> None:
    path = tmp_path / "cache.bin"
    _, saved, read, checked = _read(path)
    some = dict(list(file_placement(saved).items())[:3])
    assert not read.covers(checked, some)
    replaced = _write(path, saved, version=1)  # a save of other bytes renamed into place
    assert replaced.identity != checked.identity
    assert not read.covers(replaced, file_placement(saved))


def test_no_file_or_a_save_larger_than_the_tier_reads_nothing(tmp_path: Path) -> None:
    arena = cpu_arena(capacity=40)
    saved = _save(arena)
    missing, _ = Preload(str(tmp_path / "none.bin"), arena, rank=0).finish()
    assert missing.refused is not None and missing.refused.startswith("no file")
    path = tmp_path / "cache.bin"
    _write(path, saved)
    small = cpu_arena(capacity=len(saved.slabs) - 1)
    larger, _ = Preload(str(path), small, rank=0).finish()
    assert larger.refused == "the save is larger than the host tier" and larger.nbytes == 0
