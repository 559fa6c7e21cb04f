"""KV cache events in vLLM's own format, from the index's journal (issue #19).

A prefix-aware router reads vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared` (from
`--kv-events-config`) to learn which replica holds a prompt's blocks. The index journals its
residency changes (`vllm_hpc.index.journal`); this module turns them into vLLM's event types,
each block hashed by vLLM's own `hash_block_tokens` and configured hash function over the
plugin's 64-token block, chained through the parent's hash, so a consumer that hashes a prompt
the way vLLM does finds the blocks. The tree's tenant key stands in the first block's extra
keys as vLLM's `cache_salt` does (a LoRA adapter, prompt embeddings or media digests give keys
of the plugin's own, see `docs/kv-events.md`).

Snapshots (where a recurrent state can be resumed) have no vLLM event type, and vLLM's decoder
fails on an unknown tag inside `events`. They travel in a trailing field of the batch,
`HybridKVEventBatch.snapshot_events`: `KVEventBatch` is an array-like msgspec struct, whose
decoder drops trailing array elements, so stock consumers read the block events and ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisher,
    KVCacheEvent,
    KVEventBatch,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    ExternalBlockHash,
    hash_block_tokens,
    maybe_convert_block_hash,
)

from vllm_hpc.index import BLOCK_TOKENS, BlockNode
from vllm_hpc.index.journal import (
    AllCleared,
    JournalEvent,
    SnapshotPublished,
    SnapshotRemoved,
)
from vllm_hpc.index.journal import BlockRemoved as JournalBlockRemoved
from vllm_hpc.index.journal import BlockStored as JournalBlockStored
from vllm_hpc.index.prompt import unpack_tokens
from vllm_hpc.index.types import Medium

MEDIA = {Medium.DEVICE: MEDIUM_GPU, Medium.HOST: MEDIUM_CPU, Medium.DISK: MEDIUM_STORAGE}
"""vLLM's name of each tier (the disk is vLLM's storage medium, as its CPU offloading names a
disk-backed store)."""
assert set(MEDIA) == set(Medium), "a tier has no vLLM medium"


class SnapshotStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """A state after ``frontier`` tokens can be resumed from ``medium``: the tokens are the
    anchor block's chain (None: the tree's root) plus ``tail_token_ids``."""

    snapshot_id: int
    frontier: int
    anchor_block_hash: ExternalBlockHash | None
    tail_token_ids: list[int]
    medium: str


class SnapshotDropped(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The snapshot can no longer be resumed from ``medium``."""

    snapshot_id: int
    frontier: int
    anchor_block_hash: ExternalBlockHash | None
    medium: str


SnapshotEvent = SnapshotStored | SnapshotDropped


class HybridKVEventBatch(KVEventBatch):
    """vLLM's batch plus the snapshot events, last, where `KVEventBatch` decoders drop them."""

    snapshot_events: list[SnapshotEvent] = msgspec.field(default_factory=list)


@dataclass
class _Known:
    """A block a consumer has been told about: its hash and the media it was stored on."""

    block_hash: BlockHash
    media: set[Medium] = field(default_factory=set)


class KVEventTranslator:
    """Journal events to vLLM's event types, hashing each block once while it is resident."""

    def __init__(self, vllm_config: Any, group_idx: int) -> None:
        self._hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        if not hasattr(kv_cache_utils, "NONE_HASH"):  # the engine core sets it up normally
            kv_cache_utils.init_none_hash(self._hash_fn)
        self._group_idx = group_idx
        self._known: dict[BlockNode, _Known] = {}
        self.snapshot_events: list[SnapshotEvent] = []
        """Snapshot events translated and not yet published."""

    def translate(self, events: list[JournalEvent]) -> list[KVCacheEvent]:
        """vLLM's events for ``events``, in order; the snapshot events go to `snapshot_events`.
        A block whose last copy went keeps its hash until the batch ends: §9.4 deletes the
        snapshots anchored on it after the block's copy, in the same batch."""
        out: list[KVCacheEvent] = []
        try:
            self._translate(events, out)
        finally:
            for node in [n for n, known in self._known.items() if not known.media]:
                del self._known[node]
        return out

    def _translate(self, events: list[JournalEvent], out: list[KVCacheEvent]) -> None:
        for event in events:
            match event:
                case JournalBlockStored(node, medium, tenant):
                    out.append(self._stored(node, medium, tenant))
                case JournalBlockRemoved(node, medium):
                    out.append(self._removed(node, medium))
                case AllCleared():
                    self._known.clear()
                    out.append(AllBlocksCleared())
                case SnapshotPublished(snapshot, anchor, tail, frontier, medium):
                    self.snapshot_events.append(
                        SnapshotStored(
                            snapshot,
                            frontier,
                            self._anchor(anchor),
                            unpack_tokens(tail),
                            MEDIA[medium],
                        )
                    )
                case SnapshotRemoved(snapshot, anchor, _, frontier, medium):
                    self.snapshot_events.append(
                        SnapshotDropped(snapshot, frontier, self._anchor(anchor), MEDIA[medium])
                    )

    def _stored(self, node: BlockNode, medium: Medium, tenant: str | None) -> BlockStored:
        parent = node.parent
        assert parent is not None
        parent_hash = None if parent.is_root else self._known[parent].block_hash
        known = self._known.get(node)
        if known is None:
            known = _Known(self._hash(node, parent_hash, tenant))
            self._known[node] = known
        known.media.add(medium)
        tokens = unpack_tokens(node.tokens)
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(known.block_hash)],
            parent_block_hash=None
            if parent_hash is None
            else maybe_convert_block_hash(parent_hash),
            token_ids=tokens,
            block_size=BLOCK_TOKENS,
            lora_id=None,
            medium=MEDIA[medium],
            lora_name=None,
            extra_keys=None,
            group_idx=self._group_idx,
        )

    def _hash(
        self, node: BlockNode, parent_hash: BlockHash | None, tenant: str | None
    ) -> BlockHash:
        """vLLM's hash of the block: its tokens after the parent's hash, with vLLM's extra keys
        where the tree's key has them (the tenant on the first block; media digests)."""
        keys: list[tuple[Any, ...]] = []
        if tenant is not None:
            keys.append(("cache_salt", tenant))
        if node.extra:
            keys.append(("hybrid_prefix_extra", node.extra))
        return hash_block_tokens(
            self._hash_fn, parent_hash, unpack_tokens(node.tokens), tuple(keys) or None
        )

    def _removed(self, node: BlockNode, medium: Medium) -> BlockRemoved:
        known = self._known[node]
        known.media.discard(medium)
        return BlockRemoved(
            block_hashes=[maybe_convert_block_hash(known.block_hash)],
            medium=MEDIA[medium],
            group_idx=self._group_idx,
        )

    def _anchor(self, anchor: BlockNode) -> ExternalBlockHash | None:
        if anchor.is_root:
            return None
        return maybe_convert_block_hash(self._known[anchor].block_hash)


class SnapshotEventPublisher(EventPublisher):
    """vLLM's publisher, handed `HybridKVEventBatch`es: the scheduler's batches gain the
    snapshot events translated since the last one."""

    def __init__(self, inner: EventPublisher, translator: KVEventTranslator) -> None:
        super().__init__(inner._data_parallel_rank)
        self._inner = inner
        self._translator = translator

    def publish(self, events: Any) -> None:
        snapshots, self._translator.snapshot_events = self._translator.snapshot_events, []
        self._inner.publish(
            HybridKVEventBatch(
                ts=events.ts,
                events=events.events,
                data_parallel_rank=events.data_parallel_rank,
                snapshot_events=snapshots,
            )
        )

    def shutdown(self) -> None:
        self._inner.shutdown()

    def get_publisher_config(self) -> Any:
        return self._inner.get_publisher_config()
