"""The radix tree of 64-token KV blocks, keyed by exact content (§5.1, §5.2).

A node's key is (parent, 64 exact tokens, extra). The chained lookup hash only picks a child in
the parent's map; tokens and extra are always compared exactly, and children whose hashes collide
are chained through ``next_same_hash``, so even a constant hash never gives a false hit.

NOTE (cache_salt): every tenant gets its own root, keyed by its ``cache_salt`` and compared
exactly. A node's key includes its parent, so the salt takes part in every block's key and in
every snapshot anchored at the root (F < 64); tenants with different salts never share an entry,
even under a forced hash collision. Roots are created on first use and dropped when idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_hpc.index.prompt import ROOT_HASH, BlockHasher, PreparedPrompt
from vllm_hpc.index.types import (
    BLOCK_BYTES_PACKED,
    BLOCK_TOKENS,
    DiskSlabId,
    Medium,
    NodeId,
    PageId,
    Residency,
    SlabId,
    resident_media,
)

if TYPE_CHECKING:
    from vllm_hpc.index.snapshot import Snapshot


@dataclass(slots=True, eq=False)
class BlockNode:
    """One committed block (or a tenant root, depth -1, no tokens and no copies).

    Identity fields never change after insertion (§10.2). The residency fields are written only
    by ``CacheStore``; the liveness counts only by ``SnapshotTable``.

    NOTE (path-closed holds): ``active_refs`` and ``restore_pins`` are taken on a node and on
    every ancestor up to the root. A sequence maps its whole path anyway; for transfers (which
    the spec pins per node) this is what guarantees that deleting an unheld subtree (§9.4) can
    never reach a node or snapshot a copy is still reading or writing.
    """

    id: NodeId
    parent: BlockNode | None = field(repr=False)
    depth: int
    lookup_hash: int = field(repr=False)
    extra: int
    tokens: bytes = field(repr=False)
    children: dict[int, BlockNode] | None = field(default=None, repr=False)
    next_same_hash: BlockNode | None = field(default=None, repr=False)
    snapshots: list[Snapshot] | None = field(default=None, repr=False)
    # Residency: a location is set iff its state is not ABSENT.
    device: Residency = Residency.ABSENT
    device_page: PageId | None = None
    host: Residency = Residency.ABSENT
    host_slab: SlabId | None = None
    disk: Residency = Residency.ABSENT
    disk_slab: DiskSlabId | None = None
    active_refs: int = 0
    """Active sequences whose path includes this node."""
    restore_pins: int = 0
    """In-flight restores and write-throughs of this node or of a node or snapshot below it."""
    disk_pins: int = 0
    """In-flight disk writes and reads of this node or of a node or snapshot below it. They
    move host and disk slabs only, so they keep the node's host and disk copies, not its device
    page (it stays on the device LRU)."""
    # Liveness: counts over the snapshots anchored in this node's subtree.
    live_snapshots_below: int = 0
    retained_snapshots_below: int = 0
    retained_id_sum: int = 0
    """Sum of the retained snapshots' ids: the owner's id when ``retained_snapshots_below == 1``."""

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def held(self) -> bool:
        return self.active_refs > 0 or self.restore_pins > 0

    @property
    def slabs_held(self) -> bool:
        """Its host and disk copies must stay: a sequence, a transfer or a disk transfer uses
        the node or something below it."""
        return self.held or self.disk_pins > 0

    @property
    def media(self) -> frozenset[Medium]:
        """The tiers holding a resident copy now (a Filling copy is not yet one)."""
        return resident_media(self.device, self.host, self.disk)

    @property
    def end(self) -> int:
        """First token position after this block (0 for a root)."""
        return (self.depth + 1) * BLOCK_TOKENS

    def path(self) -> list[BlockNode]:
        """Blocks from depth 0 down to this node, root excluded."""
        nodes: list[BlockNode] = []
        node: BlockNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def child_list(self) -> list[BlockNode]:
        result: list[BlockNode] = []
        for head in (self.children or {}).values():
            node: BlockNode | None = head
            while node is not None:
                result.append(node)
                node = node.next_same_hash
        return result


class BlockTree:
    """Structure and exact identity of the blocks; residency is ``CacheStore``'s business."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self._roots: dict[str | None, BlockNode] = {}
        self._salt_of: dict[BlockNode, str | None] = {}
        self._next_id = 0

    def _new_id(self) -> NodeId:
        self._next_id += 1
        return NodeId(self._next_id)

    @property
    def roots(self) -> list[BlockNode]:
        return list(self._roots.values())

    def root(self, salt: str | None) -> BlockNode | None:
        return self._roots.get(salt)

    def salt_of(self, root: BlockNode) -> str | None:
        """The ``cache_salt`` a tenant root is keyed by."""
        return self._salt_of[root]

    def root_for(self, salt: str | None) -> BlockNode:
        root = self._roots.get(salt)
        if root is None:
            root = BlockNode(self._new_id(), None, -1, ROOT_HASH, 0, b"")
            self._roots[salt] = root
            self._salt_of[root] = salt
        return root

    def discard_root_if_idle(self, root: BlockNode) -> None:
        """Forget a tenant root that holds nothing, so unused salts do not accumulate."""
        if root.children is None and not root.snapshots and not root.held:
            del self._roots[self._salt_of.pop(root)]

    def child(self, parent: BlockNode, tokens: bytes, extra: int) -> BlockNode | None:
        """The child with exactly these tokens and extra key, if any."""
        return self._probe(parent, self.hasher(parent.lookup_hash, tokens, extra), tokens, extra)

    @staticmethod
    def _probe(parent: BlockNode, key: int, tokens: bytes, extra: int) -> BlockNode | None:
        children = parent.children
        node = None if children is None else children.get(key)
        while node is not None and (node.extra != extra or node.tokens != tokens):
            node = node.next_same_hash
        return node

    def insert(self, parent: BlockNode, tokens: bytes, extra: int) -> BlockNode:
        """Add a child that the caller has checked does not exist yet."""
        if len(tokens) != BLOCK_BYTES_PACKED:
            raise ValueError(f"a block holds exactly 64 tokens, got {len(tokens) // 4}")
        key = self.hasher(parent.lookup_hash, tokens, extra)
        assert self._probe(parent, key, tokens, extra) is None, "block inserted twice"
        node = BlockNode(self._new_id(), parent, parent.depth + 1, key, extra, tokens)
        if parent.children is None:
            parent.children = {}
        node.next_same_hash = parent.children.get(key)
        parent.children[key] = node
        return node

    def remove_leaf(self, node: BlockNode) -> None:
        parent = node.parent
        assert parent is not None and parent.children is not None, "removing a root"
        assert node.children is None and not node.snapshots, "removing a node that has content"
        head = parent.children[node.lookup_hash]
        if head is node:
            if node.next_same_hash is None:
                del parent.children[node.lookup_hash]
            else:
                parent.children[node.lookup_hash] = node.next_same_hash
        else:
            while head.next_same_hash is not node:
                assert head.next_same_hash is not None, "node missing from its parent"
                head = head.next_same_hash
            head.next_same_hash = node.next_same_hash
        node.next_same_hash = None
        if not parent.children:
            parent.children = None
            if parent.is_root:
                self.discard_root_if_idle(parent)

    def match_path(
        self, prompt: PreparedPrompt, num_blocks: int
    ) -> tuple[BlockNode | None, list[BlockNode]]:
        """The tenant root and the longest path matching the prompt's first ``num_blocks`` blocks.

        This is the hot loop of admission: one dict probe and one 256-byte compare per block,
        using the hashes the caller prepared.
        """
        root = self._roots.get(prompt.cache_salt)
        path: list[BlockNode] = []
        if root is None:
            return None, path
        tokens, hashes, extras = prompt.tokens, prompt.block_hashes, prompt.block_extras
        node = root
        for block in range(num_blocks):
            children = node.children
            if children is None:
                break
            child = children.get(hashes[block])
            chunk = tokens[block * BLOCK_BYTES_PACKED : (block + 1) * BLOCK_BYTES_PACKED]
            extra = extras[block]
            while child is not None and (child.extra != extra or child.tokens != chunk):
                child = child.next_same_hash
            if child is None:
                break
            path.append(child)
            node = child
        return root, path

    def subtree(self, node: BlockNode) -> list[BlockNode]:
        """Every node of the subtree rooted at ``node``, children before their parents."""
        order: list[BlockNode] = []
        stack = [node]
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(current.child_list())
        order.reverse()
        return order
