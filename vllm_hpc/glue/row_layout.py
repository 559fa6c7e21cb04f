"""Where Gated DeltaNet states live inside vLLM's KV cache buffer (§5.4).

vLLM 0.32 puts every KV cache group in one int8 buffer (`allocate_kv_cache`): attention layer l's
page of block b starts at ``offset + l * layer_stride + b * block_stride``. The hybrid prefix
cache keeps no state pool of its own: a state is a *row* of ``row_pages`` consecutive blocks
(row r = blocks ``1 + r * row_pages ..``, block 0 being vLLM's null block), and the GDN layers'
states are packed into the bytes those blocks hold in every attention layer. So one budget,
sized by vLLM, holds KV pages and states, and the index decides at run time which row is which.

The bytes of consecutive blocks form *spans* that are contiguous across blocks:
- layer-outer layouts (LBNHC, LBHNC; ``block_stride`` = page): one span per attention layer,
  one page per block;
- block-outer layouts (BLNHC, BLHNC; ``layer_stride`` = page, ``block_stride`` = all layers'
  pages): one span, all layers' pages per block.
Both sides compute this from the same numbers: the scheduler from its `KVCacheTensor`, the
workers from the attention layers' views; torch-free, so both import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

STATE_ALIGN = 256
"""Byte alignment of each state tensor inside a row (vector loads in the GDN kernels)."""
FIRST_PAGE = 1
"""Block 0 is vLLM's null block: rows start at block 1."""


@dataclass(frozen=True, slots=True)
class Span:
    base: int
    """Byte offset of block 0's bytes in the buffer."""
    block_bytes: int
    """Bytes of one block in this span; block b starts at ``base + b * block_bytes``."""


@dataclass(frozen=True, slots=True)
class Place:
    """Where one GDN layer's state sits in every row."""

    span: int
    offset: int
    """Bytes from the row's start in its span."""


@dataclass(frozen=True, slots=True)
class RowLayout:
    row_pages: int
    num_rows: int
    spans: tuple[Span, ...]
    places: tuple[Place, ...]
    """One per GDN layer, in forward order."""

    def row_stride(self, span: int) -> int:
        return self.row_pages * self.spans[span].block_bytes

    def row_start(self, span: int) -> int:
        """Byte offset in the buffer of row 0 in span ``span``."""
        return self.spans[span].base + FIRST_PAGE * self.spans[span].block_bytes

    def address(self, layer: int) -> int:
        """Byte offset in the buffer of row 0's state of GDN layer ``layer``."""
        place = self.places[layer]
        return self.row_start(place.span) + place.offset


def aligned_state_bytes(tensor_bytes: Sequence[int]) -> int:
    """Bytes one GDN layer's state takes in a row: its tensors (conv, recurrent), each aligned."""
    return sum(_align(n) for n in tensor_bytes)


def spans_of(bases: Sequence[int], block_stride: int, page_bytes: int) -> tuple[Span, ...]:
    """The spans of the attention layers whose block-0 pages start at ``bases``; ValueError for
    a layout where a row's pages do not form them (padded pages, head-outer layouts)."""
    if block_stride == page_bytes:
        return tuple(Span(base, page_bytes) for base in bases)
    ordered = sorted(bases)
    packed = all(b == ordered[0] + i * page_bytes for i, b in enumerate(ordered))
    if packed and block_stride == len(bases) * page_bytes:
        return (Span(ordered[0], block_stride),)
    raise ValueError(
        f"KV cache layout with block stride {block_stride} and pages of {page_bytes} bytes at "
        f"{list(bases)[:4]}...: a run of blocks is not contiguous, so states cannot share it; "
        "set VLLM_KV_CACHE_LAYOUT to one that keeps a page's bytes together (LBNHC, LBHNC, "
        "BLNHC or BLHNC)"
    )


def plan_rows(
    spans: Sequence[Span], state_bytes: int, num_layers: int, num_pages: int
) -> RowLayout:
    """The fewest pages per row that hold ``num_layers`` states of ``state_bytes`` each, packed
    span by span; ``num_pages`` KV pages (block ids 1..num_pages) give the row count."""
    if state_bytes <= 0 or num_layers <= 0 or not spans:
        raise ValueError("need states to place and spans to place them in")
    row_pages = 1
    while sum(row_pages * s.block_bytes // state_bytes for s in spans) < num_layers:
        row_pages += 1
    places: list[Place] = []
    for index, span in enumerate(spans):
        fit = row_pages * span.block_bytes // state_bytes
        for slot in range(min(fit, num_layers - len(places))):
            places.append(Place(index, slot * state_bytes))
    return RowLayout(row_pages, num_pages // row_pages, tuple(spans), tuple(places))


def _align(n: int) -> int:
    return -(-n // STATE_ALIGN) * STATE_ALIGN
