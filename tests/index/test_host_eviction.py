"""Host tier eviction order (§9.3, §13.1 'Host GDSF')."""

from __future__ import annotations

import pytest

from tests.index.harness import BLOCK, Harness, make_index, toks
from vllm_hpc.index import Residency


def test_dead_kv_is_reclaimed_before_any_snapshot() -> None:
    # 5 slabs: a snapshot (1 image + 2 blocks) and 2 blocks no snapshot can reach.
    h = Harness(make_index(host_slabs=5))
    (tap,) = h.run(toks(1, 2 * BLOCK + 5), taps=[2 * BLOCK])
    h.run(toks(2, 2 * BLOCK))  # no snapshot: its two host blocks are dead KV
    store = h.index.store
    assert store.slabs.num_free == 0 and len(store.host.dead) == 2
    h.run(toks(3, 2 * BLOCK))  # needs two slabs
    assert h.index.stats.host_dead_reclaimed == 2
    assert h.index.stats.host_gdsf_evicted == h.index.stats.host_superseded_evicted == 0
    assert tap is not None and tap.snapshot.image_host is Residency.RESIDENT


def test_the_victims_exclusive_path_is_freed() -> None:
    h = Harness(make_index(pages=16, host_slabs=3))
    prompt = toks(4, 2 * BLOCK + 5)
    (tap,) = h.run(prompt, taps=[2 * BLOCK])
    assert tap is not None
    victim = tap.snapshot
    index, store = h.index, h.index.store
    grabbed = index.allocate_pages(index.available_pages)  # push every cached page off the device
    assert grabbed is not None
    index.free_pages(grabbed)
    assert victim.slot is not None  # the image is in a snapshot slot, not a page
    store.drop_snapshot_image_device(victim)  # host-only now: eviction will delete it
    h.run(toks(5, 3 * BLOCK))  # its write needs all three slabs
    stats = index.stats
    assert (stats.host_gdsf_evicted, stats.host_dead_reclaimed) == (1, 2)
    assert victim not in store.snapshots
    assert index.match(index.prepare_prompt(prompt)).path == []  # both blocks deleted
    h.check()


def test_superseded_snapshots_go_first_and_keep_l() -> None:
    h = Harness(make_index(host_slabs=6, slots=4))
    prompt = toks(6, 3 * BLOCK + 5)
    old, new = h.run(prompt, taps=[BLOCK, 3 * BLOCK])  # the second tap supersedes the first
    assert old is not None and new is not None
    assert old.snapshot.superseded and not new.snapshot.superseded
    # Host: 2 images + 3 blocks = 5 of 6 slabs; a two-block request needs one slab more.
    # Nothing is dead, and the superseded snapshot goes before GDSF is consulted.
    h.run(toks(7, 2 * BLOCK))
    assert h.index.stats.host_superseded_evicted == 1
    # Only its host copy went: it still sits in a device slot and serves an edit there.
    assert old.snapshot in h.index.store.snapshots
    assert old.snapshot.image_host is Residency.ABSENT and old.snapshot.slot is not None
    assert h.index.store.value.inflation == 0.0
    h.check()
    edit = prompt[: BLOCK + 3] + toks(11, BLOCK)
    assert h.index.match(h.index.prepare_prompt(edit)).candidates[-1] is old.snapshot


def test_a_superseded_snapshot_without_a_device_copy_is_deleted() -> None:
    h = Harness(make_index(host_slabs=6, slots=4))
    old, new = h.run(toks(6, 3 * BLOCK + 5), taps=[BLOCK, 3 * BLOCK])
    assert old is not None and new is not None
    h.index.store.drop_snapshot_image_device(old.snapshot)
    h.run(toks(7, 2 * BLOCK))
    assert h.index.stats.host_superseded_evicted == 1
    assert old.snapshot not in h.index.store.snapshots
    h.check()


def test_an_image_write_displaces_only_snapshots_worth_no_more() -> None:
    h = Harness(make_index(host_slabs=5, slots=4))
    (high,) = h.run(toks(8, 4 * BLOCK + 1), taps=[4 * BLOCK])  # 1 image + 4 blocks: full
    assert high is not None and h.index.store.slabs.num_free == 0
    # H(high) = 0.284896 / 8000 = 3.5612e-5
    #   (C = 0.256 + 256·257/2·1e-6 - 0.004, Z = 4000 + 4·1000)
    assert high.snapshot.priority == pytest.approx(3.5612e-5)
    low_prompt = toks(9, BLOCK + 2)
    low_admission = h.admit(low_prompt)
    low = h.tap(low_admission.lease, low_prompt, BLOCK)
    # H(low) = 0.06208 / 4000 = 1.552e-5 < H(high): the write is declined, high stays.
    assert low is not None and low.write is None
    assert low.snapshot.priority == pytest.approx(1.552e-5)
    assert h.index.stats.host_writes_declined == 1
    assert high.snapshot.image_host is Residency.RESIDENT
    mid_prompt = toks(10, 6 * BLOCK + 1)
    mid_admission = h.admit(mid_prompt)
    mid = h.tap(mid_admission.lease, mid_prompt, 6 * BLOCK)
    # H(mid) = (0.384 + 384·385/2·1e-6 - 0.004) / 4000 = 0.45392 / 4000 = 1.1348e-4 > H(high):
    # high gives up its host copy but, complete on the device, stays restorable; L rises.
    assert mid is not None and mid.write is not None
    assert high.snapshot in h.index.store.snapshots and high.snapshot.image_slabs == ()
    assert high.snapshot.slot is not None
    assert h.index.store.value.inflation == pytest.approx(3.5612e-5)
    h.finish(mid_admission.lease)
    h.finish(low_admission.lease)
