"""Model-agnostic core of the hybrid prefix cache: identities, residency and accounting.

Pure Python (stdlib and ``xxhash``): it never touches tensor memory and imports neither torch
nor vLLM. ``PrefixIndex`` is the facade; ``TapPlanner`` makes every tap decision.
"""

from vllm_hpc.index.block_tree import BlockNode, BlockTree
from vllm_hpc.index.config import IndexConfig
from vllm_hpc.index.cost_model import CacheCostModel, CostModel
from vllm_hpc.index.host_pool import HostGeometry, HostSlabPool
from vllm_hpc.index.lease import Lease
from vllm_hpc.index.outcomes import CommitOutcome, CommitResult, Publication
from vllm_hpc.index.prefix_index import PrefixIndex, StaleQuoteError
from vllm_hpc.index.prompt import (
    MediaItem,
    PreparedPrompt,
    prepare_prompt,
    resume_floor,
    xxh3_block_hash,
)
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.source_choice import (
    AdmissionGrant,
    AdmissionQuote,
    GrowthPages,
    MatchResult,
    Readiness,
    SourceOption,
)
from vllm_hpc.index.stats import CacheStats
from vllm_hpc.index.tap_planner import (
    PlannedTap,
    PrefillRequest,
    TapHint,
    TapPlanner,
    TapPolicy,
    TapRequest,
    TapSource,
    plan_exact_tap,
    snapshot_kind,
)
from vllm_hpc.index.transfers import BlockCopy, BlockWrite, Prefetch, Restore, SnapshotWrite
from vllm_hpc.index.types import (
    BLOCK_TOKENS,
    InvariantError,
    NodeId,
    PageId,
    Residency,
    RowId,
    SlabId,
    SlotId,
    SnapshotId,
    SnapshotKind,
    pages_for,
)

__all__ = [
    "BLOCK_TOKENS",
    "AdmissionGrant",
    "AdmissionQuote",
    "BlockCopy",
    "BlockNode",
    "BlockTree",
    "BlockWrite",
    "CacheCostModel",
    "CacheStats",
    "CommitOutcome",
    "CommitResult",
    "CostModel",
    "GrowthPages",
    "HostGeometry",
    "HostSlabPool",
    "IndexConfig",
    "InvariantError",
    "Lease",
    "MatchResult",
    "MediaItem",
    "NodeId",
    "PageId",
    "PlannedTap",
    "Prefetch",
    "PrefillRequest",
    "PrefixIndex",
    "PreparedPrompt",
    "Publication",
    "Readiness",
    "Residency",
    "Restore",
    "RowId",
    "SlabId",
    "SlotId",
    "Snapshot",
    "SnapshotId",
    "SnapshotKind",
    "SnapshotWrite",
    "SourceOption",
    "StaleQuoteError",
    "TapHint",
    "TapPlanner",
    "TapPolicy",
    "TapRequest",
    "TapSource",
    "pages_for",
    "plan_exact_tap",
    "prepare_prompt",
    "resume_floor",
    "snapshot_kind",
    "xxh3_block_hash",
]
