"""Prompt identity: packed tokens, media keys and the chained block lookup hashes (§5.1).

The caller prepares a prompt once, off the scheduler's hot path, so that ``match`` only probes
hashes and compares byte slices. Token ids are packed as int32 (``array('i')``) because comparing
two 256-byte ``bytes`` slices is one C-level memcmp, far cheaper than comparing 64 Python ints.
"""

from __future__ import annotations

import itertools
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import xxhash

from vllm_hpc.index.types import BLOCK_BYTES_PACKED, BLOCK_TOKENS, TOKEN_BYTES

BlockHasher = Callable[[int, bytes, int], int]
"""``(parent lookup hash, packed block tokens, extra key) -> lookup hash``.

Injectable so tests can force collisions: the hash only picks a child, never decides equality.
"""

ROOT_HASH = 0
"""lookup_hash(-1), the seed of every chain. Tenants are separated by their root, not the seed."""

_U64 = struct.Struct("<Q")


def xxh3_block_hash(parent: int, tokens: bytes, extra: int) -> int:
    """lookup_hash(b) = xxh3_64(lookup_hash(b-1) || tokens || extra) (§5.1)."""
    return xxhash.xxh3_64_intdigest(_U64.pack(parent) + tokens + _U64.pack(extra))


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Pack token ids as int32; a caller passing ids outside that range gets a ValueError."""
    try:
        return array("i", tokens).tobytes()
    except OverflowError as exc:
        raise ValueError(f"token id does not fit in int32: {exc}") from None


def unpack_tokens(packed: bytes) -> list[int]:
    """The token ids `pack_tokens` packed."""
    tokens = array("i")
    tokens.frombytes(packed)
    return tokens.tolist()


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One Vision (or other media) item occupying the token span [begin, begin + length)."""

    begin: int
    length: int
    digest: bytes
    modality: str = "image"
    grid: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.begin + self.length

    def splits(self, position: int) -> bool:
        """True when ``position`` lies strictly inside the span: not a valid resume point."""
        return self.begin < position < self.end

    def key_bytes(self) -> bytes:
        modality = self.modality.encode()
        head = struct.pack("<QQH", self.begin, self.length, len(modality))
        grid = struct.pack(f"<{len(self.grid)}Q", *self.grid)
        return self.digest + head + modality + grid


def resume_floor(media: Sequence[MediaItem], position: int) -> int:
    """The deepest position at or below ``position`` where a snapshot may lie.

    Not strictly inside a media span (the state there mixes part of an item), and no item may
    begin in the snapshot's tail, the tokens after its last full block: the tail is compared by
    its tokens alone, and an item's placeholder tokens are the same for every image. An item
    that began in an earlier block is in the anchor path's media keys. A position that breaks
    either rule moves to the start of the item that breaks it.
    """
    for item in sorted(media, key=lambda m: m.begin, reverse=True):
        if item.begin < position and (
            item.splits(position) or item.begin >= position - position % BLOCK_TOKENS
        ):
            position = item.begin
    return position


def media_keys(media: Sequence[MediaItem], num_blocks: int) -> list[int]:
    """media_key(b) for every block: 0 unless an item overlaps block b (§5.1).

    An overlapping block's key digests that item and every earlier one, because an earlier item
    shifts later positions (rope_delta) and so changes the KV of every block it precedes.
    """
    items = sorted(media, key=lambda item: item.begin)
    for earlier, later in itertools.pairwise(items):
        if later.begin < earlier.end:
            raise ValueError(f"media spans overlap: {earlier} and {later}")
    keys = [0] * num_blocks
    digest = xxhash.xxh3_64()
    for item in items:
        if item.length <= 0 or item.begin < 0:
            raise ValueError(f"media item has an empty or negative span: {item}")
        digest.update(item.key_bytes())
        value = digest.intdigest()
        # Items are in order, so a later item sharing a block overwrites with a key that
        # already digests this one.
        last = min((item.end - 1) // BLOCK_TOKENS, num_blocks - 1)
        for block in range(item.begin // BLOCK_TOKENS, last + 1):
            keys[block] = value
    return keys


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A prompt ready for ``match``: packed tokens, per-block hashes and extra keys.

    ``cache_salt`` selects the tenant's root (see ``BlockTree``); ``block_hashes`` and
    ``block_extras`` cover every full block of the prompt.
    """

    tokens: bytes
    block_hashes: tuple[int, ...]
    block_extras: tuple[int, ...]
    media: tuple[MediaItem, ...] = ()
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    def block_tokens(self, block: int) -> bytes:
        return self.tokens[block * BLOCK_BYTES_PACKED : (block + 1) * BLOCK_BYTES_PACKED]

    def token_range(self, begin: int, end: int) -> bytes:
        return self.tokens[begin * TOKEN_BYTES : end * TOKEN_BYTES]

    def resumable_at(self, position: int) -> bool:
        """A snapshot at ``position`` may serve this prompt (see `resume_floor`)."""
        return resume_floor(self.media, position) == position


def prepare_prompt(
    tokens: Iterable[int],
    *,
    hasher: BlockHasher = xxh3_block_hash,
    media: Sequence[MediaItem] = (),
    cache_salt: str | None = None,
) -> PreparedPrompt:
    """Pack tokens and compute every full block's extra key and chained lookup hash."""
    packed = pack_tokens(tokens)
    num_blocks = len(packed) // BLOCK_BYTES_PACKED
    extras = media_keys(media, num_blocks)
    hashes = []
    parent = ROOT_HASH
    for block in range(num_blocks):
        parent = hasher(
            parent,
            packed[block * BLOCK_BYTES_PACKED : (block + 1) * BLOCK_BYTES_PACKED],
            extras[block],
        )
        hashes.append(parent)
    return PreparedPrompt(
        tokens=packed,
        block_hashes=tuple(hashes),
        block_extras=tuple(extras),
        media=tuple(sorted(media, key=lambda item: item.begin)),
        cache_salt=cache_salt,
    )
