"""The binary form of a save's records."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.persistence.test_cache_file import build_save
from vllm_hpc.index import SnapshotKind
from vllm_hpc.persistence import decode_tables, encode_tables


def test_every_kind_salt_and_tail_round_trips() -> None:
    saved = build_save()
    kinds = (SnapshotKind.ENDPOINT, SnapshotKind.BOUNDARY, SnapshotKind.TAP)
    salts = ("é", None)
    varied = replace(
        saved,
        roots=tuple(replace(r, cache_salt=c) for r, c in zip(saved.roots, salts, strict=True)),
        snapshots=tuple(replace(s, kind=k) for s, k in zip(saved.snapshots, kinds, strict=True)),
    )
    assert any(s.tail for s in varied.snapshots)
    assert decode_tables(encode_tables(varied)) == varied


@pytest.mark.parametrize("cut", [0, 10, 31, -1])
def test_bytes_that_do_not_frame_records_raise_value_error(cut: int) -> None:
    data = encode_tables(build_save())
    with pytest.raises(ValueError, match="bad tables"):
        decode_tables(data[:cut])
    with pytest.raises(ValueError, match="after the last record"):
        decode_tables(data + b"\0")
