"""What outlives the process: the disk tier's journal (#50, §5.5), the index records of the
slabs on disk.

Pure Python (stdlib and the index's records): the slab bytes come and go through callbacks, so
the worker that owns them decides how to copy them.
"""

from vllm_hpc.persistence.disk_journal import (
    DroppedEntry,
    JournalHeader,
    JournalWriter,
    Replay,
    needs_compaction,
    replay_journal,
    start_journal,
)
from vllm_hpc.persistence.header import HeaderError, HeaderMismatch
from vllm_hpc.persistence.journal_entries import (
    BlockOnDisk,
    Dropped,
    Entry,
    JournalKey,
    Parent,
    SnapshotOnDisk,
    Stored,
    TenantRoot,
)
from vllm_hpc.persistence.replacement import remove_temporaries

__all__ = [
    "BlockOnDisk",
    "Dropped",
    "DroppedEntry",
    "Entry",
    "HeaderError",
    "HeaderMismatch",
    "JournalHeader",
    "JournalKey",
    "JournalWriter",
    "Parent",
    "Replay",
    "SnapshotOnDisk",
    "Stored",
    "TenantRoot",
    "needs_compaction",
    "remove_temporaries",
    "replay_journal",
    "start_journal",
]
