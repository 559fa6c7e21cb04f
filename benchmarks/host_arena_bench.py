"""Host tier copy bandwidth on a Qwen3.5-27B-shaped layout, against the pinned-copy peak (CUDA),
and the engine thread's time to plan and issue a burst's finishing wave of write-through.

Layout: 16 attention layers of 4 KV heads x 256 dims (bf16, 64-token pages, so a block record
is 4 MiB) and 48 GDN layers (a bf16 conv state and a float32 recurrent state: a 146.8 MiB state
image). Measures, in one run:

- pinning time of the slab chunks;
- write-through and restore of 256 blocks on consecutive and on scattered slabs, and of one
  image, against one contiguous pinned `copy_` of the same size (the peak);
- overlap: a restore with per-layer waits while the compute stream runs one matmul per layer;
- a restore of 1,500 blocks (a 96,000-token prefix) from scattered slabs: the CPU time until
  `HostArena.restore` returns, and until the copies have landed;
- a finishing wave (16 requests of 18 scattered blocks and an endpoint image each, as in the
  256-request burst of `gpu_load.md`): the CPU time of `HostArena.write` until it returns,
  with the copy stream idle;
- with ``--disk DIR`` (#50), the disk tier's restore path below the engine: 256 block records
  and one image written from the arena's slabs to a slab file in DIR by the worker's
  `DiskStore`, then read back into the same slabs (O_DIRECT, the tier's depth, CRCs checked) and
  restored to the device, against the sequential read bandwidth of DIR's filesystem
  (`disk_io.py`'s baseline pass on a cold file of the same size).

    python benchmarks/host_arena_bench.py [--disk /tmp/hpc-disk]
    python benchmarks/host_arena_bench.py --plan-only    # any machine: the wave's planning alone
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_hpc.glue.worker.disk_store import DiskRecord, DiskSlabFile, DiskStore
from vllm_hpc.glue.worker.host_arena import HostArena, SlabGrid
from vllm_hpc.glue.worker.host_layout import DeviceLayout
from vllm_hpc.index import SlabId
from vllm_hpc.runtime.plan import ImageCopy, PageSlab

HEADS, TOKENS, DIM = 4, 64, 256
BLOCKS = 256
WAVE_REQUESTS, WAVE_BLOCKS = 16, 18
RESTORE_BLOCKS = 1500
REPS = 5


class Done:
    """Something `timed` can wait for: an event recorded on the current stream."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def synchronize(self) -> None:
        self.event.synchronize()


def timed(issue: Callable[[], Any]) -> float:
    """Seconds per call of ``issue`` (after one warm-up), waiting for its copies."""
    issue()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPS):
        handle = issue()
    handle.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / REPS


def build_layout(device: torch.device, pages: int) -> DeviceLayout:
    """The 27B shape's attention pages and a state pool of a few rows over a buffer of its own
    (the tests' `pool_support.bound_pool`)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pool_support import bound_pool  # type: ignore[import-not-found]

    attention = [f"model.layers.{i}.self_attn.attn" for i in range(3, 64, 4)]
    gdn = [f"model.layers.{i}.linear_attn" for i in range(64) if i % 4 != 3]
    page = HEADS * TOKENS * 2 * DIM * 2
    raw = torch.randint(-128, 128, (len(attention) * pages * page,), dtype=torch.int8)
    raw = raw.to(device)
    kv = {
        name: raw[i * pages * page : (i + 1) * pages * page]
        .view(torch.bfloat16)
        .view(pages, HEADS, TOKENS, 2 * DIM)
        for i, name in enumerate(attention)
    }
    shapes, dtypes = [(3, 10240), (48, 128, 128)], [torch.bfloat16, torch.float32]
    pool = bound_pool(device, gdn, shapes, dtypes, rows=4)
    return DeviceLayout.bind(kv, pages, pool)


def wave(arena: HostArena, seed: int) -> tuple[list[PageSlab], list[ImageCopy]]:
    """A finishing wave's write-through: scattered pages and slabs, one image a request."""
    rng = random.Random(seed)
    count = arena.grid.geometry.image_slabs
    slabs = rng.sample(range(arena.grid.capacity), WAVE_REQUESTS * (WAVE_BLOCKS + count))
    pages = rng.sample(range(arena.layout.num_pages), WAVE_REQUESTS * WAVE_BLOCKS)
    blocks = [PageSlab(p, s) for p, s in zip(pages, slabs, strict=False)]
    rest = slabs[len(blocks) :]
    images = [
        ImageCopy(1 + i % (arena.layout.num_rows - 1), tuple(rest[i * count : (i + 1) * count]))
        for i in range(WAVE_REQUESTS)
    ]
    return blocks, images


def wave_cpu_ms(issue: Callable[[], Any]) -> float:
    """The median CPU time until ``issue`` returns, over 20 calls, in milliseconds. What it
    returns is waited for outside the timing, so no call queues behind the one before's copies
    (the burst's waves come a prefill step apart)."""
    times = []
    for _ in range(20):
        start = time.perf_counter()
        handle = issue()
        times.append((time.perf_counter() - start) * 1e3)
        if hasattr(handle, "synchronize"):
            handle.synchronize()
    return sorted(times)[len(times) // 2]


def plan_only() -> None:
    layout = build_layout(torch.device("cpu"), WAVE_REQUESTS * WAVE_BLOCKS)
    arena = HostArena(layout, SlabGrid.for_budget(6 << 10, layout.geometry))
    blocks, images = wave(arena, 0)
    ranges = arena.plan_write(blocks, images)
    ms = wave_cpu_ms(lambda: arena.plan_write(blocks, images))
    print(f"finishing wave: {len(blocks)} blocks, {len(images)} images, {len(ranges)} ranges")
    print(f"planning its write-through: {ms:.2f} ms (median of 20)")


def disk_restore(arena: HostArena, directory: Path, blocks: list[int], image: list[int]) -> None:
    """The restore path from disk: `DiskStore` reads a block record per slab and the image as
    one record into the arena's slabs, then `HostArena.restore` copies them to the device; both
    timed apart and together, against a sequential read of a cold file of the same size."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from disk_io import baseline, cold_file

    slab_bytes = arena.grid.slab_bytes
    host = [*blocks, *image]
    nbytes = len(host) * slab_bytes
    directory.mkdir(parents=True, exist_ok=True)
    with cold_file(directory, nbytes) as target:
        sequential = baseline(target)["sequential_mib_s"] or 0.0
    views = [memoryview(arena.slab(slab).numpy()) for slab in host]
    records = [DiskRecord((SlabId(i),), (views[i],)) for i in range(len(blocks))]
    first = len(blocks)
    records.append(
        DiskRecord(tuple(SlabId(first + i) for i in range(len(image))), tuple(views[first:]))
    )
    file = DiskSlabFile(directory / "host_arena_bench.slabs", slab_bytes, len(host))
    direct = file.direct
    store = DiskStore(file)
    try:
        writing = store.submit_write(records)
        assert writing is not None
        written = writing.wait()
        assert written.error is None, written.error
        pairs = [PageSlab(page, slab) for page, slab in enumerate(blocks)]
        copy = ImageCopy(2, tuple(image))
        torch.cuda.synchronize()
        start = time.perf_counter()
        reading = store.submit_read(records, written.crcs)
        assert reading is not None
        got = reading.wait()
        assert got.ok, got.failures
        read = time.perf_counter()
        arena.restore(blocks=pairs, image=copy).synchronize()
        landed = time.perf_counter()
    finally:
        store.close()
        file.path.unlink(missing_ok=True)
    mib = nbytes / 2**20
    print(
        f"disk restore of {len(blocks)} blocks and one image ({mib:.0f} MiB, O_DIRECT "
        f"{direct}): disk -> host {mib / (read - start):.0f} MiB/s, then host -> device "
        f"{(landed - read) * 1e3:.0f} ms; disk -> device {mib / (landed - start):.0f} MiB/s = "
        f"{mib / (landed - start) / sequential:.2f}x the filesystem's sequential read "
        f"({sequential:.0f} MiB/s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan-only", action="store_true", help="the wave's planning, on the CPU")
    ap.add_argument("--disk", type=Path, help="also the disk tier's restore path, in this folder")
    args = ap.parse_args()
    if args.plan_only:
        plan_only()
        return
    layout = build_layout(torch.device("cuda"), RESTORE_BLOCKS)
    geometry = layout.geometry
    print(
        f"block record {geometry.block_bytes / 2**20:.2f} MiB, image "
        f"{geometry.image_bytes / 2**20:.1f} MiB = {geometry.image_slabs} slabs"
    )
    for mib in (8 << 10, 24 << 10):
        start = time.perf_counter()
        arena = HostArena(layout, SlabGrid.for_budget(mib, geometry))
        print(f"allocate and pin {mib >> 10} GiB: {time.perf_counter() - start:.2f} s")
    capacity = arena.grid.capacity
    size = BLOCKS * geometry.block_bytes / 1e9
    consecutive = list(range(100, 100 + BLOCKS))
    scattered = random.Random(0).sample(range(capacity), BLOCKS)
    for name, slabs in (("consecutive", consecutive), ("scattered", scattered)):
        pairs = [PageSlab(page, slab) for page, slab in enumerate(slabs)]
        write = timed(lambda p=pairs: arena.write(blocks=p))
        read = timed(lambda p=pairs: arena.restore(blocks=p))
        print(
            f"{BLOCKS} blocks ({size:.2f} GB), {name} slabs: "
            f"D2H {size / write:.1f} GB/s, H2D {size / read:.1f} GB/s"
        )
    image = list(range(2000, 2000 + geometry.image_slabs))
    write = timed(lambda: arena.write(images=[ImageCopy(3, tuple(image))]))
    read = timed(lambda: arena.restore(image=ImageCopy(2, tuple(image))))
    gb = geometry.image_bytes / 1e9
    print(f"one image: D2H {gb / write:.1f} GB/s, H2D {gb / read:.1f} GB/s")
    host = torch.empty(BLOCKS * geometry.block_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")

    def plain(src: torch.Tensor, dst: torch.Tensor) -> Done:
        dst.copy_(src, non_blocking=True)
        return Done()

    read, write = timed(lambda: plain(host, device)), timed(lambda: plain(device, host))
    print(f"peak, one contiguous pinned copy_: H2D {size / read:.1f} GB/s, D2H {size / write:.1f}")
    matrix = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def forward(handle: Any) -> Done:
        for layer in layout.layers:
            if handle is not None:
                handle.wait_layer(layer.name)
            matrix @ matrix
        return Done()

    def restore() -> Any:
        blocks = [PageSlab(page, slab) for page, slab in enumerate(consecutive)]
        return arena.restore(blocks=blocks, image=ImageCopy(2, tuple(image)))

    compute, copy = timed(lambda: forward(None)), timed(restore)
    both = timed(lambda: forward(restore()))
    print(
        f"64 layers of compute {compute * 1e3:.1f} ms, restore {copy * 1e3:.1f} ms, both with "
        f"per-layer waits {both * 1e3:.1f} ms (one after the other: {(compute + copy) * 1e3:.1f})"
    )
    many = random.Random(1).sample(range(capacity), RESTORE_BLOCKS)
    pairs = [PageSlab(page, slab) for page, slab in enumerate(many)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    handle = arena.restore(blocks=pairs)
    issued = time.perf_counter()
    handle.synchronize()
    landed = time.perf_counter()
    print(
        f"{RESTORE_BLOCKS}-block restore from scattered slabs: issued after "
        f"{(issued - start) * 1e3:.1f} ms of CPU, landed after {(landed - start) * 1e3:.1f} ms"
    )
    blocks, images = wave(arena, 0)
    before = arena.stats.copies
    ms = wave_cpu_ms(lambda: arena.write(blocks, images))
    ranges = (arena.stats.copies - before) // 20
    print(
        f"finishing wave ({len(blocks)} blocks, {len(images)} images, {ranges} ranges): "
        f"HostArena.write returns after {ms:.2f} ms of CPU with the copy stream idle "
        f"(median of 20, batched: {arena.batched})"
    )
    print("arena counters:", arena.stats)
    if args.disk:
        disk_restore(arena, args.disk, consecutive, image)


if __name__ == "__main__":
    main()
