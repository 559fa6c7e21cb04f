"""Results of committing a block and publishing a snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.transfers import SnapshotWrite


class CommitOutcome(Enum):
    """What happened to the sequence's page when its block committed (§7.6)."""

    INSERTED = "inserted"
    """A new node owns the page (it is now cached, still mapped by the sequence)."""
    ADOPTED = "adopted"
    """A host-only node took the page as its device copy."""
    DUPLICATE = "duplicate"
    """The node already has a device copy: the page stays private and is freed at finish."""


@dataclass(frozen=True, slots=True, eq=False)
class CommitResult:
    node: BlockNode
    outcome: CommitOutcome

    @property
    def page_is_cached(self) -> bool:
        """True when the cache now owns the page: the sequence must not free it."""
        return self.outcome is not CommitOutcome.DUPLICATE


@dataclass(frozen=True, slots=True, eq=False)
class Publication:
    snapshot: Snapshot
    duplicate: bool
    """An identical snapshot existed: nothing was added, its recency was refreshed, and the
    offered slot and tail page went back to the pools."""
    write: SnapshotWrite | None
    """Host write-through to run, or None (duplicate, no host tier, or no room worth taking)."""
