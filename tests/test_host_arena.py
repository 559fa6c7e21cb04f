"""The host tier's data mover on CPU: bit-exact round trips, merged ranges, scattered images.

The attention KV caches are built by vLLM's own `create_kv_cache_views`, the function its
workers use to hand each layer its ``[B, H, N, C]`` view, for every `KVCacheLayout`.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from pool_support import bound_pool
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hpc import faults
from vllm_hpc.glue.worker import host_arena
from vllm_hpc.glue.worker.copy_ranges import CopyRanges
from vllm_hpc.glue.worker.host_arena import HostArena, SlabGrid
from vllm_hpc.glue.worker.host_layout import DeviceLayout
from vllm_hpc.glue.worker.state_pool import StatePool
from vllm_hpc.glue.worker.transfer_meter import TransferMeter
from vllm_hpc.index import BLOCK_TOKENS, HostGeometry, HostSlabPool
from vllm_hpc.runtime.plan import ImageCopy, PageSlab

NUM_PAGES = 12
ATTENTION = ["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"]
GDN = [f"model.layers.{i}.linear_attn" for i in (0, 1, 2, 4, 5, 6)]
KV_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


def _pairs(pages: list[int], slabs: list[int]) -> list[PageSlab]:
    """Page i with slab i, in either direction."""
    return [PageSlab(page, slab) for page, slab in zip(pages, slabs, strict=True)]


def _kv_caches(
    dtype: torch.dtype, layout: KVCacheLayout, kernel_block_size: int | None = None
) -> dict[str, torch.Tensor]:
    """The attention layers' views over one random int8 buffer, as vLLM's worker makes them."""
    spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=2, head_size=4, dtype=dtype)
    strides = compute_layout_strides(spec, NUM_PAGES, len(ATTENTION), layout)
    size = NUM_PAGES * len(ATTENTION) * spec.page_size_bytes
    generator = torch.Generator().manual_seed(1)
    raw = torch.randint(-128, 128, (size,), generator=generator, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size, layers=list(ATTENTION), layer_stride=strides[0], block_stride=strides[1]
    )
    views = create_kv_cache_views(raw, spec, NUM_PAGES, layout, tensor, kernel_block_size)
    return dict(zip(ATTENTION, views, strict=True))


def _state_pool() -> StatePool:
    shapes, dtypes = [(3, 12), (2, 16, 16)], [torch.bfloat16, torch.float32]
    return bound_pool(torch.device("cpu"), GDN, shapes, dtypes, rows=6)


def cpu_arena(
    dtype: torch.dtype = torch.bfloat16,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    capacity: int = 40,
    slabs_per_chunk: int = 16,
    kernel_block_size: int | None = None,
) -> HostArena:
    kv = _kv_caches(dtype, layout, kernel_block_size)
    device = DeviceLayout.bind(kv, NUM_PAGES, _state_pool())
    return HostArena(device, SlabGrid(device.geometry, capacity, slabs_per_chunk))


def _page_bytes(kv: torch.Tensor, page: int) -> torch.Tensor:
    return kv[page].contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_blocks_round_trip_bit_exact(dtype: torch.dtype, layout: KVCacheLayout) -> None:
    kv = _kv_caches(dtype, layout)
    pool = _state_pool()
    device = DeviceLayout.bind(kv, NUM_PAGES, pool)
    arena = HostArena(device, SlabGrid(device.geometry, 40, 16))
    pages, slabs, targets = [1, 2, 3, 7], [20, 21, 22, 5], [8, 9, 10, 0]
    before = {name: kv[name].clone() for name in ATTENTION}
    handle = arena.write(blocks=_pairs(pages, slabs))
    assert handle.done()
    restore = arena.restore(blocks=_pairs(targets, slabs))
    restore.wait_layer(ATTENTION[0])
    restore.wait_all()
    assert restore.done()
    for name in ATTENTION:
        for page in range(NUM_PAGES):
            source = pages[targets.index(page)] if page in targets else page
            assert torch.equal(_page_bytes(kv[name], page), _page_bytes(before[name], source))
    assert arena.stats.bytes_written == arena.stats.bytes_restored == 4 * device.block_bytes


def test_block_record_is_layer_major_in_forward_order() -> None:
    kv = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    device = DeviceLayout.bind(kv, NUM_PAGES, _state_pool())
    arena = HostArena(device, SlabGrid(device.geometry, 40, 16))
    arena.write(blocks=[PageSlab(4, 9)])
    page_bytes = device.block_bytes // len(ATTENTION)
    record = arena.chunks[0][9 * device.geometry.slab_bytes :][: device.block_bytes]
    assert torch.equal(record[:page_bytes], _page_bytes(kv[ATTENTION[0]], 4))
    assert torch.equal(record[page_bytes:], _page_bytes(kv[ATTENTION[1]], 4))
    names = [layer.name for layer in device.layers]
    assert names == [
        f"model.layers.{i}.{'linear_attn' if i % 4 != 3 else 'self_attn.attn'}" for i in range(8)
    ]


@pytest.mark.parametrize(
    ("pages", "slabs"),
    [
        ([0, 1, 2, 3], [4, 5, 6, 7]),  # consecutive pages on consecutive slabs
        ([0, 1, 2, 3], [6, 7, 8, 9]),  # a chunk edge between slabs 7 and 8
        ([3, 0, 2, 1], [7, 4, 6, 5]),  # any order of pairs
        ([0, 2, 3, 5], [4, 6, 5, 7]),  # pages and slabs out of step
    ],
)
def test_a_batch_moves_one_range_per_page_and_plane(pages: list[int], slabs: list[int]) -> None:
    """One range a page and layer, whatever the order of pages and slabs: in the layer-outer
    layout a page's bytes of one layer lie a whole layer apart from the next layer's, so a
    page's planes never continue one another on the device side."""
    arena = cpu_arena(slabs_per_chunk=8)
    arena.write(blocks=_pairs(pages, slabs))
    assert arena.stats.copies == len(pages) * len(ATTENTION)
    arena.restore(blocks=_pairs(pages, slabs))
    assert arena.stats.copies == 2 * len(pages) * len(ATTENTION)


def test_ranges_merge_only_where_both_sides_continue() -> None:
    def ranges(*rows: tuple[int, int, int]) -> CopyRanges:
        dst, src, nbytes = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
        return CopyRanges(dst, src, nbytes)

    merged = ranges((0, 100, 8), (8, 108, 8), (16, 116, 4), (40, 120, 4), (44, 200, 4)).merged()
    assert merged.as_lists() == ([0, 40, 44], [100, 120, 200], [20, 4, 4])
    assert len(ranges((0, 0, 4)).merged()) == 1
    assert len(CopyRanges.empty().merged()) == 0


def test_head_outer_layouts_copy_one_plane_per_head() -> None:
    arena = cpu_arena(layout=KVCacheLayout.LHBNC)
    arena.write(blocks=[PageSlab(0, 0), PageSlab(1, 1)])
    assert arena.stats.copies == len(ATTENTION) * 2 * 2  # two heads, two pages


def test_kernel_block_views_are_regrouped_into_pages() -> None:
    kv = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC, kernel_block_size=16)
    assert kv[ATTENTION[0]].shape[0] == 4 * NUM_PAGES
    device = DeviceLayout.bind(kv, NUM_PAGES, _state_pool())
    arena = HostArena(device, SlabGrid(device.geometry, 40, 16))
    whole = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    assert device.block_bytes == DeviceLayout.bind(whole, NUM_PAGES, _state_pool()).block_bytes
    before = kv[ATTENTION[1]][8:12].clone()
    arena.write(blocks=[PageSlab(2, 3)])
    arena.restore(blocks=[PageSlab(5, 3)])
    assert torch.equal(kv[ATTENTION[1]][20:24].view(torch.uint8), before.view(torch.uint8))


def _slot_bytes(pool: StatePool, slot: int) -> list[torch.Tensor]:
    return [t[slot].contiguous().view(torch.uint8).flatten() for n in GDN for t in pool.layer(n)]


@pytest.mark.parametrize("slabs_per_chunk", [16, 3])
def test_image_round_trip_over_scattered_slabs(slabs_per_chunk: int) -> None:
    kv = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    pool = _state_pool()
    device = DeviceLayout.bind(kv, NUM_PAGES, pool)
    arena = HostArena(device, SlabGrid(device.geometry, 40, slabs_per_chunk))
    count = device.geometry.image_slabs
    assert count > 3
    slabs = [(7 * i + 3) % 40 for i in range(count)]  # scattered over chunks
    arena.write(images=[ImageCopy(4, tuple(slabs))])
    # the packed image: byte o in slab o // slab_bytes, layers in forward order
    slab_bytes = device.geometry.slab_bytes
    packed = torch.cat(
        [
            arena.chunks[arena.grid.location(s)[0]][arena.grid.location(s)[1] :][:slab_bytes]
            for s in slabs
        ]
    )
    assert torch.equal(packed[: device.image_bytes], torch.cat(_slot_bytes(pool, 4)))
    arena.restore(image=ImageCopy(1, tuple(slabs)))
    assert all(
        torch.equal(a, b) for a, b in zip(_slot_bytes(pool, 1), _slot_bytes(pool, 4), strict=True)
    )
    assert arena.stats.bytes_written == arena.stats.bytes_restored == device.image_bytes


def test_consecutive_image_slabs_merge_copies() -> None:
    scattered, consecutive = cpu_arena(), cpu_arena()
    count = scattered.layout.geometry.image_slabs
    scattered.write(images=[ImageCopy(4, tuple(range(2 * count, 0, -2)))])
    consecutive.write(images=[ImageCopy(4, tuple(range(count)))])
    planes = [p for layer in consecutive.layout.layers if layer.is_state for p in layer.planes]
    # On consecutive slabs the host side is one run: a range ends only where slot 4's planes
    # do not lie back to back on the device.
    starts = [p.storage.data_ptr() + p.offset + 4 * p.pitch for p in planes]
    breaks = sum(a + p.nbytes != b for a, p, b in zip(starts, planes, starts[1:], strict=False))
    assert consecutive.stats.copies == 1 + breaks <= len(planes)
    assert scattered.stats.copies > consecutive.stats.copies


def test_ranges_never_cross_a_chunk_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks an allocator placed back to back: an image on consecutive slabs over the edge
    between chunks 0 and 1 continues in memory there, but each chunk is registered on its own,
    so its ranges stop at the edge; the image still round-trips."""
    kv, pool = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC), _state_pool()
    device = DeviceLayout.bind(kv, NUM_PAGES, pool)
    slab, per_chunk = device.geometry.slab_bytes, 16
    memory = torch.zeros(40 * slab, dtype=torch.uint8)

    def adjacent(arena: HostArena, index: int, nbytes: int) -> torch.Tensor:
        return memory[index * per_chunk * slab :][:nbytes]

    monkeypatch.setattr(HostArena, "_allocate", adjacent)
    arena = HostArena(device, SlabGrid(device.geometry, 40, per_chunk))
    count = device.geometry.image_slabs
    image = ImageCopy(4, tuple(range(per_chunk - count // 2, per_chunk - count // 2 + count)))
    ranges = arena.plan_write(images=[image])
    base = memory.data_ptr()
    first = (ranges.dst - base) // (per_chunk * slab)
    last = (ranges.dst + ranges.nbytes - 1 - base) // (per_chunk * slab)
    assert (first == last).all() and set(first.tolist()) == {0, 1}
    arena.write(images=[image])
    arena.restore(image=ImageCopy(1, image.slabs))
    assert all(
        torch.equal(a, b) for a, b in zip(_slot_bytes(pool, 1), _slot_bytes(pool, 4), strict=True)
    )


def test_restore_runs_prelude_then_layers_in_forward_order(monkeypatch: pytest.MonkeyPatch) -> None:
    arena = cpu_arena()
    count = arena.layout.geometry.image_slabs
    image = list(range(10, 10 + count))
    kv = {layer.name: layer for layer in arena.layout.layers}
    arena.write(blocks=_pairs([1, 2, 3], [0, 1, 2]), images=[ImageCopy(4, tuple(image))])
    issued: list[tuple[str | None, int]] = []
    issue = arena._issue

    def spy(steps, stream_index, to_host):  # type: ignore[no-untyped-def]
        issued.extend((step.layer, len(step.ranges)) for step in steps)
        return issue(steps, stream_index, to_host)

    monkeypatch.setattr(arena, "_issue", spy)
    arena.restore(
        blocks=_pairs([5, 6], [0, 1]), tail=PageSlab(9, 2), image=ImageCopy(2, tuple(image))
    )
    assert issued[0] == (None, len(ATTENTION))  # the tail's page, every attention layer
    assert [name for name, _ in issued[1:]] == [layer.name for layer in arena.layout.layers]
    assert all(n > 0 for _, n in issued)
    assert set(kv) == {name for name, _ in issued[1:]}


def test_budget_too_small_names_the_option() -> None:
    geometry = HostGeometry(block_bytes=3 << 20, image_bytes=40 << 20)
    with pytest.raises(ValueError, match=r"--host-cache-mib 40 .* at least 48 MiB"):
        SlabGrid.for_budget(40, geometry)
    grid = SlabGrid.for_budget(48, geometry)
    assert grid.capacity == 16


def test_grid_matches_the_index_pool() -> None:
    geometry = HostGeometry(block_bytes=700 << 20, image_bytes=3 << 30)
    grid = SlabGrid.for_budget(20 << 10, geometry)
    pool = HostSlabPool(20 << 30, geometry)
    assert grid.chunk_slabs == pool.chunk_slabs
    assert grid.slabs_per_chunk == 5
    assert all(grid.location(s) == pool.location(s) for s in range(pool.capacity))
    assert all(n * geometry.slab_bytes <= 4 << 30 for n in grid.chunk_slabs)


def test_geometry_mismatch_is_refused() -> None:
    kv = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    device = DeviceLayout.bind(kv, NUM_PAGES, _state_pool())
    other = HostGeometry(device.block_bytes + 2, device.image_bytes)
    with pytest.raises(ValueError, match="disagree"):
        HostArena(device, SlabGrid(other, 40, 16))


def test_chunks_hold_whole_slabs() -> None:
    arena = cpu_arena(capacity=40, slabs_per_chunk=16)
    slab = arena.grid.slab_bytes
    assert [c.numel() for c in arena.chunks] == [16 * slab, 16 * slab, 8 * slab]


def test_allocation_failure_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _kv_caches(torch.bfloat16, KVCacheLayout.LBHNC)
    device = DeviceLayout.bind(kv, NUM_PAGES, _state_pool())

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(RuntimeError, match=r"chunk 0 .* Lower --host-cache-mib"):
        HostArena(device, SlabGrid(device.geometry, 40, 16))


def test_transfer_meter_reports_landed_copies_as_seconds_and_bandwidth() -> None:
    arena = cpu_arena(torch.bfloat16)
    meter = TransferMeter()
    meter.track("write", arena.write(blocks=_pairs([1, 2], [20, 21])))
    meter.track("restore", arena.restore(blocks=[PageSlab(8, 20)]))
    stats = meter.read()
    assert stats is not None
    block = arena.layout.block_bytes
    for kind, nbytes in (("write", 2 * block), ("restore", block)):
        seconds = stats.data[f"host_{kind}_seconds"]
        assert seconds > 0
        assert stats.data[f"host_{kind}_bytes_per_second"] == pytest.approx(nbytes / seconds)
    assert meter.read() is None  # each batch is reported once
    assert meter.totals["write"][0] == 2 * block and meter.totals["restore"][0] == block


def test_a_failed_chunk_allocation_names_the_option_and_releases_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Injected (`VLLM_HPC_FAULTS=host_alloc:1`): the second of three chunks cannot be had. The
    start-up error names --host-cache-mib, and the chunk already taken is released with the
    half-built arena (its finalizer runs on it, as it unpins on CUDA)."""
    released: list[int] = []
    monkeypatch.setattr(faults, "_ARMED", frozenset({"host_alloc:1"}))
    monkeypatch.setattr(
        host_arena, "_unregister", lambda cuda, chunks: released.append(len(chunks))
    )
    with pytest.raises(RuntimeError, match=r"host tier chunk 1 .*--host-cache-mib"):
        cpu_arena(capacity=40, slabs_per_chunk=16)
    gc.collect()
    assert released == [1]


def test_host_slabs_start_on_a_page_for_the_disk_tiers_o_direct() -> None:
    arena = cpu_arena()
    assert all(arena.slab(slab).data_ptr() % 4096 == 0 for slab in range(arena.grid.capacity))
