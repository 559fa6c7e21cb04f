"""The scheduler's half of the disk tier (disk-tier plan §1, §2): its journal, and which journal
key each disk copy in the index has.

The runtime plans each step's write-behind (`StepPipeline`); every worker writes its share of
the batch to its own slab file and reports the batch ended with a CRC-32 per record
(`glue/worker/disk_tier.py`). Once every rank has, `step` completes the batch in the index
and appends its entries: `BlockOnDisk` per block, then `SnapshotOnDisk`, with every rank's CRCs;
a batch any rank failed is failed in the index (its disk slabs free again) and journals nothing.
A disk copy the index drops frees its slabs (`DiskSlabPool.take_freed`): its entry gets a
`Dropped`. `step` runs once per step after the step's plan is built and before the workers get
it, and ends with one `flush_durable`: so the `Dropped` of a slab reused by a write planned in
that step is durable before any worker writes over it, and the journal never names a slab that
is not on disk.

At start-up the journal is replayed (header: the engine fingerprint, the slab geometry, the
tensor-parallel size): its live entries come back disk-only in the empty index and are written
afresh, compacted. A journal of another engine, a damaged header or none starts an empty tier,
logged with the reason; entries the replay leaves out are logged one line each. Then the most
valuable snapshots are read into the host tier's free room (`runtime/preload.py`), logged as
it starts, every 5 s while it runs and when it ends.

A hit on disk-only entries reads them back (plan §4): `checked` gives each read the journal's
CRC-32 of every record per rank, and `read_ended`, once every rank has reported the read,
completes it, or fails it with the records any rank found damaged: the index drops their disk
copies (and what hangs from them), whose `Dropped` entries the next `step` journals.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm_hpc.glue.connector_metadata import CheckedDiskRead, DiskReadReport, DiskWriteReport
from vllm_hpc.index import BlockNode, HostGeometry, Snapshot
from vllm_hpc.index.prompt import pack_tokens, unpack_tokens
from vllm_hpc.index.transfers import DiskWrite
from vllm_hpc.index.types import DiskSlabId, SlabId
from vllm_hpc.persistence import (
    BlockOnDisk,
    Dropped,
    HeaderError,
    JournalHeader,
    JournalKey,
    JournalWriter,
    Parent,
    Replay,
    SnapshotOnDisk,
    Stored,
    TenantRoot,
    needs_compaction,
    remove_temporaries,
    replay_journal,
    start_journal,
)
from vllm_hpc.persistence.journal_entries import decode_entry, encode_entry
from vllm_hpc.runtime.cache import HybridPrefixCache
from vllm_hpc.runtime.plan import DiskReadBatch

logger = logging.getLogger("vllm.vllm_hpc")

EXTRA_BYTES = 8
"""The index's extra key (u64) as the journal stores it: little-endian bytes."""


def journal_header(
    fingerprint: dict[str, Any], geometry: HostGeometry, tensor_parallel_size: int
) -> JournalHeader:
    """The header this engine's journal is valid for (the fingerprint as sorted JSON, so a
    mismatch names its keys)."""
    encoded = json.dumps(fingerprint, sort_keys=True).encode()
    return JournalHeader(encoded, geometry, tensor_parallel_size)


class DiskTier:
    """One engine core's journal of its disk tier, and the journal keys of the index's disk
    copies: by disk slab, since a slab has one owner and a parent's key is its slab's."""

    def __init__(self, path: Path, header: JournalHeader, cache: HybridPrefixCache) -> None:
        self.path = path
        self.cache = cache
        self._ranks = header.tensor_parallel_size
        self._store = cache.index.store
        self._owner: dict[DiskSlabId, JournalKey] = {}
        """Every disk slab a journaled entry names, and that entry's key."""
        self._entries: dict[JournalKey, bytes] = {}
        """The live entries, encoded (a block's tokens as Python ints would take ten times
        the memory), in journal order: what a compaction writes."""
        replay = self._replay(header)
        live = self._load(replay) if replay is not None else []
        self._next_key = replay.next_key if replay is not None else JournalKey(0)
        self.writer: JournalWriter = start_journal(path, header, live)
        if replay is not None:
            logger.info(
                "hybrid-prefix disk tier: %d of %d journaled entries back (disk-only) from %s",
                len(live),
                len(replay.live),
                path,
            )
        cache.preload.start()
        self._preload_started = self._preload_reported = time.perf_counter()
        self._preload_reporting = cache.preloading
        if cache.preloading:
            slabs = cache.index.store.slabs
            logger.info(
                "hybrid-prefix disk tier: reading the most valuable of its %d snapshots into the "
                "host tier's free %.1f MiB from the engine's first steps on",
                cache.preload.progress.queued,
                slabs.num_free * slabs.geometry.slab_bytes / 2**20,
            )

    @property
    def live_entries(self) -> int:
        return len(self._entries)

    def step(self, ended: Mapping[int, Mapping[int, DiskWriteReport]]) -> None:
        """Journal what changed since the last step: dropped disk copies, then the batches
        every rank reported (``ended``: batch -> rank -> its CRCs, None where it failed);
        then make it durable."""
        if self.cache.index.store is not self._store:  # a reset emptied the index
            self._store = self.cache.index.store
            self._owner.clear()
            self._entries.clear()
            self.writer.compact(())
        for slab in self._store.disk_slabs.take_freed():
            key = self._owner.get(slab)
            if key is not None:
                self._forget(key)
                self.writer.append(Dropped(key))
        for batch, ranks in sorted(ended.items()):
            if any(ranks.get(rank) is None for rank in range(self._ranks)):
                writes = self.cache.fail_disk_writes(batch)
                logger.warning(
                    "hybrid-prefix disk tier: write batch %d failed on rank(s) %s: %d snapshots "
                    "not written, nothing journaled",
                    batch,
                    sorted(rank for rank in range(self._ranks) if ranks.get(rank) is None),
                    len(writes),
                )
                continue
            records = zip(*(ranks[rank] or () for rank in range(self._ranks)), strict=True)
            for write in self.cache.complete_disk_writes(batch):
                self._journal(write, records)
        try:
            self.writer.flush_durable()
        except OSError as error:  # kept pending: the next step tries again
            logger.warning("hybrid-prefix disk tier: the journal is not durable yet: %s", error)
            return
        if needs_compaction(len(self._entries), self.writer.entries):
            self.writer.compact(_stored(entry) for entry in self._entries.values())
        self._report_preload()

    def _report_preload(self) -> None:
        """The start-up read's progress (long work shows progress): a line every 5 s while it
        runs, and one when it ends."""
        if not self._preload_reporting:
            return
        cache = self.cache
        progress = cache.preload.progress
        now = time.perf_counter()
        if cache.preloading and now - self._preload_reported < 5.0:
            return
        self._preload_reported = now
        self._preload_reporting = cache.preloading
        logger.info(
            "hybrid-prefix disk tier: start-up read %s: %d of %d snapshots, %.1f MiB into the "
            "host tier in %.1f s%s",
            "running" if cache.preloading else "done",
            progress.read,
            progress.queued,
            progress.slabs * cache.index.store.slabs.geometry.slab_bytes / 2**20,
            now - self._preload_started,
            f", {progress.failed} failed their check" if progress.failed else "",
        )

    # -- reads ------------------------------------------------------------------------------

    def checked(self, read: DiskReadBatch) -> CheckedDiskRead:
        """The read with each record's CRC-32 per rank, from its journal entry."""
        crcs = []
        for record in read.records:
            entry = _stored(self._entries[self._owner[DiskSlabId(record.disk[0])]])
            assert tuple(entry.slabs) == record.disk, "a record is read as it was journaled"
            crcs.append(entry.crcs)
        return CheckedDiskRead(read.batch, read.records, tuple(crcs))

    def read_ended(self, batch: int, ranks: Mapping[int, DiskReadReport]) -> None:
        """Every rank reported read ``batch``: complete it, or fail it with the records any
        rank found damaged (logged; their requests recompute from a shallower source)."""
        failed = sorted({record for report in ranks.values() for record in report})
        ended = self.cache.fail_disk_read(batch, failed) if failed else None
        if not failed:
            self.cache.complete_disk_read(batch)
        elif ended is not None:
            read, dropped = ended
            logger.warning(
                "hybrid-prefix disk tier: read batch %d failed its check at record(s) %s: "
                "%d dropped with what depends on them (snapshot at token %d); a request "
                "resumes from a shallower source",
                batch,
                failed,
                dropped,
                read.snapshot.frontier,
            )
        self._report_preload()  # the last read may end the start-up read: no step may follow

    # -- entries ----------------------------------------------------------------------------

    def _journal(self, write: DiskWrite, records: Iterator[tuple[int, ...]]) -> None:
        """Append the write's entries: its blocks, parents first, then its snapshot, each
        with its record's CRC from every rank."""
        for copy in write.blocks:
            node = copy.node
            assert node.parent is not None and node.disk_slab is not None
            self._add(
                BlockOnDisk(
                    self._new_key(),
                    self._parent(node.parent),
                    tuple(unpack_tokens(node.tokens)),
                    node.extra.to_bytes(EXTRA_BYTES, "little"),
                    SlabId(node.disk_slab),
                    next(records),
                )
            )
        snapshot = write.snapshot
        tail = snapshot.tail_disk_slab
        self._add(
            SnapshotOnDisk(
                self._new_key(),
                snapshot.kind,
                self._parent(snapshot.anchor),
                tuple(unpack_tokens(snapshot.tail)),
                tuple(SlabId(slab) for slab in snapshot.image_disk_slabs),
                None if tail is None else SlabId(tail),
                next(records),
                snapshot.hits,
            )
        )

    def _parent(self, node: BlockNode) -> Parent:
        if node.is_root:
            return TenantRoot(self._store.tree.salt_of(node))
        assert node.disk_slab is not None, "a written path is on disk, parents first"
        return self._owner[node.disk_slab]

    def _new_key(self) -> JournalKey:
        key, self._next_key = self._next_key, JournalKey(self._next_key + 1)
        return key

    def _add(self, entry: Stored) -> None:
        self.writer.append(entry)
        self._own(entry)

    def _own(self, entry: Stored) -> None:
        self._entries[entry.key] = encode_entry(entry)
        self._owner.update((DiskSlabId(slab), entry.key) for slab in entry.slabs)

    def _forget(self, key: JournalKey) -> None:
        for slab in _stored(self._entries.pop(key)).slabs:
            del self._owner[DiskSlabId(slab)]

    # -- start-up ---------------------------------------------------------------------------

    def _replay(self, header: JournalHeader) -> Replay | None:
        """The journal's replay, or None (logged) where it starts empty. A compaction killed
        before its rename left a temporary file beside the journal: removed first."""
        for stale in remove_temporaries(self.path):
            logger.warning("hybrid-prefix disk tier: removed %s, left by a killed rewrite", stale)
        try:
            replay = replay_journal(self.path, header, self._store.disk_slabs.capacity)
        except FileNotFoundError:
            logger.info("hybrid-prefix disk tier: no journal at %s: an empty tier", self.path)
            return None
        except (HeaderError, OSError) as error:
            logger.warning(
                "hybrid-prefix disk tier: journal %s not replayed (%s): an empty tier",
                self.path,
                error,
            )
            return None
        for dropped in replay.dropped:
            logger.warning(
                "hybrid-prefix disk tier: journal entry at offset %d%s left out: %s",
                dropped.offset,
                "" if dropped.key is None else f" (key {dropped.key})",
                dropped.reason,
            )
        return replay

    def _load(self, replay: Replay) -> list[Stored]:
        """Rebuild the replay's live entries disk-only in the empty index; those the index
        refuses (and what hangs from them) are logged and left out."""
        index = self.cache.index
        nodes: dict[JournalKey, BlockNode] = {}
        loaded: list[Stored] = []
        for key, entry in replay.live.items():
            parent = entry.parent if isinstance(entry, BlockOnDisk) else entry.anchor
            salt = parent.salt if isinstance(parent, TenantRoot) else None
            above = None if isinstance(parent, TenantRoot) else nodes.get(parent)
            if not isinstance(parent, TenantRoot) and above is None:
                logger.warning(
                    "hybrid-prefix disk tier: journal entry %d left out: its parent %d is not back",
                    key,
                    parent,
                )
                continue
            try:
                if isinstance(entry, BlockOnDisk):
                    nodes[key] = index.load_disk_block(
                        above,
                        pack_tokens(entry.tokens),
                        int.from_bytes(entry.extra, "little"),
                        DiskSlabId(entry.slab),
                        cache_salt=salt,
                    )
                else:
                    self._load_snapshot(entry, above, salt)
            except (ValueError, OverflowError) as error:
                logger.warning("hybrid-prefix disk tier: journal entry %d left out: %s", key, error)
                continue
            self._own(entry)
            loaded.append(entry)
        return loaded

    def _load_snapshot(
        self, entry: SnapshotOnDisk, anchor: BlockNode | None, salt: str | None
    ) -> Snapshot:
        tail = entry.tail_slab
        return self.cache.index.load_disk_snapshot(
            anchor,
            kind=entry.kind,
            tail=pack_tokens(entry.tail_tokens),
            image_slabs=[DiskSlabId(slab) for slab in entry.image_slabs],
            tail_slab=None if tail is None else DiskSlabId(tail),
            hits=entry.hits,
            cache_salt=salt,
        )


def _stored(payload: bytes) -> Stored:
    """A live entry back from the bytes `DiskTier` keeps it as."""
    entry = decode_entry(payload)
    assert not isinstance(entry, Dropped)
    return entry
