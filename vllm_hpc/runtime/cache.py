"""HybridPrefixCache: one engine's cache runtime, driven by the scheduler (§6, §7, §8).

The scheduler calls it in this order each step::

    new_step()                                    # land last step's restores, publish captures
    lookup(request) -> Lookup                     # waiting request: source and taps (read-only)
    chunk_limit(...)                              # a prefill chunk ends at the next exact tap
    admit(request, lookup, ...) / grow(lane, ...) # pages and state row, or None: no room now
    on_scheduled(lane, start, end)                # plan the taps this chunk reaches
    take_plan() -> StepPlan                       # the copies the workers run before the step
    ... the step runs ...
    commit(lane, tokens, n)                       # full blocks join the tree, taps publish
    finish(lane, tokens, n)                       # endpoint snapshot, release

This class is the facade over four parts, one concern each, sharing the index: `Admission`
(lookup, coalescing, prefetch, admission and growth: `runtime/admission.py`), `Captures` (chunk
ends, taps, publication, endpoints: `runtime/capture.py`), `StepPipeline` (the plan being
built, and what waits for a plan to be handed out: landing restores and prefetches, deferred
captures, quarantined pages, write-through batches: `runtime/pipeline.py`) and `Preload` (the
start-up read of the disk tier into the host tier: `runtime/preload.py`). Their docstrings
hold the timing rules that keep every copy exact.

Host tier (§6.4, §7.6): write-through batches (released blocks, published snapshots) join the
plan and complete when the workers report them (`complete_writes`); until then the index keeps
their sources pinned. A restore from the host lands before the admitted request's first forward
pass reads each layer, so it completes at the next step, like a device restore. Disk tier:
write-behind and reads complete when every worker reported them (`complete_disk_writes`,
`complete_disk_read`, `fail_disk_read`).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hpc.index import InvariantError, PageId, PlannedTap, PrefixIndex
from vllm_hpc.index.device_pool import PageState
from vllm_hpc.index.host_pool import SlabUse
from vllm_hpc.index.journal import JournalEvent
from vllm_hpc.index.transfers import DiskRead, DiskWrite
from vllm_hpc.runtime.admission import Admission
from vllm_hpc.runtime.capture import Captures
from vllm_hpc.runtime.lane import Lane
from vllm_hpc.runtime.pipeline import StepPipeline
from vllm_hpc.runtime.plan import StepPlan
from vllm_hpc.runtime.preload import Preload
from vllm_hpc.runtime.records import (
    InfeasibleRequest,
    InFlight,
    Lookup,
    RequestInfo,
    RuntimeConfig,
)
from vllm_hpc.runtime.telemetry import (
    ADMISSION,
    AUDIT,
    DISK,
    HOST,
    INDEX,
    AdmissionCounters,
    AuditCounters,
    DiskCounters,
    HostCounters,
)

__all__ = [
    "HybridPrefixCache",
    "InFlight",
    "InfeasibleRequest",
    "Lookup",
    "RequestInfo",
    "RuntimeConfig",
]


class HybridPrefixCache:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.index = PrefixIndex(config.index)
        self.pipeline = StepPipeline(self.index, config.index.geometry, config.disk_write_bytes)
        self.admission = Admission(config, self.index, self.pipeline)
        self.captures = Captures(
            self.index, self.pipeline, config.in_pass_taps, config.chunk_tokens
        )
        self.preload = Preload(self.index, self.pipeline)
        """The start-up read of the disk tier into the host tier (`runtime/preload.py`)."""
        self.audits = AuditCounters()
        """Kept by the glue's cache audit, reported with the rest."""

    @property
    def admissions(self) -> AdmissionCounters:
        """Prompt tokens admitted, hit tokens by source, coalesced requests."""
        return self.admission.counters

    @property
    def host(self) -> HostCounters:
        """Bytes planned to and from the host tier."""
        return self.pipeline.host

    @property
    def disk(self) -> DiskCounters:
        """Bytes the disk tier wrote and read."""
        return self.pipeline.disk

    # -- step boundaries --------------------------------------------------------------------

    def new_step(self) -> None:
        """Start planning a step: earlier plans were handed out, so their copies precede it."""
        self.pipeline.begin_step()
        self.captures.begin_step()

    def take_plan(self) -> StepPlan:
        self.preload.plan()
        return self.pipeline.take_plan()

    @property
    def preloading(self) -> bool:
        """The start-up read has snapshots left to try or a read in flight: the engine keeps
        stepping, with or without requests, until it is done."""
        return self.preload.pending

    @property
    def settled(self) -> bool:
        """No capture waits to publish, no copy waits to be handed out or to land, and the
        last plan wrote nothing behind (its per-step bound may have left more for the next):
        what the index says is host- and disk-resident is all there will be (a stop waits for
        this)."""
        pipeline = self.pipeline
        return pipeline.idle and not pipeline.wrote_behind and not self.captures.retiring

    def write_through_at_stop(self) -> int:
        """Queue the host write-through of the snapshots only the device holds, for the next
        steps to copy and then write behind to disk (`PrefixIndex.write_through_at_stop`);
        returns how many writes were planned."""
        self.preload.stop()
        writes = self.index.write_through_at_stop()
        for write in writes:
            self.pipeline.write_through(write)
        return len(writes)

    def complete_writes(self, batches: Sequence[int]) -> None:
        self.pipeline.complete_writes(batches)

    def complete_disk_writes(self, batch: int) -> list[DiskWrite]:
        return self.pipeline.complete_disk_writes(batch)

    def fail_disk_writes(self, batch: int) -> list[DiskWrite]:
        return self.pipeline.fail_disk_writes(batch)

    def complete_disk_read(self, batch: int) -> DiskRead | None:
        read = self.pipeline.complete_disk_read(batch, self.admission.awaits)
        if read is not None:
            self.preload.ended(read, landed=True)
        return read

    def fail_disk_read(self, batch: int, failed: Sequence[int]) -> tuple[DiskRead, int] | None:
        ended = self.pipeline.fail_disk_read(batch, failed)
        if ended is not None:
            self.preload.ended(ended[0], landed=False)
        return ended

    def take_new_pages(self) -> list[PageId]:
        return self.pipeline.take_new_pages()

    # -- admission --------------------------------------------------------------------------

    def lookup(self, request: RequestInfo) -> Lookup:
        return self.admission.lookup(request)

    def cached_tokens(self, request: RequestInfo) -> int:
        return self.admission.cached_tokens(request)

    def prefetch(self, lookup: Lookup) -> None:
        self.admission.prefetch(lookup)

    def forget(self, request_id: str) -> None:
        self.admission.forget(request_id)

    def disk_wait(self, request_id: str, lookup: Lookup) -> bool:
        return self.admission.disk_wait(request_id, lookup)

    def read_ahead(self, request_id: str, lookup: Lookup) -> bool:
        return self.admission.read_ahead(request_id, lookup)

    def reading_for(self, request_id: str) -> bool:
        return self.admission.reading_for(request_id)

    def admit(
        self, request: RequestInfo, lookup: Lookup, num_new_tokens: int, lookahead: int = 0
    ) -> Lane | None:
        return self.admission.admit(request, lookup, num_new_tokens, lookahead)

    def grow(self, lane: Lane, num_tokens: int) -> list[PageId] | None:
        return self.admission.grow(lane, num_tokens)

    # -- taps, commit, finish ---------------------------------------------------------------

    def chunk_limit(
        self, taps: Sequence[PlannedTap], start: int, num_new_tokens: int, num_prompt_tokens: int
    ) -> int:
        return self.captures.chunk_limit(taps, start, num_new_tokens, num_prompt_tokens)

    def on_scheduled(self, lane: Lane, token_ids: Sequence[int], start: int, end: int) -> None:
        self.captures.on_scheduled(lane, token_ids, start, end)

    def commit(self, lane: Lane, token_ids: Sequence[int], num_computed: int) -> None:
        self.captures.commit(lane, token_ids, num_computed)

    def finish(
        self,
        lane: Lane,
        token_ids: Sequence[int],
        num_computed: int,
        in_flight: InFlight | None = None,
    ) -> None:
        self.admission.leave(lane)
        self.captures.finish(lane, token_ids, num_computed, in_flight)

    # -- reporting --------------------------------------------------------------------------

    def telemetry(self) -> dict[str, int]:
        """Cumulative counters and current levels (`vllm_hpc.runtime.telemetry`)."""
        index, store = self.index, self.index.store
        values = {m.name: getattr(index.stats, m.name) for m in INDEX}
        values.update({m.name: getattr(self.admissions, m.name) for m in ADMISSION})
        values.update({m.name: getattr(self.host, m.name.removeprefix("host_")) for m in HOST})
        values.update({m.name: getattr(self.disk, m.name.removeprefix("disk_")) for m in DISK})
        values.update({m.name: getattr(self.audits, m.name) for m in AUDIT})
        values["snapshots"] = len(store.snapshots)
        values["snapshot_slots_used"] = store.slots.capacity - store.slots.num_free
        values["active_slots_used"] = len(self.admission.live)
        values["device_pages_free"] = store.pages.num_free
        values["device_pages_evictable"] = len(store.lru)
        values["device_pages_state"] = store.state_rows_held * store.pages.row_pages
        slabs, slab_bytes = store.slabs, store.slabs.geometry.slab_bytes
        values["host_bytes_blocks"] = slabs.num_in_use(SlabUse.NODE) * slab_bytes
        values["host_bytes_images"] = slabs.num_in_use(SlabUse.IMAGE) * slab_bytes
        values["host_bytes_tails"] = slabs.num_in_use(SlabUse.TAIL) * slab_bytes
        values["host_bytes_free"] = slabs.num_free * slab_bytes
        disk = store.disk_slabs
        values["disk_bytes_used"] = (disk.capacity - disk.num_free) * slab_bytes
        values["disk_bytes_free"] = disk.num_free * slab_bytes
        return values

    def audit(self) -> None:
        """Check the index's invariants and that every private page, state row, lease,
        transfer and kept disk read is accounted for by a running request, a pending capture,
        the quarantine, a copy in flight or a waiting request (tests)."""
        self.index.check_invariants()
        live = self.admission.live | set(self.captures.retiring)
        expected = {p for lane in live for p in lane.private}
        expected |= self.pipeline.quarantined_pages
        expected |= {c.tail_page for lane in live for c in lane.captures if c.tail_page is not None}
        active = set(self.index.store.pages.pages_in(PageState.ACTIVE))
        if active != expected:
            raise InvariantError(
                f"private pages: {len(active)} held, {len(expected)} accounted for "
                f"(leaked {sorted(active - expected)[:8]}, missing {sorted(expected - active)[:8]})"
            )
        rows = {row for lane in live for row in lane.rows}
        if rows != self.index.store.active_rows or len(rows) != sum(len(x.rows) for x in live):
            raise InvariantError(
                f"state rows: {len(live)} running or retiring requests, "
                f"{len(self.index.store.active_rows)} active rows held"
            )
        transfers = self.pipeline.transfers_pending
        if self.index.num_in_flight != transfers:
            raise InvariantError(
                f"index has {self.index.num_in_flight} transfers in flight, expected {transfers}"
            )
        if self.index.num_kept_reads != self.admission.kept_reads:
            raise InvariantError(
                f"index keeps {self.index.num_kept_reads} landed disk reads pinned, "
                f"{self.admission.kept_reads} awaited by waiting requests"
            )
        leases = sum(lane.lease is not None for lane in live)
        if self.index.num_leases != leases:
            raise InvariantError(f"index holds {self.index.num_leases} leases, expected {leases}")

    @property
    def usage(self) -> float:
        """Fraction of device pages held by running requests (cached pages count as free)."""
        capacity = self.index.store.usable_pages
        return 1.0 - self.index.available_pages / capacity

    def drain_events(self) -> list[JournalEvent]:
        """The index's residency changes since the last call (KV cache events; empty unless
        the index records them)."""
        return self.index.drain_events()

    def reset(self) -> bool:
        """Drop every cached entry; refused (False) while a request runs or a disk read is in
        flight (its threads write host slabs a reset would hand out afresh).

        What finished requests left pending goes with it. Copies not yet handed to the workers
        are dropped. Those handed out run before any later step's copies and passes, so they
        cannot disturb a page or slot given out afresh, and a host write still landing writes a
        slab before any later write to it (one stream).
        """
        if self.admission.live or self.pipeline.reads_in_flight:
            return False
        self.preload.stop()
        self.pipeline.reset()
        self.captures.retiring.clear()
        self.index.clear()
        return True
