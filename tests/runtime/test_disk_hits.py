"""Hits read from the disk tier, counted as such (#50), without vLLM: requests driven step by
step around the runtime, transfers reported at once."""

from __future__ import annotations

from tests.runtime.driver import CHUNK, ROW_PAGES, prompt
from vllm_hpc.index import BLOCK_TOKENS, HostGeometry, IndexConfig, TapPolicy
from vllm_hpc.index.types import Medium, Residency
from vllm_hpc.runtime.cache import HybridPrefixCache, RequestInfo, RuntimeConfig
from vllm_hpc.runtime.lane import Lane

GEOMETRY = HostGeometry(1024, 4096)
SLAB = GEOMETRY.slab_bytes


def disk_cache() -> HybridPrefixCache:
    """One running request at a time, a host tier and a disk tier under it."""
    index = IndexConfig(
        device_pages=200 + 6 * ROW_PAGES,
        geometry=GEOMETRY,
        snapshot_slots=4,
        first_page_id=1,
        row_pages=ROW_PAGES,
        host_budget_bytes=64 * SLAB,
        disk_budget_bytes=256 * SLAB,
    )
    return HybridPrefixCache(
        RuntimeConfig(
            index=index,
            active_cap=1,
            tap_policy=TapPolicy.for_engine(CHUNK, host_tier=True),
            chunk_tokens=CHUNK,
            disk_write_bytes=256 * SLAB,
        )
    )


def step(cache: HybridPrefixCache) -> None:
    """Hand a plan out and report every transfer in it done."""
    plan = cache.take_plan()
    cache.complete_writes([write.batch for write in plan.host_writes])
    for write in plan.disk_writes:
        cache.complete_disk_writes(write.batch)
    for read in plan.disk_reads:
        cache.complete_disk_read(read.batch)
    cache.new_step()


def admit(cache: HybridPrefixCache, info: RequestInfo) -> Lane:
    lookup = cache.lookup(info)
    assert not cache.disk_wait(info.request_id, lookup)
    lane = cache.admit(info, lookup, len(info.token_ids) - lookup.frontier)
    assert lane is not None
    return lane


def prefill(cache: HybridPrefixCache, info: RequestInfo, lane: Lane) -> None:
    """Its prompt in chunks ending at its taps, then its finish, then until nothing lands."""
    n, start = len(info.token_ids), lane.base
    while start < n:
        end = start + cache.chunk_limit(lane.taps, start, n - start, n)
        cache.on_scheduled(lane, info.token_ids, start, end)
        step(cache)
        cache.commit(lane, info.token_ids, end)
        start = end
    cache.finish(lane, info.token_ids, n)
    for _ in range(3):  # the finish's host writes land, are planned behind, land on disk
        step(cache)


def test_a_hit_a_prefetch_moved_from_its_read_to_the_device_counts_as_from_disk() -> None:
    """The read brings the path to the host, the image being in a slot; the request, refused
    room meanwhile, has its path prefetched to the device, and is then admitted with nothing
    to restore from the host: still a disk hit, which its read made."""
    cache = disk_cache()
    index, store = cache.index, cache.index.store
    tokens = prompt(6 * BLOCK_TOKENS + 10, seed=1)
    cache.new_step()
    first = RequestInfo("first", tokens, len(tokens))
    prefill(cache, first, admit(cache, first))
    (snapshot,) = [s for s in store.snapshots if s.frontier == 6 * BLOCK_TOKENS]
    path = snapshot.anchor.path()
    assert snapshot.slot is not None and {Medium.HOST, Medium.DISK} <= snapshot.media
    grabbed = index.allocate_pages(store.pages.num_free + store.lru.num_backed)  # path pages go
    assert grabbed is not None
    index.free_pages(grabbed)
    assert store.make_host_room(store.slabs.capacity)
    assert snapshot.slot is not None and all(n.media == {Medium.DISK} for n in path)
    other = RequestInfo("other", prompt(300, seed=2), 300)
    running = admit(cache, other)  # holds the one active slot
    step(cache)
    prefix = tokens[: 6 * BLOCK_TOKENS]
    resume = RequestInfo("resume", [*prefix, *prompt(20, seed=3)], len(prefix) + 20)
    lookup = cache.lookup(resume)
    assert lookup.frontier == 6 * BLOCK_TOKENS and cache.disk_wait("resume", lookup)
    step(cache)  # the read lands
    lookup = cache.lookup(resume)
    assert not cache.disk_wait("resume", lookup)
    assert cache.admit(resume, lookup, 20) is None  # no active slot
    cache.prefetch(lookup)
    step(cache)  # the prefetch lands
    assert all(n.device is Residency.RESIDENT for n in path)
    cache.finish(running, other.token_ids, 0)
    step(cache)
    hits = cache.admissions.hit_tokens_disk
    lane = admit(cache, resume)
    assert lane.base == 6 * BLOCK_TOKENS and not lane.from_host
    assert cache.admissions.hit_tokens_disk - hits == lane.base
    assert cache.admissions.hit_tokens_device == 0
    cache.finish(lane, resume.token_ids, lane.base)
    step(cache)
    cache.audit()
