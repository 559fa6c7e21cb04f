"""A waiting request and its read from the disk tier, without vLLM: the steps vLLM's scheduler
takes for a waiting request (lookup, the connector's "not yet" while `disk_wait` says so, then
`admit`), driven one engine step at a time."""

from __future__ import annotations

from tests.index.harness import load_disk_only
from tests.runtime.driver import make_cache, prompt, waiting_step
from vllm_hpc.index import BLOCK_TOKENS
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
