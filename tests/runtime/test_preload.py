"""The start-up read of the disk tier into the host tier (§5.5), without vLLM: journaled entries
loaded disk-only as a restart brings them back, then engine steps, with and without requests,
whose plans carry the reads; the workers' reports complete them."""

from __future__ import annotations

from tests.index.harness import load_disk_only
from tests.runtime.driver import make_cache, prompt, waiting_step
from vllm_hpc.index import BLOCK_TOKENS, Snapshot
from vllm_hpc.index.types import Medium
from vllm_hpc.runtime.cache import HybridPrefixCache, RequestInfo
from vllm_hpc.runtime.plan import StepPlan

FRONTIER = 2 * BLOCK_TOKENS
"""Each conversation's snapshot: two blocks and an image, a read of 3 slabs."""


def restarted(host_slabs: int, conversations: int) -> tuple[HybridPrefixCache, list[Snapshot]]:
    """A cache whose disk holds ``conversations`` snapshots, the later ones hit more (worth
    more), and the preload started as after the journal's replay."""
    cache = make_cache(host_slabs=host_slabs, disk_slabs=64)
    snapshots = [
        load_disk_only(cache.index, prompt(300, seed=seed), [FRONTIER], hits=seed)[0]
        for seed in range(conversations)
    ]
    cache.preload.start()
    return cache, snapshots


def idle_step(cache: HybridPrefixCache) -> StepPlan:
    """A step without requests whose reads every worker reported landed."""
    cache.new_step()
    plan = cache.take_plan()
    for read in plan.disk_reads:
        cache.complete_disk_read(read.batch)
    return plan


def test_the_most_valuable_are_read_one_at_a_time_into_free_room_only() -> None:
    """Eight host slabs hold two of three reads: the two worth most, in that order, one per
    step; the third stays on disk, and nothing is evicted for it."""
    cache, (cheap, middle, dear) = restarted(host_slabs=8, conversations=3)
    assert cache.preloading
    order = []
    for _ in range(8):
        plan = idle_step(cache)
        assert len(plan.disk_reads) <= 1
        order += [s for s in (cheap, middle, dear) if Medium.HOST in s.media and s not in order]
        if not cache.preloading:
            break
    assert not cache.preloading and order == [dear, middle]
    assert cheap.media == {Medium.DISK}
    assert cache.preload.progress.read == 2 and cache.preload.progress.slabs == 6
    assert cache.index.stats.disk_reads_declined == 0
    assert cache.disk.read_bytes == 6 * cache.config.index.geometry.slab_bytes
    cache.audit()


def test_a_request_whose_snapshot_is_being_read_waits_for_that_read() -> None:
    """A request's own read goes first in its step's plan, the preload's after it; a request
    whose snapshot the preload is reading waits for that read (no second read) and resumes
    from it, counted as a disk hit."""
    cache, (other, dear) = restarted(host_slabs=32, conversations=2)
    first = RequestInfo("first", prompt(300, seed=0), 300)
    lane, plan = waiting_step(cache, first)
    assert lane is None
    own, preloaded = plan.disk_reads  # its own read first, then the preload's of the dearest
    assert own.records[-1].disk == other.image_disk_slabs
    assert preloaded.records[-1].disk == dear.image_disk_slabs
    reads = cache.index.stats.disk_reads
    waiting = RequestInfo("waiting", prompt(300, seed=1), 300)
    assert waiting_step(cache, waiting)[0] is None and cache.reading_for("waiting")
    for read in plan.disk_reads:
        cache.complete_disk_read(read.batch)
    lane = waiting_step(cache, waiting)[0]
    assert lane is not None and lane.base == FRONTIER
    assert cache.index.stats.disk_reads == reads  # the preload's read served it
    assert cache.admissions.hit_tokens_disk == FRONTIER
    assert dear.disk_pins == 0  # released at its admission
    assert waiting_step(cache, first)[0] is not None
    cache.audit()


def test_a_read_that_fails_its_check_drops_its_record_and_the_next_is_read() -> None:
    cache, (cheap, dear) = restarted(host_slabs=32, conversations=2)
    cache.new_step()
    (read,) = cache.take_plan().disk_reads
    damaged = len(read.records) - 1  # the snapshot's record, after its blocks
    assert cache.fail_disk_read(read.batch, [damaged]) is not None
    assert dear not in cache.index.store.snapshots and cache.preload.progress.failed == 1
    while cache.preloading:
        idle_step(cache)
    assert cheap.media == {Medium.DISK, Medium.HOST}
    cache.audit()


def test_the_stop_plans_no_more_reads() -> None:
    cache, _ = restarted(host_slabs=32, conversations=2)
    idle_step(cache)
    assert cache.preloading
    cache.write_through_at_stop()
    assert not cache.preloading and not idle_step(cache).disk_reads
    cache.audit()


def test_two_requests_awaiting_one_read_keep_it_until_the_last_is_admitted() -> None:
    cache, (dear,) = restarted(host_slabs=32, conversations=1)
    cache.new_step()
    (read,) = cache.take_plan().disk_reads  # the start-up read of the only snapshot
    tokens = prompt(300, seed=0)  # the snapshot's conversation; another turn parts at 150
    other = tokens[:150] + prompt(150, seed=9)  # (not a sibling: they share only its blocks)
    first, second = RequestInfo("first", tokens, 300), RequestInfo("second", other, 300)
    assert waiting_step(cache, first)[0] is None and waiting_step(cache, second)[0] is None
    cache.complete_disk_read(read.batch)
    cache.audit()  # one landed read, kept for both
    lane = waiting_step(cache, first)[0]
    assert lane is not None and lane.base == FRONTIER
    assert dear.disk_pins == 1  # still kept: the second awaits it
    cache.audit()
    lane = waiting_step(cache, second)[0]
    assert lane is not None and lane.base == FRONTIER and dear.disk_pins == 0
    cache.audit()
