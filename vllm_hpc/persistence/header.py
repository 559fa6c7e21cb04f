"""The checked start of every persistence file, and the typed reasons a header is refused.

A file opens with a prelude (magic, format version, header length, header CRC-32) and then its
header; a reader trusts nothing after it until magic, version and CRC agree. The cache file and
the disk tier's journal share it, each with its own magic.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

PRELUDE = struct.Struct("<8sIII")
"""magic, format version, header bytes, header CRC-32."""


class HeaderError(ValueError):
    """A file whose header cannot be used; the message says why. The caller starts empty."""


class HeaderMismatch(HeaderError):
    """A well-formed header of another format version, engine or geometry: ``differs`` names
    each header field that differs, the message says how."""

    def __init__(self, differs: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.differs = tuple(differs)


def pack_header(magic: bytes, version: int, header: bytes) -> bytes:
    return PRELUDE.pack(magic, version, len(header), zlib.crc32(header)) + header


def read_header(file: BinaryIO, magic: bytes, version: int, size: int, what: str) -> bytes:
    """The header after the prelude at ``file``'s position (a file of ``size`` bytes, a
    ``what``); HeaderError when it is not one, or HeaderMismatch on another format version."""
    prelude = file.read(PRELUDE.size)
    if len(prelude) < PRELUDE.size or not prelude.startswith(magic):
        raise HeaderError(f"not a {what}")
    _, found, header_bytes, header_crc = PRELUDE.unpack(prelude)
    if found != version:
        raise HeaderMismatch(
            ["format version"], f"format version {found}, this build reads {version}"
        )
    header = file.read(header_bytes)
    if len(header) < header_bytes:
        raise HeaderError(
            f"truncated: {size} bytes, the header alone is {PRELUDE.size + header_bytes}"
        )
    if zlib.crc32(header) != header_crc:
        raise HeaderError("bad checksum in the header")
    return header


def differing_keys(expected: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ between two fingerprints (one missing counts), sorted."""
    return sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
