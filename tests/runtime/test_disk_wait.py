"""A waiting request and its read from the disk tier, without vLLM: the steps vLLM's scheduler
takes for a waiting request (lookup, the connector's "not yet" while `disk_wait` says so, then
`admit`), driven one engine step at a time."""

from __future__ import annotations

from tests.index.harness import load_disk_only
from tests.runtime.driver import make_cache, prompt, run, waiting_step
from vllm_hpc.index import BLOCK_TOKENS, Readiness
from vllm_hpc.runtime.cache import RequestInfo

STEPS = 4
"""Steps a waiting request gets to be admitted in: a read given up costs one."""


def test_a_read_the_host_has_no_room_for_is_given_up_and_the_request_admitted() -> None:
    """The host tier's slabs are taken by another request's read in flight: the second read is
    declined, and its request is admitted without the disk at its next step (it once waited
    forever: its admission quoted the disk source again, unlike its lookup). The read in flight
    then lands and serves its own request."""
    cache = make_cache(host_slabs=4, disk_slabs=32)
    first, second = prompt(300, seed=1), prompt(300, seed=2)
    frontier = 2 * BLOCK_TOKENS  # two blocks and an image: a read of 3 of the 4 slabs
    for tokens in (first, second):
        load_disk_only(cache.index, tokens, [frontier])
    reading = RequestInfo("reading", first, len(first))
    lane, plan = waiting_step(cache, reading)
    assert lane is None and cache.reading_for("reading")
    (read,) = plan.disk_reads
    waiting = RequestInfo("waiting", second, len(second))
    assert waiting_step(cache, waiting)[0] is None
    assert cache.index.stats.disk_reads_declined == 1
    lanes = [waiting_step(cache, waiting)[0] for _ in range(STEPS)]
    lane = next((lane for lane in lanes if lane is not None), None)
    assert lane is not None and lane.base == 0  # from the root
    cache.complete_disk_read(read.batch)
    lane = waiting_step(cache, reading)[0]
    assert lane is not None and lane.base == frontier
    assert cache.admissions.hit_tokens_disk == frontier
    cache.audit()


def test_a_read_ahead_lands_before_its_requests_turn_and_serves_it() -> None:
    """A waiting request vLLM has not reached gets its read planned ahead; at its turn the
    read has landed and it is admitted at once, from the host, its hit counted from disk."""
    cache = make_cache(host_slabs=16, disk_slabs=32)
    tokens = prompt(300, seed=3)
    frontier = 2 * BLOCK_TOKENS
    load_disk_only(cache.index, tokens, [frontier])
    request = RequestInfo("ahead", tokens, len(tokens))
    cache.new_step()
    assert cache.read_ahead("ahead", cache.lookup(request))
    (read,) = cache.take_plan().disk_reads
    assert not cache.read_ahead("ahead", cache.lookup(request))  # once: it holds the read
    cache.complete_disk_read(read.batch)
    lane, plan = waiting_step(cache, request)
    assert lane is not None and lane.base == frontier and not plan.disk_reads
    assert cache.admissions.disk_reads_ahead == 1
    assert cache.admissions.hit_tokens_disk == frontier
    cache.audit()


def test_a_read_ahead_makes_room_from_copies_the_disk_holds_too() -> None:
    """The host tier is full of an earlier read's copies, unpinned once its request left: they
    are on disk too, so a read ahead takes their room, losing nothing."""
    cache = make_cache(host_slabs=3, disk_slabs=32)  # one read: two blocks and an image
    frontier = 2 * BLOCK_TOKENS
    earlier, tokens = prompt(300, seed=4), prompt(300, seed=5)
    for each in (earlier, tokens):
        load_disk_only(cache.index, each, [frontier])
    _, plan = waiting_step(cache, RequestInfo("earlier", earlier, len(earlier)))
    (read,) = plan.disk_reads
    cache.complete_disk_read(read.batch)
    cache.forget("earlier")  # it left the queue: its landed copies stay, unpinned
    assert cache.index.store.slabs.num_free == 0
    backed = cache.index.stats.host_backed_evicted
    request = RequestInfo("ahead", tokens, len(tokens))
    cache.new_step()
    assert cache.read_ahead("ahead", cache.lookup(request))
    assert len(cache.take_plan().disk_reads) == 1
    assert cache.index.stats.host_backed_evicted == backed + 3
    cache.audit()


def test_a_read_ahead_evicts_no_last_copy_and_leaves_the_read_to_its_turn() -> None:
    """The host tier is full of another request's copies, their last: a read ahead evicts
    none of them and is not counted as declined; the request's turn then tries its read as a
    hit's."""
    cache = make_cache(host_slabs=3, disk_slabs=32)
    tokens = prompt(300, seed=4)
    load_disk_only(cache.index, tokens, [2 * BLOCK_TOKENS])
    filler = run(cache, prompt(200, seed=5), request_id="filler")
    cache.complete_writes([w.batch for plan in filler.plans for w in plan.host_writes])
    slabs, stats = cache.index.store.slabs, cache.index.stats
    assert slabs.num_free == 0
    request = RequestInfo("ahead", tokens, len(tokens))
    cache.new_step()
    assert not cache.read_ahead("ahead", cache.lookup(request))
    assert not cache.take_plan().disk_reads
    assert slabs.num_free == 0 and stats.disk_reads_declined == 0
    assert cache.admissions.disk_reads_ahead == 0
    waiting_step(cache, request)
    assert stats.disk_reads_declined == 1  # its turn tried
    cache.audit()


def test_a_request_blocked_for_room_reads_its_source_while_it_waits() -> None:
    """No source fits the device while another request holds its pages, so the quote has
    none; the read from disk of the source cost would choose runs all the same while the
    request waits (§6.6's prefetch, extended to the disk)."""
    cache = make_cache(pages=10, snapshot_slots=2, active_slots=2, host_slabs=16, disk_slabs=32)
    tokens = prompt(300, seed=6)
    load_disk_only(cache.index, tokens, [2 * BLOCK_TOKENS])
    holder = prompt(900, seed=7)  # its pages and row leave too few for the request
    lane, _ = waiting_step(cache, RequestInfo("holder", holder, len(holder)))
    assert lane is not None
    request = RequestInfo("blocked", tokens, len(tokens))
    cache.new_step()
    lookup = cache.lookup(request)
    assert lookup.quote is not None and lookup.quote.readiness is Readiness.TEMPORARILY_BLOCKED
    assert cache.disk_wait("blocked", lookup)
    assert len(cache.take_plan().disk_reads) == 1 and cache.reading_for("blocked")
    cache.audit()
