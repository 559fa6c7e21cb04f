"""The runtime's request life cycle without vLLM, in the manner of vLLM's own
`tests/v1/core/test_prefix_caching.py`: requests driven step by step (`driver.run`), then what
a later request is served and what the cache holds, with the audit after every request."""

from __future__ import annotations

from tests.runtime.driver import ROW_PAGES, make_cache, prompt, run
from vllm_hpc.index import BLOCK_TOKENS, MediaItem
from vllm_hpc.runtime.cache import HybridPrefixCache, RequestInfo
from vllm_hpc.runtime.lane import Lane


def test_a_next_turn_resumes_from_the_endpoint_of_the_last() -> None:
    cache = make_cache()
    first, answer = prompt(1000, seed=1), prompt(80, seed=2)
    assert run(cache, first, answer).frontier == 0
    turn = first + answer + prompt(100, seed=3)
    assert run(cache, turn).frontier == len(first) + len(answer) - 1


def test_a_read_limit_caps_what_a_request_reads_and_not_what_it_writes() -> None:
    """vLLM's hit limit: 0 reads nothing (`skip_reading_prefix_cache`), N at most the first N
    tokens (prompt logprobs scored from row N on, or the scheduler's bound)."""
    cache = make_cache()
    first, answer = prompt(1000, seed=20), prompt(80, seed=21)
    run(cache, first, answer, breakpoints=(640,))
    turn = first + answer + prompt(100, seed=22)
    assert run(cache, turn, read_limit=0).frontier == 0
    assert run(cache, turn, read_limit=700).frontier == 640
    assert run(cache, turn, read_limit=639).frontier == 0
    unread = prompt(500, seed=23)
    run(cache, unread, read_limit=0)
    assert run(cache, unread + prompt(10, seed=24)).frontier > 0  # the unread run still wrote


def test_a_shared_prefix_resumes_at_the_prompt_tail_tap() -> None:
    cache = make_cache()
    shared = prompt(1000, seed=4)
    run(cache, shared)
    frontier = run(cache, shared + prompt(300, seed=5)).frontier
    assert frontier == (len(shared) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_tenants_never_read_each_others_entries() -> None:
    cache = make_cache()
    tokens = prompt(900, seed=6)
    run(cache, tokens, salt="a")
    assert run(cache, tokens, salt="b").frontier == 0
    assert run(cache, tokens).frontier == 0  # no salt is a tenant of its own
    assert run(cache, tokens, salt="a").frontier == 896


def test_media_keys_the_blocks_an_item_touches_and_the_blocks_after_it() -> None:
    cache = make_cache()
    tokens = prompt(900, seed=7)

    def item(digest: bytes) -> tuple[MediaItem, ...]:
        return (MediaItem(begin=100, length=200, digest=digest),)

    run(cache, tokens, media=item(b"a" * 16))
    assert run(cache, tokens, media=item(b"b" * 16)).frontier == 0
    assert run(cache, tokens).frontier == 0  # the same token ids without the image
    assert run(cache, tokens, media=item(b"a" * 16)).frontier == 896


def _admit(
    cache: HybridPrefixCache, request_id: str, tokens: list[int], max_output: int = 0
) -> Lane | None:
    """Admit a request and schedule its whole prompt as one chunk; None when it must wait."""
    info = RequestInfo(request_id, tokens, len(tokens), max_output_tokens=max_output)
    cache.new_step()
    lookup = cache.lookup(info)
    lane = cache.admit(info, lookup, len(tokens) - lookup.frontier)
    if lane is not None:
        cache.on_scheduled(lane, tokens, lookup.frontier, len(tokens))
    cache.take_plan()
    return lane


def test_a_request_waits_while_every_active_slot_is_held() -> None:
    cache = make_cache(active_slots=1)
    first, second = prompt(300, seed=8), prompt(300, seed=9)
    running = _admit(cache, "first", first)
    assert running is not None
    assert _admit(cache, "second", second) is None  # no slot: it waits, nothing is held for it
    cache.commit(running, first, len(first))
    cache.finish(running, first, len(first))
    later = _admit(cache, "second", second)
    assert later is not None and later.row == running.row
    cache.finish(later, second, len(second))
    cache.new_step()
    cache.take_plan()
    cache.new_step()
    cache.audit()


def test_reset_is_refused_while_a_request_runs_then_clears_the_cache() -> None:
    cache = make_cache()
    tokens = prompt(700, seed=10)
    run(cache, tokens)
    lane = _admit(cache, "running", prompt(200, seed=11))
    assert lane is not None
    assert not cache.reset()
    cache.finish(lane, (lane.prompt and []) or prompt(200, seed=11), 0)
    cache.new_step()
    assert cache.reset()
    cache.audit()
    assert run(cache, tokens).frontier == 0


def test_a_small_pool_evicts_the_oldest_entries_first() -> None:
    # 2,560 tokens beside the state rows: 60 pages, of which the scratch and three snapshots
    # leave 44 to KV when no request runs, one short of three prompts' 45
    cache = make_cache(pages=40, active_slots=1, snapshot_slots=3)
    oldest, middle, newest = (prompt(900, seed=s) for s in (12, 13, 14))
    for tokens in (oldest, middle, newest):
        run(cache, tokens)
    assert run(cache, newest).frontier == 896
    assert run(cache, oldest).frontier == 0  # its pages went to the later prompts


def test_an_admission_never_counts_its_own_source_row_as_room() -> None:
    """The available count holds a row for every snapshot that may give way, the quote's own
    source among them; admitting from it pins it, so the quote must not count its row."""
    cache = make_cache(pages=40, active_slots=2, snapshot_slots=4)
    first = prompt(300, seed=1)
    run(cache, first, [5], request_id="first")
    cache.new_step()
    cache.take_plan()
    cache.new_step()
    store = cache.index.store
    held = cache.index.allocate_pages(store.pages.num_free - ROW_PAGES)  # one free row left
    assert held is not None
    longer = first + prompt(60, seed=2)
    lane = _admit(cache, "longer", longer)  # from the root or waiting: never a crash
    if lane is not None:
        cache.finish(lane, longer, 0)
    cache.index.free_pages(held)
    cache.new_step()
    cache.take_plan()
    cache.audit()


def test_a_request_ended_with_steps_in_flight_keeps_only_what_its_tokens_name() -> None:
    """Async scheduling: a second step in flight computes a position whose token the scheduler
    never saw. No endpoint is taken there (its state would cover that token); one step in
    flight computes only known tokens, and its endpoint stands."""
    tokens, answer = prompt(300, seed=21), prompt(100, seed=22)
    known = [*tokens, *answer]
    for in_flight, resumed_at_end in ((1, True), (2, False)):
        cache = make_cache()
        run(cache, tokens, answer, in_flight=in_flight)
        after = run(cache, [*known, *prompt(40, seed=23)], request_id="next")
        assert (after.frontier == len(known)) is resumed_at_end
        assert after.frontier <= len(known)


def test_a_speculative_request_ended_with_a_step_in_flight_keeps_its_endpoint() -> None:
    """Async scheduling with MTP or GPU n-gram drafts: the step in flight begins at the last
    known token and verifies drafts past the end. Its first position holds the state after
    every known token, so the endpoint stands there. With two steps in flight there is none."""
    tokens, answer = prompt(300, seed=24), prompt(100, seed=25)
    known = [*tokens, *answer]
    for in_flight, resumed_at_end in ((1, True), (2, False)):
        cache = make_cache(lane_rows=3)
        run(cache, tokens, answer, in_flight=in_flight, drafts=2)
        after = run(cache, [*known, *prompt(40, seed=26)], request_id="next")
        assert (after.frontier == len(known)) is resumed_at_end
        assert after.frontier <= len(known)


def test_an_admission_leaves_the_running_requests_room_to_decode() -> None:
    """A running request may still take its decode reserve (256 tokens, 4 pages here): a new
    request that fits only by taking that room waits until the first finishes; one that leaves
    it, or needs none of its own, is admitted. Alone, a request never waits on a reserve."""
    cache = make_cache(pages=20)
    first = prompt(256, seed=1)
    running = _admit(cache, "first", first, max_output=1000)
    assert running is not None
    reserve = 256 // BLOCK_TOKENS
    room = cache.index.available_pages - ROW_PAGES - 2 * reserve  # the owed and its own
    tight = prompt((room + 1) * BLOCK_TOKENS, seed=2)
    assert _admit(cache, "tight", tight, max_output=reserve * BLOCK_TOKENS) is None
    admitted = _admit(cache, "short", tight, max_output=0)  # no output of its own to reserve
    assert admitted is not None
    cache.finish(admitted, tight, 0)
    cache.commit(running, first, len(first))
    cache.finish(running, first, len(first))
    cache.new_step()
    cache.take_plan()
    alone = _admit(cache, "tight", tight, max_output=reserve * BLOCK_TOKENS)
    assert alone is not None
    cache.finish(alone, tight, 0)
    cache.new_step()
    cache.take_plan()
    cache.new_step()
    cache.audit()
