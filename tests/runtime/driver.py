"""Drives `HybridPrefixCache` as vLLM's scheduler does, without vLLM: the runtime tests' harness.

`run` takes one request through lookup, admission, chunked prefill, decode and finish, one
engine step at a time (`new_step`, the chunk, `take_plan`, `commit`), and audits the cache at
the end. Tokens are plain ints; a step's "forward pass" is the plan it hands out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_hpc.index import HostGeometry, IndexConfig, MediaItem, TapPolicy
from vllm_hpc.runtime.cache import HybridPrefixCache, InFlight, RequestInfo, RuntimeConfig
from vllm_hpc.runtime.lane import Lane
from vllm_hpc.runtime.plan import StepPlan

CHUNK = 1024
ROW_PAGES = 4
"""Pages per state row: a state (4,096 bytes) is four 1,024-byte pages."""


def make_cache(
    *,
    in_pass: bool = False,
    dense: bool = False,
    pages: int = 400,
    active_slots: int = 4,
    snapshot_slots: int = 24,
    max_new_taps: int = 16,
    lane_rows: int = 1,
    chunk_tokens: int = CHUNK,
    host_slabs: int = 0,
    disk_slabs: int = 0,
) -> HybridPrefixCache:
    policy = TapPolicy.for_engine(chunk_tokens=256 if in_pass else CHUNK, host_tier=False)
    policy = TapPolicy(
        max_new_taps=max_new_taps,
        ladder_tokens=policy.ladder_tokens,
        min_gap_tokens=policy.min_gap_tokens,
        chunk_tokens=policy.chunk_tokens,
        dense_flexible=dense,
    )
    """A cache of ``pages`` KV pages beside the rows of its scratch, ``active_slots`` running
    requests (``lane_rows`` rows each: 1 + K with K speculative tokens) and ``snapshot_slots``
    snapshots (states share the page space); a host and a disk tier of ``host_slabs`` and
    ``disk_slabs`` slabs (4 KiB: a block, or an image) where given."""
    geometry = HostGeometry(1024, 4096)
    index = IndexConfig(
        device_pages=pages + (1 + active_slots * lane_rows + snapshot_slots) * ROW_PAGES,
        geometry=geometry,
        snapshot_slots=snapshot_slots,
        first_page_id=1,
        row_pages=ROW_PAGES,
        host_budget_bytes=host_slabs * geometry.slab_bytes,
        disk_budget_bytes=disk_slabs * geometry.slab_bytes,
    )
    return HybridPrefixCache(
        RuntimeConfig(
            index=index,
            active_cap=active_slots,
            tap_policy=policy,
            chunk_tokens=chunk_tokens,
            in_pass_taps=in_pass,
            lane_rows=lane_rows,
        )
    )


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


@dataclass
class Run:
    frontier: int
    """Tokens the cache served: the request prefilled [frontier, n)."""
    chunks: list[tuple[int, int]] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)


def waiting_step(cache: HybridPrefixCache, request: RequestInfo) -> tuple[Lane | None, StepPlan]:
    """One scheduler step for a waiting request (lookup, the connector's "not yet" while
    `disk_wait` says so, else `admit`): its lane, or None when it stepped aside for a read or
    found no room; and the step's plan."""
    cache.new_step()
    lookup = cache.lookup(request)
    lane = None
    if not cache.disk_wait(request.request_id, lookup):
        lane = cache.admit(request, lookup, len(request.token_ids) - lookup.frontier)
    return lane, cache.take_plan()


def run(
    cache: HybridPrefixCache,
    tokens: Sequence[int],
    answer: Sequence[int] = (),
    *,
    request_id: str = "r",
    breakpoints: tuple[int, ...] = (),
    media: tuple[MediaItem, ...] = (),
    salt: str | None = None,
    budget: int = CHUNK,
    in_flight: int = 0,
    drafts: int = 0,
    read_limit: int | None = None,
) -> Run:
    """Prefill ``tokens`` in chunks of at most ``budget`` tokens, decode ``answer`` one token a
    step, finish, and audit. ``in_flight`` more decode steps, of one token and ``drafts``
    draft tokens each, are scheduled before the finish and never report a token, as under
    async scheduling (vLLM schedules the next step before it sees the last one's output)."""
    all_tokens = list(tokens)
    n = len(all_tokens)

    def info() -> RequestInfo:
        return RequestInfo(
            request_id, all_tokens, n, salt, breakpoints, media=media, read_limit=read_limit
        )

    cache.new_step()
    lookup = cache.lookup(info())
    result = Run(lookup.frontier)
    start = lookup.frontier
    lane = None
    computed_end = n + max(len(answer) - 1, 0)  # the last sampled token is never computed
    while start < computed_end:
        size = min(budget, n - start) if start < n else 1
        taps = lane.taps if lane is not None else lookup.taps
        size = cache.chunk_limit(taps, start, size, n)
        if lane is None:
            lane = cache.admit(info(), lookup, size)
            assert lane is not None, "no room to admit"
        else:
            assert cache.grow(lane, start + size) is not None, "no room to grow"
        cache.on_scheduled(lane, all_tokens, start, start + size)
        result.plans.append(cache.take_plan())
        result.chunks.append((start, start + size))
        start += size
        if n <= start < n + len(answer):  # the step sampled the token at position `start`
            all_tokens.append(answer[start - n])
        cache.commit(lane, all_tokens, start)
        cache.new_step()
    assert lane is not None
    first_in_flight = start
    for _ in range(in_flight):
        assert cache.grow(lane, start + 1 + drafts) is not None, "no room to grow"
        cache.on_scheduled(lane, all_tokens, start, min(start + 1 + drafts, len(all_tokens)))
        result.plans.append(cache.take_plan())
        start += 1 + drafts
        cache.new_step()
    steps = InFlight(min(in_flight, 2), first_in_flight) if in_flight else None
    cache.finish(lane, all_tokens, start, steps)
    cache.new_step()
    cache.take_plan()
    cache.new_step()
    cache.audit()
    return result
