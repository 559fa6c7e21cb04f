"""The stop's write-through of snapshots only the device holds (§5.5): the device goes at a
stop, so they reach the host tier, and from there the disk, like any publication."""

from __future__ import annotations

from tests.index.harness import BLOCK, Harness, make_index, snap, toks
from vllm_hpc.index import Residency, SnapshotWrite


def test_snapshots_that_host_pressure_left_in_device_slots_are_written_at_the_stop() -> None:
    index = make_index(host_slabs=9, disk_slabs=40)
    h = Harness(index)
    (a,) = h.run(toks(1, 4 * BLOCK), taps=[4 * BLOCK])
    (b,) = h.run(toks(2, 4 * BLOCK), taps=[4 * BLOCK])
    # b's path and image took a's host image: a stays in its slot, its path on the host.
    assert snap(a).complete_on_device and not snap(a).holds_host and snap(b).holds_host
    writes = index.write_through_at_stop()
    index.check_invariants()
    (write,) = [w for w in writes if isinstance(w, SnapshotWrite)]
    assert write.snapshot is snap(a) and write.slot == snap(a).slot
    for record in writes:
        if isinstance(record, SnapshotWrite):
            index.complete_snapshot_write(record)
        else:
            index.complete_block_write(record)
    index.check_invariants()
    flushed = write.snapshot
    assert flushed.image_host is Residency.RESIDENT
    assert all(node.host is Residency.RESIDENT for node in flushed.anchor.path())
    (to_disk,) = index.plan_disk_writes(1 << 30)  # now the write-behind takes it to disk
    assert to_disk.snapshot is flushed


def test_nothing_is_planned_when_every_snapshot_is_on_the_host() -> None:
    index = make_index(host_slabs=40)
    h = Harness(index)
    h.run(toks(3, 3 * BLOCK + 9), taps=[2 * BLOCK, 3 * BLOCK + 9])
    assert index.write_through_at_stop() == []
    index.check_invariants()
