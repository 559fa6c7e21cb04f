"""Host tier copy bandwidth on a Qwen3.5-27B-shaped layout, against the pinned-copy peak (CUDA).

Layout: 16 attention layers of 4 KV heads x 256 dims (bf16, 64-token pages, so a block record
is 4 MiB) and 48 GDN layers (a 146.8 MiB state image). Measures, in one run:

- pinning time of the slab chunks;
- write-through and restore of 256 blocks on consecutive and on scattered slabs, and of one
  image, against one contiguous pinned `copy_` of the same size (the peak);
- overlap: a restore with per-layer waits while the compute stream runs one matmul per layer.

    python benchmarks/host_arena_bench.py
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_hpc.glue.worker.host_arena import HostArena, SlabGrid
from vllm_hpc.glue.worker.host_layout import DeviceLayout
from vllm_hpc.glue.worker.state_pool import StatePool

PAGES, HEADS, TOKENS, DIM = 1024, 4, 64, 256
BLOCKS = 256
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


def build_layout() -> DeviceLayout:
    attention = [f"model.layers.{i}.self_attn.attn" for i in range(3, 64, 4)]
    gdn = [f"model.layers.{i}.linear_attn" for i in range(64) if i % 4 != 3]
    page = HEADS * TOKENS * 2 * DIM * 2
    raw = torch.randint(-128, 128, (len(attention) * PAGES * page,), dtype=torch.int8)
    raw = raw.cuda()
    kv = {
        name: raw[i * PAGES * page : (i + 1) * PAGES * page]
        .view(torch.bfloat16)
        .view(PAGES, HEADS, TOKENS, 2 * DIM)
        for i, name in enumerate(attention)
    }
    pool = StatePool(4, 4, torch.device("cuda"))
    for name in gdn:
        pool.add_layer(name, [(3, 10240), (48, 128, 128)], [torch.bfloat16, torch.float32])
    return DeviceLayout.bind(kv, PAGES, pool)


def main() -> None:
    layout = build_layout()
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
        write = timed(lambda s=slabs: arena.write(blocks=list(zip(range(BLOCKS), s, strict=True))))
        read = timed(lambda s=slabs: arena.restore(blocks=list(zip(s, range(BLOCKS), strict=True))))
        print(
            f"{BLOCKS} blocks ({size:.2f} GB), {name} slabs: "
            f"D2H {size / write:.1f} GB/s, H2D {size / read:.1f} GB/s"
        )
    image = list(range(2000, 2000 + geometry.image_slabs))
    write = timed(lambda: arena.write(images=[(5, image)]))
    read = timed(lambda: arena.restore(image=(image, 2)))
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
        return arena.restore(
            blocks=list(zip(consecutive, range(BLOCKS), strict=True)), image=(image, 2)
        )

    compute, copy = timed(lambda: forward(None)), timed(restore)
    both = timed(lambda: forward(restore()))
    print(
        f"64 layers of compute {compute * 1e3:.1f} ms, restore {copy * 1e3:.1f} ms, both with "
        f"per-layer waits {both * 1e3:.1f} ms (one after the other: {(compute + copy) * 1e3:.1f})"
    )
    print("arena counters:", arena.stats)


if __name__ == "__main__":
    main()
