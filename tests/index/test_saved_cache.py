"""Export of what a save keeps and its host-only load (§5.5)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.index.harness import BLOCK, Harness, assert_resumes, make_index, snap, toks
from vllm_hpc.index import (
    HostGeometry,
    Residency,
    SavedCache,
    SnapshotKind,
    file_placement,
    plan_host_restore,
)
from vllm_hpc.index.cache_load import restore_density


def test_export_keeps_retained_host_resident_snapshots_and_their_paths() -> None:
    index = make_index(host_slabs=40)
    h = Harness(index)
    a = toks(1, 4 * BLOCK)
    superseded, kept = h.run(a, taps=[BLOCK, 2 * BLOCK])  # the second tap supersedes the first
    assert snap(superseded).superseded
    pending = h.admit(toks(2, 2 * BLOCK + 5))
    h.tap(pending.lease, toks(2, 2 * BLOCK + 5), 2 * BLOCK + 5, write=False)  # image Filling
    saved = index.export_saved()
    (only,) = saved.snapshots
    assert only.id == snap(kept).id and only.frontier == 2 * BLOCK and only.tail_slab is None
    # Exactly the kept snapshot's path, parents first: blocks 2 and 3 of `a` are dead KV.
    path = snap(kept).anchor.path()
    assert [b.id for b in saved.blocks] == [n.id for n in path]
    assert [b.slab for b in saved.blocks] == [n.host_slab for n in path]
    assert saved.blocks[1].parent == saved.blocks[0].id
    assert saved.blocks[0].parent == saved.roots[0].id and saved.roots[0].cache_salt is None
    assert only.image_slabs == snap(kept).image_slabs
    assert saved.geometry == index.store.value.geometry


def test_load_rebuilds_host_only_and_the_next_turn_restores_from_host() -> None:
    index = make_index(host_slabs=40)
    h = Harness(index)
    a = toks(3, 3 * BLOCK + 20)
    h.run(a, taps=[2 * BLOCK + 10], salt="t1")
    h.run(toks(4, 30), taps=[17])  # anchored at a root, with a tail
    saved = index.export_saved()
    assert len(saved.snapshots) == 2 and len(saved.roots) == 2

    fresh = make_index(host_slabs=40)
    loaded = fresh.load_saved(saved)
    fresh.check_invariants()
    assert loaded.complete and loaded.snapshots == 2 and loaded.blocks == len(saved.blocks)
    assert sorted(loaded.slabs) == saved.slabs
    # A whole save goes where the file order puts it: the workers may have read it there.
    assert loaded.slabs == file_placement(saved) == {s: k for k, s in enumerate(saved.slabs)}
    assert loaded.bytes == loaded.saved_bytes == len(saved.slabs) * 4096
    store = fresh.store
    assert all(s.slot is None and s.tail_device is Residency.ABSENT for s in store.snapshots)
    for root in store.tree.roots:
        for node in store.tree.subtree(root)[:-1]:
            assert node.device is Residency.ABSENT and node.host is Residency.RESIDENT
    assert_resumes(fresh, saved)
    # The next turn resumes from the loaded snapshot through the ordinary host path.
    admission = Harness(fresh).admit([*a, 5], salt="t1")
    assert admission.frontier == 2 * BLOCK + 10 and fresh.stats.hits_host == 1


def _three_snapshot_save() -> tuple[SavedCache, dict[str, int]]:
    """Two conversations sharing two blocks (the second hit once), and one short one."""
    index = make_index(host_slabs=16)
    h = Harness(index)
    shared = toks(5, 2 * BLOCK)
    first = [*shared, *toks(6, 2 * BLOCK)]
    second = [*shared, *toks(7, 2 * BLOCK)]
    short = toks(8, BLOCK)
    ids = {
        "first": snap(h.run(first, taps=[4 * BLOCK])[0]).id,
        "second": snap(h.run(second, taps=[4 * BLOCK])[0]).id,
        "short": snap(h.run(short, taps=[BLOCK])[0]).id,
    }
    hit = h.admit([*second, 1])
    h.finish(hit.lease)
    saved = index.export_saved()
    assert len(saved.snapshots) == 3 and len(saved.blocks) == 7
    return saved, ids


@pytest.mark.parametrize(
    ("slabs", "kept"),
    [
        (4, {"short"}),  # the long ones need 5 slabs with their paths
        (5, {"second"}),  # the densest: it was hit
        (7, {"second", "short"}),  # `first` needs 3 more slabs; the short one still fits
        (8, {"second", "first"}),  # the shared blocks count once: 5 + 3
        (10, {"second", "first", "short"}),
    ],
)
def test_a_smaller_host_tier_keeps_whole_snapshots_by_value_per_byte(
    slabs: int, kept: set[str]
) -> None:
    saved, ids = _three_snapshot_save()
    fresh = make_index(host_slabs=slabs)
    loaded = fresh.load_saved(saved)
    fresh.check_invariants()
    chosen = tuple(s for s in saved.snapshots if s.id in {ids[name] for name in kept})
    assert loaded.snapshots == len(fresh.store.snapshots) == len(chosen)
    assert loaded.complete == (len(chosen) == 3)
    assert_resumes(fresh, replace(saved, snapshots=chosen))
    # Exactly the chosen snapshots' slabs: their images and their paths' blocks, once each.
    plan = plan_host_restore(saved, slabs, fresh.store.value)
    assert plan.snapshots == chosen
    wanted = sorted(replace(saved, snapshots=chosen, blocks=plan.blocks).slabs)
    assert sorted(loaded.slabs) == wanted and plan.slabs == len(wanted)
    assert fresh.store.slabs.num_free == slabs - len(wanted)
    assert (loaded.slabs == file_placement(saved)) == loaded.complete


def test_density_is_hits_times_prefill_from_the_root_per_byte() -> None:
    saved, ids = _three_snapshot_save()
    second = next(s for s in saved.snapshots if s.id == ids["second"])
    # (1 + 1 hit) * (256 ms + 256·257/2 µs - 4 ms restore) / (4000 image + 4 · 1000 blocks)
    expected = 2 * (0.256 + 256 * 257 / 2 * 1e-6 - 0.004) / 8000
    assert restore_density(second, 4, make_index().store.value) == pytest.approx(expected)


def test_load_refuses_a_non_empty_index_and_malformed_records() -> None:
    saved, _ = _three_snapshot_save()
    busy = make_index(host_slabs=16)
    Harness(busy).run(toks(9, BLOCK), taps=[BLOCK])
    with pytest.raises(ValueError, match="empty index"):
        busy.load_saved(saved)
    fresh = make_index(host_slabs=16)
    bad = [
        replace(saved, geometry=HostGeometry(block_bytes=999, image_bytes=4000)),
        replace(saved, blocks=saved.blocks[::-1]),  # children before parents
        replace(saved, snapshots=(replace(saved.snapshots[0], frontier=3),)),
        replace(saved, snapshots=(replace(saved.snapshots[0], image_slabs=()),)),
        replace(saved, snapshots=(saved.snapshots[0], saved.snapshots[0])),
        replace(saved, blocks=(*saved.blocks, replace(saved.blocks[-1], id=10_000))),
    ]
    for records in bad:
        with pytest.raises(ValueError):
            fresh.load_saved(records)
        assert not fresh.store.tree.roots and fresh.store.slabs.num_free == 16
    assert fresh.load_saved(saved).complete


def test_kinds_hits_and_salts_survive_a_load() -> None:
    index = make_index(host_slabs=20)
    h = Harness(index)
    tokens = toks(10, 2 * BLOCK + 3)
    (endpoint,) = h.run(tokens, endpoint=True, salt="tenant")
    assert snap(endpoint).kind is SnapshotKind.ENDPOINT
    saved = index.export_saved()
    fresh = make_index(host_slabs=20)
    fresh.load_saved(saved)
    (loaded,) = fresh.store.snapshots
    assert loaded.kind is SnapshotKind.ENDPOINT and loaded.hits == 0
    assert fresh.store.tree.salt_of(fresh.store.tree.roots[0]) == "tenant"


def test_a_stop_saves_snapshots_that_host_pressure_left_only_in_device_slots() -> None:
    index = make_index(host_slabs=8)
    h = Harness(index)
    (a,) = h.run(toks(1, 4 * BLOCK), taps=[4 * BLOCK])
    (b,) = h.run(toks(2, 4 * BLOCK), taps=[4 * BLOCK])
    # b's blocks took both host images; the snapshots stay in their slots, the paths on host.
    assert index.export_saved().snapshots == ()
    assert all(snap(p).complete_on_device and not snap(p).holds_host for p in (a, b))
    plan = index.plan_save()
    (flush,) = plan.flushes  # 8 slabs: two paths of 4, room for one image beside one path
    (saved,) = plan.saved.snapshots
    assert flush.snapshot.id == saved.id and flush.slot == flush.snapshot.slot
    assert saved.image_slabs == flush.image_slabs
    path = {block.slab for block in plan.saved.blocks}
    assert len(path) == 4 and not path & set(flush.image_slabs)
    index.check_invariants()  # planning changed nothing
    assert index.export_saved().snapshots == ()

    fresh = make_index(host_slabs=8)
    loaded = fresh.load_saved(plan.saved)
    fresh.check_invariants()
    assert loaded.complete and loaded.blocks == 4
    assert_resumes(fresh, plan.saved)


def test_a_stop_flush_never_takes_a_slab_that_a_saved_path_or_image_uses() -> None:
    index = make_index(host_slabs=10)
    h = Harness(index)
    for seed in range(1, 4):
        h.run(toks(seed, 3 * BLOCK), taps=[3 * BLOCK])
    (kept,) = index.export_saved().snapshots  # one snapshot kept its host image
    plan = index.plan_save()
    assert len(plan.flushes) == 1 and len(plan.saved.snapshots) == 2
    named = plan.saved.slabs
    assert len(named) == len(set(named))  # no slab holds two things the file keeps
    (flush,) = plan.flushes
    assert not set(flush.image_slabs) & set(kept.image_slabs)
    fresh = make_index(host_slabs=10)
    assert fresh.load_saved(plan.saved).complete
    fresh.check_invariants()
    assert_resumes(fresh, plan.saved)
