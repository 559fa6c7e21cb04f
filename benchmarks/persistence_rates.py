"""Save and load rates of the prefix cache file (§5.5) against the disk's own sequential rate.

The file layer alone, on this machine: a save of a full host tier (``--host-mib``, 4 MiB slabs
as on the 27B shape: blocks, and snapshots of 19-slab images) written by `write_cache_file`
from memory, then opened and read back in full by `open_cache_file` / `CacheFile.read_slabs`;
beside it, the same number of bytes written sequentially with one fsync and read back. Reads
may come from the page cache on both sides (the report says whether it could be dropped).
An engine's save adds the settle steps and the host writes' landing; those are not in here.

    python benchmarks/persistence_rates.py --host-mib 8192 --dir /tmp --out results.md
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm_hpc.index import SavedCache, SlabId
from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.saved_cache import SavedBlock, SavedRoot, SavedSnapshot
from vllm_hpc.index.snapshot import SnapshotKind
from vllm_hpc.index.types import NodeId, SnapshotId
from vllm_hpc.persistence import open_cache_file, write_cache_file

SLAB = 4 << 20
IMAGE_SLABS = 19
FINGERPRINT = {"benchmark": "persistence_rates"}
CHUNK = 64 << 20


def synthetic_save(slabs: int) -> SavedCache:
    """One conversation's chain of blocks with an endpoint every 16 blocks, filling ``slabs``."""
    geometry = HostGeometry(SLAB, IMAGE_SLABS * SLAB)
    root = SavedRoot(NodeId(0), None)
    blocks: list[SavedBlock] = []
    snapshots: list[SavedSnapshot] = []
    used = 0
    while used + 16 + IMAGE_SLABS <= slabs:
        for _ in range(16):
            parent = blocks[-1].id if blocks else root.id
            tokens = bytes(4 * 64)
            blocks.append(SavedBlock(NodeId(len(blocks) + 1), parent, tokens, 0, SlabId(used)))
            used += 1
        image = tuple(SlabId(used + k) for k in range(IMAGE_SLABS))
        used += IMAGE_SLABS
        snapshot = SavedSnapshot(
            SnapshotId(len(snapshots) + 1),
            blocks[-1].id,
            SnapshotKind.ENDPOINT,
            b"",
            image,
            None,
            len(blocks) * 64,
            1,
        )
        snapshots.append(snapshot)
    return SavedCache(geometry, (root,), tuple(blocks), tuple(snapshots))


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 2**20 / seconds:,.0f} MiB/s ({seconds:.2f} s)"


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host-mib", type=int, default=8192)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", default="CPU machine", help="for the report's title")
    args = parser.parse_args()
    saved = synthetic_save(args.host_mib * 2**20 // SLAB)
    nbytes = len(saved.slabs) * SLAB
    payload = os.urandom(SLAB)  # one slab's bytes, served for every slab (checksums still run)
    target = args.dir / "persistence_rates.prefix-cache"
    raw = args.dir / "persistence_rates.raw"
    block = os.urandom(CHUNK)
    rows: list[tuple[str, float]] = []

    def save() -> None:
        write_cache_file(target, FINGERPRINT, saved, {0: lambda slab: payload})

    def load() -> None:
        opened = open_cache_file(target, FINGERPRINT)
        assert not isinstance(opened, str), opened
        scratch = memoryview(bytearray(SLAB))  # every slab read into one buffer
        failed = opened.read_slabs(0, saved.slabs, lambda slab: scratch)
        assert failed is None, failed

    def write_raw() -> None:
        with open(raw, "wb", buffering=0) as file:
            for _ in range(nbytes // CHUNK):
                file.write(block)
            os.fsync(file.fileno())

    def read_raw() -> None:
        with open(raw, "rb", buffering=0) as file:
            while file.read(CHUNK):
                pass

    try:
        rows.append(("save (`write_cache_file`: checksums, fsync, rename)", timed(save)))
        dropped = drop_page_cache()
        rows.append(("load (`open_cache_file` + `read_slabs`: checksums)", timed(load)))
        rows.append(("disk: sequential write, one fsync", timed(write_raw)))
        drop_page_cache()
        rows.append(("disk: sequential read", timed(read_raw)))
    finally:
        target.unlink(missing_ok=True)
        raw.unlink(missing_ok=True)
    lines = [
        f"# Prefix cache file: save and load rates against the disk ({args.machine})",
        "",
        f"Command: `python benchmarks/persistence_rates.py --host-mib {args.host_mib} "
        f"--dir {args.dir} --out {args.out} --machine '{args.machine}'`",
        "",
        f"{len(saved.slabs)} slabs of 4 MiB ({nbytes / 2**30:.2f} GiB): {len(saved.blocks)} "
        f"blocks, {len(saved.snapshots)} snapshots of {IMAGE_SLABS}-slab images. Page cache "
        f"dropped before each read: {'yes' if dropped else 'no (not permitted here)'}.",
        "",
        "| what | rate |",
        "|---|---|",
    ]
    lines += [f"| {what} | {rate(nbytes, seconds)} |" for what, seconds in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
