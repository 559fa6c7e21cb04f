"""A sequence's hold on the cache, from admission to release (§6.4, §7.6, §7.7)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot


@dataclass(slots=True, eq=False)
class Lease:
    """The nodes a sequence holds a ref on, and its lineage for supersession.

    ``path[i]`` is the node of block i; every one of them (and the root) carries one ref of this
    lease until ``release``.
    """

    root: BlockNode
    path: list[BlockNode] = field(default_factory=list)
    resumed_from: Snapshot | None = None
    """The snapshot it resumed from, superseded once the lineage publishes past it."""
    resumed_from_endpoint: bool = False
    """Its client echoes generated turns exactly, so the planner skips the opener tap (§7.1)."""
    last_tap: Snapshot | None = None
    """Its previous tap in this prompt, superseded by its next tap (not by its endpoint)."""
    previous_frontier: int = 0
    """Frontier of its newest snapshot (resumed or published): the base of a new one's value."""
    released: bool = False

    @property
    def parent(self) -> BlockNode:
        """The node a newly committed block hangs under."""
        return self.path[-1] if self.path else self.root
