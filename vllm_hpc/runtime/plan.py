"""What one engine step must copy before its forward pass.

The scheduler side decides; the workers execute. Copies run in list order, before the step's
forward pass: a capture (an active state saved into a snapshot slot) planned before a restore
that reads the same slot is therefore seen by it. Host writes run after the state copies (they
may read a slot just captured into); host restores overlap the forward pass, layer by layer.
In-pass captures run during the forward pass: each GDN layer saves its part as it computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StateCopy:
    """Copy one state row (every GDN layer, conv and recurrent state) into another.

    After a speculative step the state after the last accepted token is spread out (vLLM's
    layout, `Lane.accepted`): the recurrent state sits in another row of the request, and the
    conv window some columns into the conv buffer. Such a copy gathers it into the layout a
    prefill leaves (recurrent state in the row, conv window in the first columns), which is
    what a snapshot holds and a resume reads."""

    src: int
    dst: int
    recurrent_src: int | None = None
    """The row holding the recurrent state to copy; None: ``src``."""
    conv_offset: int = 0
    """Columns of ``src``'s conv buffer before the window: the copy drops them."""

    @property
    def reads(self) -> tuple[int, ...]:
        return (self.src,) if self.recurrent_src is None else (self.src, self.recurrent_src)


@dataclass(frozen=True, slots=True)
class InPassCapture:
    """Save a running request's state ``offset`` tokens into this step's prefill chunk into
    state row ``dst``, during the forward pass.

    The GDN prefill kernel computes the state at every 64-token chunk of each sequence anyway;
    a tap there needs no pass of its own (no chunk split), only this copy. ``row`` is the
    request's state row: it names the request in the batch.
    """

    row: int
    offset: int
    dst: int


@dataclass(frozen=True, slots=True)
class PageCopy:
    """Copy one attention KV page into another (a partial tail, copy-on-write)."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class PageSlab:
    """A KV page and the host slab of the same block, in either direction (the index's
    `BlockCopy` without its node: the workers get numbers only)."""

    page: int
    slab: int


@dataclass(frozen=True, slots=True)
class ImageCopy:
    """One state row and the host slabs of its snapshot image, in either direction."""

    row: int
    slabs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HostWrite:
    """Write-through of one batch, device -> host (§7.6); the workers report ``batch`` done."""

    batch: int
    blocks: tuple[PageSlab, ...]
    """Released blocks and snapshot tails."""
    images: tuple[ImageCopy, ...]


@dataclass(frozen=True, slots=True)
class HostRestore:
    """One admission's restore, host -> device (§6.4-§6.5), in the order the forward reads it."""

    blocks: tuple[PageSlab, ...]
    """The path's host-only blocks, then the lane's copy of the tail."""
    tail: PageSlab | None
    """The snapshot's tail back into a cache-owned page."""
    image: ImageCopy | None
    """The state into the lane's state row."""


@dataclass(frozen=True, slots=True)
class SlabRecord:
    """One record of the disk tier, host slabs and disk slabs pairwise in its byte order, in
    either direction: a block's slab, or a snapshot's image slabs then its tail slab. The
    journal's CRC-32 is over a record's bytes."""

    host: tuple[int, ...]
    disk: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DiskWriteBatch:
    """Write-behind of one batch, host -> disk (disk-tier plan §1); each worker reports
    ``batch`` landed with one CRC-32 per record, or failed."""

    batch: int
    records: tuple[SlabRecord, ...]


@dataclass(frozen=True, slots=True)
class DiskReadBatch:
    """One snapshot's disk-only records read back, disk -> host, for a waiting request
    (disk-tier plan §4); each worker checks every record against its CRC-32 in the journal
    and reports ``batch`` ended with the records that failed."""

    batch: int
    records: tuple[SlabRecord, ...]


@dataclass(slots=True)
class StepPlan:
    """The copies of one step, in execution order."""

    state_zeros: list[int] = field(default_factory=list)
    """State rows that held KV pages until this step: zeroed before any copy."""
    state_copies: list[StateCopy] = field(default_factory=list)
    in_pass: list[InPassCapture] = field(default_factory=list)
    page_copies: list[PageCopy] = field(default_factory=list)
    host_writes: list[HostWrite] = field(default_factory=list)
    host_restores: list[HostRestore] = field(default_factory=list)
    prefetches: list[HostRestore] = field(default_factory=list)
    """Blocks for a waiting request (§6.6): no pass of this step reads them, so none waits."""
    disk_writes: list[DiskWriteBatch] = field(default_factory=list)
    """Host slabs to the disk tier, off the engine thread: no pass waits for them."""
    disk_reads: list[DiskReadBatch] = field(default_factory=list)
    """The disk tier to host slabs, off the engine thread: their requests wait for them."""
