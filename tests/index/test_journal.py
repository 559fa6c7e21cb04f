"""The residency journal behind KV cache events (issue #19): what it records, in what order."""

from __future__ import annotations

from tests.index.harness import BLOCK, Harness, JournalReplay, make_index, toks
from vllm_hpc.index.journal import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    SnapshotPublished,
    SnapshotRemoved,
)
from vllm_hpc.index.types import Medium


def test_off_by_default_records_nothing() -> None:
    h = Harness(make_index())
    h.run(toks(1, 3 * BLOCK + 5), [2 * BLOCK])
    assert h.index.journal is None and h.index.store.journal is None
    assert h.index.drain_events() == []


def test_blocks_parents_first_then_the_snapshot_then_host_copies() -> None:
    h = Harness(make_index(host_slabs=20, record_events=True))
    prompt = toks(2, 3 * BLOCK + 5)
    h.run(prompt, [2 * BLOCK + 7])
    events = h.index.drain_events()
    device = [e.node for e in events if isinstance(e, BlockStored) and e.medium is Medium.DEVICE]
    assert [n.depth for n in device] == [0, 1, 2]
    assert (
        b"".join(n.tokens for n in device) == h.index.prepare_prompt(prompt).tokens[: 3 * BLOCK * 4]
    )
    published = [e for e in events if isinstance(e, SnapshotPublished)]
    assert {e.medium for e in published} == {Medium.DEVICE, Medium.HOST}
    assert all(e.frontier == 2 * BLOCK + 7 and e.anchor is device[1] for e in published)
    host = [e.node for e in events if isinstance(e, BlockStored) and e.medium is Medium.HOST]
    assert set(host) <= set(device)
    assert events.index(published[0]) > events.index(BlockStored(device[1], Medium.DEVICE))
    assert h.index.drain_events() == [], "drain clears"
    replay = JournalReplay()
    replay.apply(events)
    replay.check(h.index)


def test_eviction_and_deletion_are_removals() -> None:
    """A full device tier without a host tier deletes old blocks (§9.4): each one's stored
    copy comes back as a removal, and its snapshot's too."""
    h = Harness(make_index(pages=8, slots=1, record_events=True))
    replay = JournalReplay()
    first = toks(3, 4 * BLOCK + 3)
    h.run(first, [3 * BLOCK])
    replay.check(h.index)
    h.run(toks(4, 6 * BLOCK + 3), [5 * BLOCK])
    events = h.index.drain_events()
    removed = {e.node for e in events if isinstance(e, BlockRemoved)}
    assert removed and all(e.medium is Medium.DEVICE for e in events if isinstance(e, BlockRemoved))
    assert any(isinstance(e, SnapshotRemoved) for e in events)
    assert all(node.tokens in h.index.prepare_prompt(first).tokens for node in removed)
    replay.apply(events)
    replay.check(h.index)


def test_reset_is_one_all_cleared() -> None:
    h = Harness(make_index(host_slabs=20, record_events=True))
    h.run(toks(5, 2 * BLOCK + 1), [BLOCK])
    replay = JournalReplay()
    replay.check(h.index)
    assert h.index.reset()
    assert h.index.drain_events() == [AllCleared()]
    replay.apply([AllCleared()])
    replay.check(h.index)
    assert not replay.blocks and not replay.snapshots
