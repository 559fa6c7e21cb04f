"""Device snapshot slot choice in the §9.2 order (§13.1 'Device slots')."""

from __future__ import annotations

import pytest

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from vllm_hpc.index import Residency, SnapshotKind


def test_superseded_owners_go_first_oldest_supersession_first() -> None:
    h = Harness(make_index(host_slabs=32, slots=2))
    prompt = toks(1, 3 * BLOCK + 5)
    s64, s128, s192 = map(snap, h.run(prompt, taps=[BLOCK, 2 * BLOCK, 3 * BLOCK]))
    # s64 was superseded first; it had a host copy, so it keeps that and loses only the slot.
    assert s64.superseded and s128.superseded
    assert s64.slot is None and s64.image_host is Residency.RESIDENT
    assert s128.slot is not None and s192.slot is not None


def test_a_superseded_owner_without_host_copy_is_deleted() -> None:
    h = Harness(make_index(slots=2))
    prompt = toks(2, 3 * BLOCK + 5)
    s64, _, _ = map(snap, h.run(prompt, taps=[BLOCK, 2 * BLOCK, 3 * BLOCK]))
    assert s64 not in h.index.store.snapshots


def test_device_only_owner_with_lowest_value_goes_when_the_new_one_is_worth_as_much() -> None:
    h = Harness(make_index(slots=2))  # no host tier: every snapshot is device-only
    (small,) = map(snap, h.run(toks(3, BLOCK + 1), taps=[BLOCK]))
    (large,) = map(snap, h.run(toks(4, 5 * BLOCK + 1), taps=[5 * BLOCK]))
    # H(small) = 0.06208 / 4000 = 1.552e-5 (C = 0.064 + 64·65/2·1e-6 - 0.004, Z = image)
    # H(large) = 0.36736 / 4000 = 9.184e-5
    assert small.priority == pytest.approx(1.552e-5)
    assert large.priority == pytest.approx(9.184e-5)
    # New tap at 128 from the root: estimate = L + C(0..128) / (4000 + 2·1000)
    #   = 0 + 0.132256 / 6000 = 2.2043e-5 >= H(small): small is lost, L := 1.552e-5.
    (mid,) = map(snap, h.run(toks(5, 2 * BLOCK + 1), taps=[2 * BLOCK]))
    assert small not in h.index.store.snapshots
    assert h.index.store.value.inflation == pytest.approx(1.552e-5)
    # H(mid) = L_s + 0.132256 / 4000 = 1.552e-5 + 3.3064e-5 = 4.8584e-5.
    assert mid.priority == pytest.approx(4.8584e-5)
    # Estimate of a new tap at 64: 1.552e-5 + 0.06208 / 5000 = 2.7936e-5 < 4.8584e-5, and no
    # owner is host-backed: the tap is skipped.
    (skipped,) = h.run(toks(6, BLOCK + 1), taps=[BLOCK])
    assert skipped is None
    assert h.index.stats.taps_skipped_no_slot == 1
    assert {mid, large} == set(h.index.store.snapshots)


def test_the_least_recently_hit_host_backed_owner_loses_only_its_device_copy() -> None:
    h = Harness(make_index(host_slabs=32, slots=2))
    a, b = toks(7, BLOCK + 5), toks(8, BLOCK + 5)
    (s_a,) = map(snap, h.run(a, taps=[BLOCK]))
    (s_b,) = map(snap, h.run(b, taps=[BLOCK]))
    h.run(a)  # hit on s_a: s_b is now the least recently hit
    (s_c,) = map(snap, h.run(toks(9, BLOCK + 5), taps=[BLOCK]))
    assert s_b.slot is None and s_b.image_host is Residency.RESIDENT
    assert s_a.slot is not None and s_c.slot is not None
    assert s_b in h.index.store.snapshots


def test_a_staged_slot_can_be_given_back() -> None:
    h = Harness(make_index(slots=1))
    prompt = toks(10, 2 * BLOCK)
    admission = h.admit(prompt)
    slot = h.index.take_snapshot_slot(admission.lease, SnapshotKind.TAP, BLOCK)
    assert slot is not None and h.index.store.slots.num_free == 0
    h.check()
    h.index.return_snapshot_slot(slot)
    assert h.index.store.slots.num_free == 1
    with pytest.raises(ValueError, match="not staged"):
        h.index.return_snapshot_slot(slot)
    h.finish(admission.lease)
