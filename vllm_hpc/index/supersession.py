"""Which snapshots a lineage supersedes when it publishes a deeper one (§9.3).

In a conversation the next request resumes from the newest snapshot of its lineage, so older
ones only serve retries and edits: they go first under host pressure. A Boundary snapshot may be
shared by conversations, so it is superseded only while nobody else has continued below it.
"Nobody else" is the Boundary's own record (no hit), not only the tree below it: the blocks of
the conversations that continued can be evicted while it stays, and the tree is one chain again.
"""

from __future__ import annotations

from vllm_hpc.index.block_tree import BlockNode
from vllm_hpc.index.snapshot import Snapshot
from vllm_hpc.index.types import SnapshotKind


def single_chain_below(snapshot: Snapshot) -> bool:
    """True while every block and snapshot tail below ``snapshot`` lies on one token path."""
    node: BlockNode = snapshot.anchor
    prefix = snapshot.tail
    while True:
        children = [c for c in node.child_list() if c.tokens.startswith(prefix)]
        tails = [
            s.tail
            for s in node.snapshots or ()
            if len(s.tail) > len(prefix) and s.tail.startswith(prefix)
        ]
        if len(children) > 1:
            return False
        longest = max(tails, key=len, default=prefix)
        if not all(longest.startswith(t) for t in tails):
            return False
        if not children:
            return True
        if not children[0].tokens.startswith(longest):
            return False
        node, prefix = children[0], b""


def may_supersede(snapshot: Snapshot) -> bool:
    """Whether a lineage moving past ``snapshot`` supersedes it: not a Boundary that another
    conversation has resumed from (a hit), nor one with branches below it."""
    if snapshot.kind is not SnapshotKind.BOUNDARY:
        return True
    return snapshot.hits == 0 and single_chain_below(snapshot)
