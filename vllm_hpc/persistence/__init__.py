"""What outlives the process: the prefix cache file (§5.5), a save of the host tier, and the
disk tier's journal (#50), the index records of the slabs on disk.

Pure Python (stdlib and the index's records): the slab bytes come and go through callbacks, so
the worker that owns them decides how to copy them.
"""

from vllm_hpc.persistence.cache_file import (
    FORMAT_VERSION,
    CacheFile,
    PendingFile,
    Section,
    SlabTarget,
    abandon,
    begin_cache_file,
    commit,
    open_cache_file,
    write_cache_file,
    write_section,
)
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
from vllm_hpc.persistence.tables import decode_tables, encode_tables

__all__ = [
    "FORMAT_VERSION",
    "BlockOnDisk",
    "CacheFile",
    "Dropped",
    "DroppedEntry",
    "Entry",
    "HeaderError",
    "HeaderMismatch",
    "JournalHeader",
    "JournalKey",
    "JournalWriter",
    "Parent",
    "PendingFile",
    "Replay",
    "Section",
    "SlabTarget",
    "SnapshotOnDisk",
    "Stored",
    "TenantRoot",
    "abandon",
    "begin_cache_file",
    "commit",
    "decode_tables",
    "encode_tables",
    "needs_compaction",
    "open_cache_file",
    "remove_temporaries",
    "replay_journal",
    "start_journal",
    "write_cache_file",
    "write_section",
]
