"""The binary form of a save's records (`SavedCache`), little-endian and fixed-width.

Roots, then blocks parents first, then snapshots; each record a ``struct`` followed by its
variable part. Kinds are stored by a code of their own, so renaming an enum member cannot
change the format. Decoding checks framing only; `check_saved` judges the records.
"""

from __future__ import annotations

import struct
from typing import Any

from vllm_hpc.index.host_pool import HostGeometry
from vllm_hpc.index.saved_cache import SavedBlock, SavedCache, SavedRoot, SavedSnapshot
from vllm_hpc.index.types import BLOCK_BYTES_PACKED, NodeId, SlabId, SnapshotId, SnapshotKind

_HEAD = struct.Struct("<QQIII")
"""block_bytes, image_bytes, roots, blocks, snapshots."""
_ROOT = struct.Struct("<Qi")
"""id, salt length in bytes (-1: no salt), then the UTF-8 salt."""
_BLOCK = struct.Struct(f"<QQQI{BLOCK_BYTES_PACKED}s")
"""id, parent, extra, slab, tokens."""
_SNAPSHOT = struct.Struct("<QQBQQIBI")
"""id, anchor, kind, hits, frontier, tail slab (NO_SLAB: none), tail tokens, image slabs;
then the tail's packed tokens and the image slab ids (u32 each)."""
NO_SLAB = 0xFFFF_FFFF

KIND_CODES = {SnapshotKind.TAP: 0, SnapshotKind.ENDPOINT: 1, SnapshotKind.BOUNDARY: 2}
_KINDS = {code: kind for kind, code in KIND_CODES.items()}


def encode_tables(saved: SavedCache) -> bytes:
    geometry = saved.geometry
    parts = [
        _HEAD.pack(
            geometry.block_bytes,
            geometry.image_bytes,
            len(saved.roots),
            len(saved.blocks),
            len(saved.snapshots),
        )
    ]
    for root in saved.roots:
        salt = b"" if root.cache_salt is None else root.cache_salt.encode()
        parts += [_ROOT.pack(root.id, -1 if root.cache_salt is None else len(salt)), salt]
    for block in saved.blocks:
        parts.append(_BLOCK.pack(block.id, block.parent, block.extra, block.slab, block.tokens))
    for s in saved.snapshots:
        tail_slab = NO_SLAB if s.tail_slab is None else s.tail_slab
        parts += [
            _SNAPSHOT.pack(
                s.id,
                s.anchor,
                KIND_CODES[s.kind],
                s.hits,
                s.frontier,
                tail_slab,
                len(s.tail) // 4,
                len(s.image_slabs),
            ),
            s.tail,
            struct.pack(f"<{len(s.image_slabs)}I", *s.image_slabs),
        ]
    return b"".join(parts)


def decode_tables(data: bytes) -> SavedCache:
    """The records ``encode_tables`` wrote; ValueError when the bytes do not frame them."""
    try:
        return _Reader(data).saved()
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"bad tables: {exc}") from None


class ByteReader:
    """Reads fixed-width records and byte runs in order; struct.error past the end."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.at = 0

    def take(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def raw(self, size: int) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise struct.error("record runs past its bytes")
        chunk = bytes(self.data[self.at : self.at + size])
        self.at += size
        return chunk

    def rest(self) -> int:
        return len(self.data) - self.at


class _Reader(ByteReader):
    def saved(self) -> SavedCache:
        block_bytes, image_bytes, num_roots, num_blocks, num_snapshots = self.take(_HEAD)
        try:
            geometry = HostGeometry(block_bytes, image_bytes)
        except ValueError as exc:
            raise struct.error(str(exc)) from None
        roots = []
        for _ in range(num_roots):
            node, salt_len = self.take(_ROOT)
            salt = None if salt_len == -1 else self.raw(salt_len).decode()
            roots.append(SavedRoot(NodeId(node), salt))
        blocks = []
        for _ in range(num_blocks):
            node, parent, extra, slab, tokens = self.take(_BLOCK)
            blocks.append(SavedBlock(NodeId(node), NodeId(parent), tokens, extra, SlabId(slab)))
        snapshots = []
        for _ in range(num_snapshots):
            sid, anchor, kind, hits, frontier, tail_slab, tail_len, images = self.take(_SNAPSHOT)
            tail = self.raw(tail_len * 4)
            image = struct.unpack(f"<{images}I", self.raw(images * 4))
            snapshots.append(
                SavedSnapshot(
                    id=SnapshotId(sid),
                    anchor=NodeId(anchor),
                    kind=_KINDS[kind],
                    tail=tail,
                    image_slabs=tuple(SlabId(slab) for slab in image),
                    tail_slab=None if tail_slab == NO_SLAB else SlabId(tail_slab),
                    frontier=frontier,
                    hits=hits,
                )
            )
        if self.rest():
            raise struct.error(f"{self.rest()} bytes after the last record")
        return SavedCache(geometry, tuple(roots), tuple(blocks), tuple(snapshots))
