"""The prefix cache file (§5.5): a save of the host tier that outlives the process.

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
from vllm_hpc.persistence.replacement import remove_temporaries
from vllm_hpc.persistence.tables import decode_tables, encode_tables

__all__ = [
    "FORMAT_VERSION",
    "CacheFile",
    "PendingFile",
    "Section",
    "SlabTarget",
    "abandon",
    "begin_cache_file",
    "commit",
    "decode_tables",
    "encode_tables",
    "open_cache_file",
    "remove_temporaries",
    "write_cache_file",
    "write_section",
]
