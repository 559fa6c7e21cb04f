"""GDSF values computed by hand (§9.3, §13.1 'Host GDSF').

Cost model of ``simple_cost``: prefill(B, S) = S·1e-3 + (B·S + S(S+1)/2)·1e-6 seconds,
restore of one 4000-byte image = 4000 / 1e6 = 0.004 s. Block records are 1000 bytes, so
Z = 4000 (image) + 1000 per exclusive host block (+ 1000 for a tail).
"""

from __future__ import annotations

import pytest

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from vllm_hpc.index import Snapshot
from vllm_hpc.index.host_eviction import ValuedSnapshot


def gdsf_victim(h: Harness) -> Snapshot:
    victim = h.index.store.host.next_victim(h.index.store.snapshots, h.index.store.superseded, None)
    assert isinstance(victim, ValuedSnapshot)
    return victim.snapshot


def test_two_siblings() -> None:
    h = Harness(make_index(host_slabs=16))
    trunk = toks(1, 2 * BLOCK)
    (left,) = h.run(trunk + toks(2, BLOCK), taps=[3 * BLOCK])
    s_left = snap(left)
    # Alone, s_left owns all three host blocks: Z = 4000 + 3·1000 = 7000.
    assert s_left.size == 7000
    (right,) = h.run(trunk + toks(3, 3 * BLOCK), taps=[5 * BLOCK])
    s_right = snap(right)
    # C(left)  = prefill(0, 192) - 0.004 = 0.192 + 192·193/2·1e-6 - 0.004
    #          = 0.192 + 0.018528 - 0.004 = 0.206528
    # Z(left)  = 4000 + 1000 (block 2 only: the trunk is now shared)         = 5000
    # H(left)  = 0 + 1 · 0.206528 / 5000                                     = 4.13056e-5
    assert s_left.cost == pytest.approx(0.206528)
    assert s_left.size == 5000
    assert s_left.priority == pytest.approx(4.13056e-5)
    # C(right) = prefill(0, 320) - 0.004 = 0.320 + 320·321/2·1e-6 - 0.004
    #          = 0.320 + 0.05136 - 0.004 = 0.36736
    # Z(right) = 4000 + 3·1000                                               = 7000
    # H(right) = 0.36736 / 7000                                              = 5.248e-5
    assert s_right.cost == pytest.approx(0.36736)
    assert s_right.size == 7000
    assert s_right.priority == pytest.approx(5.248e-5)
    assert gdsf_victim(h) is s_left


def test_nested_ancestor_and_descendant() -> None:
    h = Harness(make_index(host_slabs=16))
    prompt = toks(4, 5 * BLOCK + 10)
    (deep,) = h.run(prompt, taps=[5 * BLOCK])
    # A shorter prompt cannot use the tap at 320 (F > n - 1), prefills from the root and
    # publishes a tap at 128 between the root and the deep one: no lineage supersession.
    (shallow,) = h.run(prompt[: 3 * BLOCK], taps=[2 * BLOCK])
    s_deep, s_shallow = snap(deep), snap(shallow)
    assert s_deep.ancestor is s_shallow and s_shallow.ancestor is None
    # C(shallow) = prefill(0, 128) - 0.004 = 0.128 + 128·129/2·1e-6 - 0.004 = 0.132256
    # Z(shallow) = 4000 (blocks 0-1 are below both snapshots: not exclusive)
    # H(shallow) = 0.132256 / 4000 = 3.3064e-5
    assert (s_shallow.cost, s_shallow.size) == (pytest.approx(0.132256), 4000)
    assert s_shallow.priority == pytest.approx(3.3064e-5)
    # C(deep) = prefill(128, 192) - 0.004
    #         = 0.192 + (128·192 + 192·193/2)·1e-6 - 0.004 = 0.192 + 0.043104 - 0.004
    #         = 0.231104
    # Z(deep) = 4000 + 3·1000 (blocks 2-4) = 7000
    # H(deep) = 0.231104 / 7000 = 3.301485714e-5   (just below the shallow one)
    assert (s_deep.cost, s_deep.size) == (pytest.approx(0.231104), 7000)
    assert s_deep.priority == pytest.approx(3.301485714e-5)
    assert gdsf_victim(h) is s_deep
    # Superseding the shallow one makes the deep one carry the whole prefix:
    # C(deep) = prefill(0, 320) - 0.004 = 0.36736, Z(deep) = 4000 + 5·1000 = 9000,
    # H(deep) = 0.36736 / 9000 = 4.081777...e-5
    h.index.store.set_superseded(s_shallow, True)
    assert (s_deep.cost, s_deep.size) == (pytest.approx(0.36736), 9000)
    assert s_deep.priority == pytest.approx(0.36736 / 9000)
    assert s_shallow.size == 4000
    h.check()


def test_frequency_and_aging() -> None:
    h = Harness(make_index(host_slabs=16))
    x, y = toks(5, 2 * BLOCK + 5), toks(6, 2 * BLOCK + 5)
    s_x = snap(h.run(x, taps=[2 * BLOCK])[0])
    s_y = snap(h.run(y, taps=[2 * BLOCK])[0])
    # Equal shapes: C = 0.132256 (as above), Z = 4000 + 2·1000 = 6000,
    # H = 0.132256 / 6000 = 2.204266...e-5 for both.
    assert s_x.priority == pytest.approx(0.132256 / 6000)
    assert s_y.priority == s_x.priority
    h.run(x)  # resumes from s_x: one hit, F = 2, L_s = L = 0
    assert s_x.hits == 1
    assert s_x.priority == pytest.approx(2 * 0.132256 / 6000)
    assert gdsf_victim(h) is s_y
    # Evict s_y (it is complete on the device too, so only its host copy goes): L := H(s_y).
    h.index.store.make_host_room(h.index.store.slabs.num_free + 1)
    assert h.index.store.value.inflation == pytest.approx(0.132256 / 6000)
    assert s_y.image_slabs == () and s_y in h.index.store.snapshots
    # A later hit stamps the new L: H(x) = L + 3 · 0.132256 / 6000.
    h.run(x)
    assert s_x.base_l == pytest.approx(0.132256 / 6000)
    assert s_x.priority == pytest.approx(0.132256 / 6000 + 3 * 0.132256 / 6000)


def test_tail_counts_in_size_and_l_stamps_new_snapshots() -> None:
    h = Harness(make_index(host_slabs=16))
    prompt = toks(7, 2 * BLOCK + 20)
    s_tail = snap(h.run(prompt, taps=[BLOCK + 10])[0])
    # A tail adds one block record: Z = 4000 + 1000 (tail) + 1000 (block 0, host) = 6000.
    # C = prefill(0, 74) - 0.004 = 0.074 + 74·75/2·1e-6 - 0.004 = 0.074 + 0.002775 - 0.004
    #   = 0.072775
    assert s_tail.size == 6000
    assert s_tail.cost == pytest.approx(0.072775)
    h.index.store.value.inflation = 1.0  # as if earlier evictions had raised L
    s_new = snap(h.run(toks(8, BLOCK + 5), taps=[BLOCK])[0])
    # C = prefill(0, 64) - 0.004 = 0.064 + 64·65/2·1e-6 - 0.004 = 0.06208; Z = 4000 + 1000
    assert s_new.base_l == 1.0
    assert s_new.priority == pytest.approx(1.0 + 0.06208 / 5000)


def test_inflation_never_decreases() -> None:
    """Evicting a snapshot whose recomputed H fell below L leaves L unchanged."""
    h = Harness(make_index(host_slabs=32))
    prompt = toks(9, 5 * BLOCK + 1)
    deep = snap(h.run(prompt, taps=[5 * BLOCK])[0])
    value = h.index.store.value
    value.inflation = 1.0
    # A new ancestor takes over most of deep's prefill: deep's C (and H) drop, L stays.
    snap(h.run(prompt[: 4 * BLOCK + 1], taps=[4 * BLOCK])[0])
    assert deep.priority < 1.0
    assert gdsf_victim(h) is deep
    h.index.store.drop_snapshot_image_device(deep)  # make it host-only so eviction deletes it
    h.index.store.make_host_room(h.index.store.slabs.num_free + 1)
    assert deep not in h.index.store.snapshots
    assert value.inflation == 1.0
    h.check()
