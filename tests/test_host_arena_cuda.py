"""The host tier's data mover on a CUDA device: pinned chunks, streams, per-layer restore events.

Skipped without a GPU (CI). The attention views copy vLLM's ``[B, H, N, C]`` construction for a
layer-outer (LBHNC) and a block-outer (BLHNC) layout by hand, so the test needs no vLLM install.
"""

from __future__ import annotations

import pytest
import torch
from pool_support import bound_pool

from vllm_hpc.glue.worker.host_arena import HostArena, SlabGrid
from vllm_hpc.glue.worker.host_layout import DeviceLayout
from vllm_hpc.glue.worker.state_pool import StatePool
from vllm_hpc.runtime.plan import ImageCopy, PageSlab

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGES, HEADS, TOKENS, HEAD = 64, 4, 64, 128
ATTENTION = [f"model.layers.{i}.self_attn.attn" for i in (3, 7, 11)]
GDN = [f"model.layers.{i}.linear_attn" for i in range(12) if i % 4 != 3]


def _kv(dtype: torch.dtype, block_outer: bool) -> dict[str, torch.Tensor]:
    """One random int8 buffer viewed per layer as vLLM's worker views it."""
    item = torch.empty(0, dtype=dtype).element_size()
    page = HEADS * TOKENS * 2 * HEAD * item
    layers = len(ATTENTION)
    raw = torch.randint(-128, 128, (layers * PAGES * page,), dtype=torch.int8, device="cuda")
    layer_stride, block_stride = (page, layers * page) if block_outer else (PAGES * page, page)
    views = {}
    for index, name in enumerate(ATTENTION):
        view = torch.as_strided(
            raw,
            (PAGES, HEADS, TOKENS, 2 * HEAD * item),
            (block_stride, TOKENS * 2 * HEAD * item, 2 * HEAD * item, 1),
            index * layer_stride,
        )
        views[name] = view.view(dtype)
    return views


def _pool() -> StatePool:
    shapes, dtypes = [(3, 1024), (8, 128, 128)], [torch.bfloat16, torch.float32]
    return bound_pool(torch.device("cuda"), GDN, shapes, dtypes, rows=9)


def _arena(kv: dict[str, torch.Tensor], pool: StatePool, slabs_per_chunk: int = 16) -> HostArena:
    layout = DeviceLayout.bind(kv, PAGES, pool)
    return HostArena(layout, SlabGrid(layout.geometry, 96, slabs_per_chunk))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-call-a-copy"])
@pytest.mark.parametrize("block_outer", [False, True], ids=["LBHNC", "BLHNC"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_round_trip_bit_exact_on_streams(
    dtype: torch.dtype, block_outer: bool, batched: bool
) -> None:
    """Both ways of issuing the copies (the batch call where CUDA has it, and its fallback)."""
    kv, pool = _kv(dtype, block_outer), _pool()
    arena = _arena(kv, pool)
    assert all(chunk.is_pinned() for chunk in arena.chunks)
    cuda = tuple(int(part) for part in str(torch.version.cuda).split(".")[:2])
    if batched and cuda >= (12, 8):
        assert arena.batched, "cudaMemcpyBatchAsync failed its start-up check"
    arena.batched = arena.batched and batched
    pages = list(range(20))
    slabs = [*range(8, 24), 40, 2, 60, 61]  # a chunk edge at 16, and stragglers
    image = list(range(95, 95 - arena.grid.geometry.image_slabs, -1))
    before = {name: _bytes(kv[name][:20]) for name in ATTENTION}
    state = [_bytes(t[5]) for name in GDN for t in pool.layer(name)]
    blocks = [PageSlab(page, slab) for page, slab in zip(pages, slabs, strict=True)]
    write = arena.write(blocks=blocks, images=[ImageCopy(5, tuple(image))])
    write.synchronize()
    assert write.done()
    for name in ATTENTION:
        kv[name][:20].view(torch.uint8).zero_()
    restore = arena.restore(blocks=blocks[1:], tail=blocks[0], image=ImageCopy(2, tuple(image)))
    for layer in arena.layout.layers:
        restore.wait_layer(layer.name)
    torch.cuda.synchronize()
    assert restore.done()
    for name in ATTENTION:
        assert torch.equal(_bytes(kv[name][:20]), before[name])
    assert all(
        torch.equal(_bytes(t[2]), s)
        for t, s in zip([t for n in GDN for t in pool.layer(n)], state, strict=True)
    )
    arena.close()


def test_layer_wait_orders_compute_after_its_copies() -> None:
    """A kernel queued on the compute stream after `wait_layer` reads the restored bytes."""
    kv, pool = _kv(torch.bfloat16, False), _pool()
    arena = _arena(kv, pool)
    pairs = [PageSlab(page, page) for page in range(PAGES // 2, PAGES)]
    expected = {name: kv[name][PAGES // 2 :].clone() for name in ATTENTION}
    arena.write(blocks=pairs).synchronize()
    for name in ATTENTION:
        kv[name].zero_()
    restore = arena.restore(blocks=pairs)
    seen = {}
    for layer in arena.layout.layers:
        restore.wait_layer(layer.name)
        if not layer.is_state:
            seen[layer.name] = kv[layer.name][PAGES // 2 :].clone()  # on the compute stream
    torch.cuda.synchronize()
    assert all(torch.equal(seen[n].view(torch.int16), expected[n].view(torch.int16)) for n in seen)
